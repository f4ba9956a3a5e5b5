"""The fallback's learning rate on user-style models: which leaves reach the fallback,
and at which rate they train there.

Two small character-level language models as users write them, on the bundled
Shakespeare corpus (fresh batches every step, eval loss on held-out plays):

* ``linen``: a 2-layer Flax Linen LM (``nn.SelfAttention``: its kernels are 3-D);
* ``equinox``: a 2-layer Equinox LM whose blocks are stacked with ``eqx.filter_vmap``
  and run with ``jax.lax.scan`` (every weight has a leading layer axis).

Without ``dims``, the 3-D kernels (attention in Linen, every stacked weight in Equinox) go
to the fallback, which runs Adam at the structured rule's learning rate unless
``fallback_learning_rate`` says otherwise. Each configuration is run for ``--seeds`` and
its final eval loss printed as mean +- std::

  python benchmarks/fallback_lr.py --models linen,equinox --steps 600 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fisher_optax as fo  # noqa: E402

V, D, T, B, HEADS = 96, 64, 64, 16, 4


def corpus():
  from examples.llama import data
  train, ev = data.split_documents("shakespeare")
  text_tr, text_ev = "\n".join(train.values()), "\n".join(ev.values())
  chars = sorted(set(text_tr), key=lambda c: -text_tr.count(c))[:V - 1]
  table = {c: i + 1 for i, c in enumerate(chars)}  # 0: any other character
  enc = lambda t: np.array([table.get(c, 0) for c in t], np.int32)  # noqa: E731
  return enc(text_tr), enc(text_ev)


def batches(ids, seed, steps):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    s = rng.integers(0, len(ids) - T - 1, B)
    yield jnp.asarray(np.stack([ids[a:a + T + 1] for a in s]))


# ------------------------------------------------------------------------- models


def linen_model():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.SelfAttention(num_heads=HEADS)(nn.LayerNorm()(x),
                                            mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
      x = x + y
      return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))

  class LM(nn.Module):
    @nn.compact
    def __call__(self, t):
      x = nn.Embed(V, D, name="embed")(t) + self.param("pos", nn.initializers.normal(0.02), (T, D))
      for _ in range(2):
        x = Block()(x)
      return nn.Dense(V, name="head")(nn.LayerNorm()(x))

  module = LM()
  tokens = jnp.zeros((B, T), jnp.int32)

  def init(seed):
    return module.init(jax.random.key(seed), tokens)["params"]

  return init, lambda p, t: module.apply({"params": p}, t), lambda: fo.linen_dims(module, tokens)


def equinox_model():
  import equinox as eqx

  class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
      k1, k2, k3 = jax.random.split(key, 3)
      self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
      self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
      self.up, self.down = eqx.nn.Linear(D, 4 * D, key=k2), eqx.nn.Linear(4 * D, D, key=k3)

    def __call__(self, x):
      y = jax.vmap(self.ln1)(x)
      x = x + self.attn(y, y, y, mask=jnp.tril(jnp.ones((T, T), bool)))
      return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(jax.vmap(self.ln2)(x))

  class LM(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: Block
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
      k1, k2, k3, k4 = jax.random.split(key, 4)
      self.embed = eqx.nn.Embedding(V, D, key=k1)
      self.pos = 0.02 * jax.random.normal(k2, (T, D))
      self.blocks = eqx.filter_vmap(Block)(jax.random.split(k3, 2))
      self.ln, self.head = eqx.nn.LayerNorm(D), eqx.nn.Linear(D, V, key=k4)

    def __call__(self, t):
      x = jax.vmap(self.embed)(t) + self.pos
      dynamic, static = eqx.partition(self.blocks, eqx.is_array)

      def layer(x, block):
        return eqx.combine(block, static)(x), None

      x, _ = jax.lax.scan(layer, x, dynamic)
      return jax.vmap(lambda h: self.head(self.ln(h)))(x)

  holder = {}

  def init(seed):
    holder["model"] = LM(jax.random.key(seed))
    params, holder["static"] = eqx.partition(holder["model"], eqx.is_inexact_array)
    return params

  def apply(params, tokens):
    return jax.vmap(eqx.combine(params, holder["static"]))(tokens)

  return init, apply, lambda: fo.equinox_dims(holder["model"])


MODELS = {"linen": linen_model, "equinox": equinox_model}


# ------------------------------------------------------------------------ configs


def configs(dims_rule):
  """``{label: optimizer}``: Adam alone at three rates, and RACS at the paper's 2e-2
  with and without dims, its fallback at 2e-2 (the default) or at Adam's 3e-3."""
  return {
      "adam 1e-3": lambda: optax.adam(1e-3),
      "adam 3e-3": lambda: optax.adam(3e-3),
      "adam 2e-2": lambda: optax.adam(2e-2),
      "racs 2e-2, no dims": lambda: fo.racs(2e-2),
      "racs 2e-2, no dims, fallback 3e-3": lambda: fo.racs(2e-2, fallback_learning_rate=3e-3),
      "racs 2e-2, dims": lambda: fo.racs(2e-2, dims=dims_rule()),
      "racs 2e-2, dims, fallback 3e-3": lambda: fo.racs(2e-2, dims=dims_rule(),
                                                         fallback_learning_rate=3e-3),
      # the paper's routing: embeddings and the output layer on the fallback too
      "racs 2e-2, dims, embed+head on fallback": lambda: fo.racs(
          2e-2, dims=dims_rule(), mask=fo.path_mask(exclude=["embed", "head"])),
      # a control without RACS: Adam at the two speeds "racs 2e-2, no dims" gives its two
      # parts -- 2-D leaves at 1e-3 (about RACS's alpha * lr), the rest at 2e-2
      "adam: 2-D leaves 1e-3, the rest 2e-2": lambda: _two_speed_adam(1e-3, 2e-2),
  }


def _two_speed_adam(matrix_lr, other_lr):
  def labels(params):
    return jax.tree.map(lambda m: "m" if m else "o", fo.default_mask(params))
  return optax.multi_transform({"m": optax.adam(matrix_lr), "o": optax.adam(other_lr)}, labels)


def run(init, apply, make_tx, seed, steps, train_ids, eval_ids):
  params = init(seed)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the unrouted-kernel warning is what is measured here
    tx = make_tx()
    state = tx.init(params)

  def loss_fn(p, batch):
    logits = apply(p, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for batch in batches(train_ids, seed, steps):
    params, state, loss = step(params, state, batch)
  ev = jax.jit(loss_fn)
  return float(np.mean([float(ev(params, b)) for b in batches(eval_ids, 1000, 16)]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default="linen,equinox")
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--configs", default=None, help="labels separated by ; (default: all)")
  ap.add_argument("--json", default=None, help="write the results here")
  ap.add_argument("--table", default=None, help="write a Markdown table here")
  args = ap.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  train_ids, eval_ids = corpus()
  results = []
  if args.json and args.configs and pathlib.Path(args.json).exists():
    results = json.loads(pathlib.Path(args.json).read_text())["results"]  # add to it
  print(f"{args.steps} steps, batch {B} x {T} characters, seeds {seeds}; final eval loss")
  for model_name in args.models.split(","):
    init, apply, dims_rule = MODELS[model_name]()
    init(seeds[0])  # the dims rule reads the model built here
    for label, make_tx in configs(dims_rule).items():
      if args.configs and label not in args.configs.split(";"):
        continue
      t0 = time.time()
      losses = [run(init, apply, make_tx, s, args.steps, train_ids, eval_ids) for s in seeds]
      results = [r for r in results if (r["model"], r["config"]) != (model_name, label)]
      results.append(dict(model=model_name, config=label, losses=losses))
      print(f"{model_name:8s} {label:36s} {np.mean(losses):.3f} +- {np.std(losses):.3f}"
            f"   ({time.time() - t0:.0f} s)", flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(dict(steps=args.steps, seeds=seeds,
                                                       results=results), indent=1))
  if args.table:
    pathlib.Path(args.table).write_text(table(results))


def table(results: list) -> str:
  """A Markdown table: one row per configuration, one column per model."""
  models = list(dict.fromkeys(r["model"] for r in results))
  rows = list(dict.fromkeys(r["config"] for r in results))
  cell = {(r["model"], r["config"]): r["losses"] for r in results}
  out = ["| optimizer | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
  for c in rows:
    vals = [cell.get((m, c)) for m in models]
    out.append(f"| {c} | " + " | ".join(
        "-" if v is None else f"{np.mean(v):.3f} ± {np.std(v):.3f}" for v in vals) + " |")
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  main()
