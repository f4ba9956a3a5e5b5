"""Time the jitted optimizer update alone against optax.adam, in the same process.

    python benchmarks/step_time.py [--preset 60M] [--reps 20] [--layout auto] [--json]

For the parameter shapes of a LLaMA preset (float32, or ``--dtype bfloat16``), each
optimizer's jitted ``update`` (gradients -> updates and new state) is timed on an
ordinary step and on a refresh step (a step whose count triggers the subspace/eigenbasis
refresh; timed in the first ``--refresh-reps`` rounds only, since one can take seconds),
interleaved with ``optax.adam`` in rounds, several repetitions, medians. Printed per
optimizer: the ratio to Adam of an ordinary step, of a refresh step, and amortised over
the refresh interval K (``((K - 1) * ordinary + refresh) / K``), plus compile time.
``--hparams`` passes keywords to every fisher_optax optimizer of the run (e.g.
``'{"refresh": "power_qr"}'``).

``--compile-only`` lowers and compiles each update on abstract shapes (no arrays, no
timing runs) and prints compile seconds and their ratio to Adam's, each optimizer
between two Adam compiles (their mean is the reference: load on the machine drifts);
``--repeat N`` does that N times per optimizer and reports the fastest round; each row
also gives the update's XLA temporary memory (``compiled.memory_analysis()``: buffers
beyond its arguments and outputs, e.g. ``stack_matrices``' copy of the matrix
gradients) against Adam's.
``--stacked`` gives it the tree of a model that stacks its layers (``nnx.scan``-style:
one ``[L, m, n]`` leaf per layer parameter, routed with ``fo.MatrixDims()``, norm
stacks ``[L, d]`` to the fallback), the layout of scanned-layer LLaMA implementations;
``--layers`` overrides the preset's depth (compile time against depth).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fisher_optax as fo
from fisher_optax import stacking
from examples.llama import presets
from examples.llama.model import Llama

LAYOUTS = {"auto": "auto", "stacked": True, "per-leaf": False}

OPTIMIZERS = ("racs", "alice", "alice0", "galore", "fira", "apollo", "apollo_mini",
              "eigen_adam", "soap", "shampoo")

# optax's own optimizers of the same kinds, as yardsticks (``--optimizers adafactor,...``):
# factored row/column second moments (as RACS's two-sided scaling) and optax.contrib's
# GaLore at the preset's rank and refresh interval, its embeddings left to its base Adam
# as ours are; ``muon`` (optax.contrib.muon) comes from examples/llama/presets.py, routed
# as in the LLaMA runs.
PEERS = {
    "adafactor": lambda preset, lr: optax.adafactor(lr),
    "optax_galore": lambda preset, lr: optax.contrib.galore(
        lr, rank=presets.LOW_RANK[preset][0], update_proj_gap=presets.LOW_RANK[preset][2],
        mask=fo.path_mask(exclude=["embed"])),
}


def build(name: str, preset: str, learning_rate: float = 1e-3, **kw):
  """``name``'s transformation for ``preset``: Adam, an optax peer (:data:`PEERS`), or a
  LLaMA-preset optimizer (``kw``: e.g. ``stack_matrices``, ``dims``, ours only)."""
  if name == "adam":
    return optax.adam(learning_rate)
  if name in PEERS:
    return PEERS[name](preset, learning_rate)
  return presets.make_optimizer(name, preset, learning_rate, **kw)


def interval_of(name: str, preset: str) -> int:
  return {"eigen_adam": 10, "soap": 10, "shampoo": 10, "racs": 1, "adafactor": 1, "swan": 1,
          "muon": 1, "fo_muon": 1}.get(
      name, presets.LOW_RANK[preset][2])


def setup(name: str, preset: str, stack_matrices="auto", hparams: dict | None = None,
          dtype: str = "float32"):
  """``stack_matrices``: ``True``, ``False`` or ``"auto"`` (the library's default);
  ``hparams``: keywords of a fisher_optax optimizer (ignored for Adam and the peers);
  ``dtype``: of the parameters and gradients (``bfloat16``: as a bfloat16 model trains,
  where ``optax.adam`` keeps its moments in bfloat16)."""
  cfg = presets.model_config(preset, dtype=dtype, param_dtype=dtype)
  params = nnx.state(Llama(cfg, nnx.Rngs(0)), nnx.Param)
  kw = dict(hparams or {}, stack_matrices=stack_matrices) if _ours(name) else {}
  tx = build(name, preset, **kw)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(1), p.shape, p.dtype) * 1e-2,
                       params)
  step = jax.jit(tx.update)
  t0 = time.perf_counter()
  state = tx.init(params)
  step = step.lower(grads, state, params).compile()
  compile_s = time.perf_counter() - t0
  u, state = step(grads, state, params)          # step 1 (a refresh for every method)
  jax.block_until_ready(u)
  return step, grads, state, params, compile_s


def abstract_params(preset: str, *, stacked: bool = False, layers: int | None = None):
  """``preset``'s parameter shapes (abstract), per-layer leaves or stacked ``[L, ...]``;
  returns ``(params, dims)``, ``dims`` None for the per-layer tree."""
  overrides = {} if layers is None else dict(layers=layers)
  cfg = presets.model_config(preset, **overrides)
  params = nnx.to_pure_dict(nnx.eval_shape(lambda: nnx.state(Llama(cfg, nnx.Rngs(0)),
                                                              nnx.Param)))
  if not stacked:
    return params, None
  per_layer = [params["layers"][i] for i in sorted(params["layers"])]
  params = dict(params, layers=jax.tree.map(
      lambda *xs: jax.ShapeDtypeStruct((len(xs),) + xs[0].shape, xs[0].dtype), *per_layer))

  def dims_of(path, x):
    if len(x.shape) < 2 or "norm" in jax.tree_util.keystr(path):
      return fo.NOT_A_MATRIX
    return fo.MatrixDims()

  return params, jax.tree_util.tree_map_with_path(dims_of, params)


def _ours(name: str) -> bool:
  return name not in ("adam", "adamw", "muon") and name not in PEERS


def compile_seconds(name: str, preset: str, *, stacked: bool = False,
                    layers: int | None = None, stack_matrices="auto") -> tuple:
  """Seconds to trace, lower and compile ``name``'s jitted update on ``preset``'s shapes,
  and the compiled update's temporary memory in bytes (XLA's ``memory_analysis``)."""
  params, dims = abstract_params(preset, stacked=stacked, layers=layers)
  kw = {} if dims is None or not _ours(name) else dict(dims=dims)
  if _ours(name):
    kw["stack_matrices"] = stack_matrices
  tx = build(name, preset, **kw)
  state = jax.eval_shape(tx.init, params)
  jax.clear_caches()
  t0 = time.perf_counter()
  compiled = jax.jit(tx.update).lower(params, state, params).compile()
  seconds = time.perf_counter() - t0
  memory = compiled.memory_analysis()
  return seconds, (memory.temp_size_in_bytes if memory is not None else float("nan"))


def compile_only(names, preset, as_json, *, stacked=False, layers=None, stack_matrices="auto",
                 repeat=1, jsonl=False):
  """Compile seconds per optimizer and their ratio to Adam's. Each of ``repeat`` rounds
  compiles the optimizer between two Adam compiles; the figures are the best (least
  loaded) of the rounds: the optimizer's fastest compile over the mean of the Adam
  compiles around it in that round (a 2-core machine's readings of one build move by
  ~15%). Each result also lists every round's seconds in order (``rounds_s``, and
  ``adam_rounds_s``: the Adam compile just before each round; the first optimizer's first
  is the process's first compile of Adam): with JAX's persistent compilation cache on,
  a first round fills the cache and a second reads it back. ``jsonl``: one JSON line per
  optimizer as it is measured."""
  kw = dict(stacked=stacked, layers=layers)
  adam, adam_temp = compile_seconds("adam", preset, **kw)
  results = []
  for name in names:
    rounds, before = [], []
    for _ in range(repeat):
      c, temp = compile_seconds(name, preset, stack_matrices=stack_matrices, **kw)
      adam_next, _ = compile_seconds("adam", preset, **kw)
      rounds.append((c, 0.5 * (adam + adam_next)))
      before.append(adam)
      adam = adam_next
    c, ref = min(rounds)
    results.append(dict(optimizer=name, preset=preset, stacked=stacked, layers=layers,
                        stack_matrices=stack_matrices, repeat=repeat,
                        compile_s=c, adam_compile_s=ref, ratio_compile=c / ref,
                        ratios=[x / a for x, a in rounds],
                        rounds_s=[x for x, _ in rounds], adam_rounds_s=before,
                        temp_mib=temp / 2**20, adam_temp_mib=adam_temp / 2**20))
    if jsonl:
      print(json.dumps(results[-1]), flush=True)
    elif not as_json:
      spread = (f"  (rounds {min(x / a for x, a in rounds):.2f}-"
                f"{max(x / a for x, a in rounds):.2f}x)" if repeat > 1 else "")
      print(f"{name:12s} compile {c:5.1f}s  adam {ref:4.1f}s  ratio {c / ref:5.2f}x{spread}"
            f"  temp {temp / 2**20:7.1f} MiB (adam {adam_temp / 2**20:.1f})", flush=True)
  if as_json:
    print(json.dumps(results, indent=2))


def time_call(step, grads, state, params) -> float:
  t0 = time.perf_counter()
  u, s = step(grads, state, params)
  jax.block_until_ready((u, s))
  return time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="60M", choices=list(presets.MODELS))
  ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--refresh-reps", type=int, default=3,
                  help="rounds that also time a refresh step (a refresh can take seconds)")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--compile-only", action="store_true",
                  help="compile each update on abstract shapes; no timing runs")
  ap.add_argument("--stacked", action="store_true",
                  help="with --compile-only: layers stacked as [L, m, n] leaves (nnx.scan-style)")
  ap.add_argument("--layers", type=int, default=None,
                  help="with --compile-only: override the preset's number of layers")
  ap.add_argument("--repeat", type=int, default=1,
                  help="with --compile-only: rounds per optimizer; report the fastest")
  ap.add_argument("--stack-matrices", action="store_true",
                  help="build the fisher_optax optimizers with stack_matrices=True "
                       "(the same as --layout stacked)")
  ap.add_argument("--layout", default="auto", choices=sorted(LAYOUTS),
                  help="stack_matrices of the fisher_optax optimizers: the library's "
                       "default 'auto' (stacked on GPU/TPU, per-leaf on CPU), or fixed")
  ap.add_argument("--jsonl", action="store_true",
                  help="print each optimizer's result as one JSON line when it is measured")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="parameter and gradient dtype (timing runs only)")
  ap.add_argument("--hparams", type=json.loads, default=None,
                  help='keywords for every fisher_optax optimizer, e.g. \'{"refresh": '
                       '"power_qr"}\' (timing runs only)')
  args = ap.parse_args()
  args.stack_matrices = True if args.stack_matrices else LAYOUTS[args.layout]
  names = [n for n in args.optimizers.split(",") if n]
  if args.compile_only:
    return compile_only(names, args.preset, args.json, stacked=args.stacked, layers=args.layers,
                        stack_matrices=args.stack_matrices, repeat=args.repeat,
                        jsonl=args.jsonl)
  if args.stacked or args.layers is not None:
    ap.error("--stacked and --layers apply to --compile-only")
  adam = setup("adam", args.preset, dtype=args.dtype)
  results = []
  for name in names:
    r = measure(name, args.preset, reps=args.reps, refresh_reps=args.refresh_reps,
                stack_matrices=args.stack_matrices, adam=adam, hparams=args.hparams,
                dtype=args.dtype)
    results.append(r)
    if args.jsonl:
      print(json.dumps(r), flush=True)
    elif not args.json:
      print(f"{name:12s} ordinary {r['ratio_ordinary']:6.2f}x  refresh "
            f"{r['ratio_refresh']:7.2f}x  amortised(K={r['interval']}) "
            f"{r['ratio_amortised']:6.2f}x  compile {r['compile_s']:5.1f}s "
            f"(adam {r['adam_compile_s']:.1f}s)  [adam {r['adam_ms']:.1f} ms]", flush=True)
  if args.json:
    print(json.dumps(results, indent=2))


def measure(name: str, preset: str, *, reps: int = 10, refresh_reps: int = 3,
            stack_matrices="auto", adam=None, hparams: dict | None = None,
            dtype: str = "float32") -> dict:
  """Times ``name``'s update on an ordinary and a refresh step in rounds interleaved with
  Adam's (medians); ratios to Adam's update, amortised over the refresh interval."""
  adam = adam or setup("adam", preset, dtype=dtype)
  step, grads, state, params, compile_s = setup(name, preset, stack_matrices, hparams, dtype)
  k = interval_of(name, preset)
  # states just before an ordinary step (count 1) and just before a refresh (count k)
  ordinary_state = state
  refresh_state = with_count(state, k)
  t_adam, t_ord, t_ref = [], [], []
  for rep in range(reps):  # interleaved rounds
    t_adam.append(time_call(adam[0], adam[1], adam[2], adam[3]))
    t_ord.append(time_call(step, grads, ordinary_state, params))
    if rep < refresh_reps or k == 1:
      t_ref.append(time_call(step, grads, refresh_state, params))
  a, o, r = (statistics.median(x) for x in (t_adam, t_ord, t_ref))
  amort = ((k - 1) * o + r) / k
  return dict(optimizer=name, preset=preset, stack_matrices=stack_matrices,
              hparams=hparams if _ours(name) else None, dtype=dtype,
              stacked=bool(_ours(name) and stacking.resolve(stack_matrices)),
              matmul_precision=str(jax.config.jax_default_matmul_precision),
              backend=jax.default_backend(), adam_ms=a * 1e3, ordinary_ms=o * 1e3,
              refresh_ms=r * 1e3, interval=k, ratio_ordinary=o / a, ratio_refresh=r / a,
              ratio_amortised=amort / a,
              compile_s=compile_s, adam_compile_s=adam[4])


def with_count(state, k):
  """Sets every scalar int32 step counter to ``k`` (the next update is step k + 1)."""
  return jax.tree.map(lambda x: jnp.asarray(k, x.dtype)
                      if (x.dtype == jnp.int32 and x.shape == ()) else x, state)


if __name__ == "__main__":
  main()
