"""A small Flax NNX vision model trained with fisher_optax optimizers, as in your own code.

A conv + MLP classifier on scikit-learn's handwritten digits (1,797 8 x 8 images shipped
with scikit-learn, no download), trained with AdamW, RACS, Alice and SOAP through
``nnx.Optimizer(model, tx, wrt=nnx.Param)``. Routing comes from the model itself
(``dims=fo.flax_dims(model)``: the conv kernels become ``kh*kw*cin x cout`` matrices,
biases and norm scales go to Adam) and ``fo.describe`` prints it.

Each optimizer's learning rate is chosen by the same rule: the best validation accuracy
over ``--lrs`` with seed 0, the grid extended by one point while the best sits at its
edge (``--max-extend`` points at most); then every seed in ``--seeds`` trains at that rate and the
test accuracy (mean and spread) and the median step time are reported::

    python examples/vision/digits.py                   # under 3 minutes on 2 CPU cores
    python examples/vision/digits.py --steps 50 --lrs 1e-2 --seeds 0   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fisher_optax as fo

OPTIMIZERS = ("adamw", "racs", "alice", "soap")


class DigitsNet(nnx.Module):
  """conv 3x3 (1 -> 16) -> LayerNorm -> conv 3x3 stride 2 (16 -> 32) -> MLP 512 -> 64 -> 10."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)
    self.hidden = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    x = nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))
    return self.head(x)


def load_digits(seed: int = 0):
  """scikit-learn's digits as ``(N, 8, 8, 1)`` float32 in [0, 1]; a fixed split into
  train (1,257), validation (180) and test (360) images."""
  from sklearn.datasets import load_digits as sk_load
  data = sk_load()
  x = (data.images / 16.0).astype(np.float32)[..., None]
  y = data.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  test, val, train = order[:360], order[360:540], order[540:]
  return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test])}


def make_optimizer(name: str, lr: float, model: nnx.Module) -> optax.GradientTransformation:
  dims = fo.flax_dims(model)
  if name == "adamw":
    return optax.adamw(lr, weight_decay=1e-4)
  if name == "racs":
    return fo.racs(lr, dims=dims, weight_decay=1e-4)
  if name == "alice":
    # rank 8: a conv1 kernel is a 9 x 16 matrix, where a larger rank would hold more
    # state than Adam (fo.describe marks such leaves)
    return fo.alice(lr, rank=8, interval=50, dims=dims, weight_decay=1e-4)
  if name == "soap":
    return fo.soap(lr, dims=dims, weight_decay=1e-4)
  raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def loss_fn(model, x, y):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def accuracy(model, x, y):
  return jnp.mean(jnp.argmax(model(x), -1) == y)


def train(name: str, lr: float, seed: int, data: dict, *, steps: int, batch: int,
          show_routing: bool = False) -> dict:
  model = DigitsNet(nnx.Rngs(seed))
  tx = make_optimizer(name, lr, model)
  if show_routing:
    print(f"\n{name}: routing of the model's parameters")
    print(fo.describe(tx, nnx.state(model, nnx.Param)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x_train, y_train = data["train"]
  rng = np.random.default_rng(seed)
  times, losses = [], []
  for step in range(steps):
    idx = rng.integers(0, len(y_train), batch)
    t0 = time.perf_counter()
    loss = train_step(model, optimizer, jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))
    loss = float(loss)  # waits for the step
    times.append(time.perf_counter() - t0)
    losses.append(loss)
  if not np.isfinite(losses[-1]):
    return dict(val=0.0, test=0.0, step_ms=float("nan"), loss=float("nan"))
  return dict(val=float(accuracy(model, *map(jnp.asarray, data["val"]))),
              test=float(accuracy(model, *map(jnp.asarray, data["test"]))),
              step_ms=1e3 * float(np.median(times[1:] if steps > 1 else times)),
              loss=float(np.mean(losses[-10:])))


def _extend(tried: list, best: float, budget: int) -> list:
  """The grid rule's extension: while the best rate sits at an edge of the rates tried,
  one more point beyond it, a factor of the grid's last step away (``budget`` more at
  most)."""
  if budget <= 0 or len(tried) < 2:
    return []
  if best == tried[-1]:
    return [best * tried[-1] / tried[-2]]
  if best == tried[0]:
    return [best * tried[0] / tried[1]]
  return []


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1",
                  help="learning-rate grid, the same for every optimizer")
  ap.add_argument("--max-extend", type=int, default=2,
                  help="points added beyond an edge of the grid where the best rate sits")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--out", default=None, help="write results.json here")
  args = ap.parse_args(argv)
  names = args.optimizers.split(",")
  lrs = [float(v) for v in args.lrs.split(",")]
  seeds = [int(s) for s in args.seeds.split(",")]
  data = load_digits()
  results = {}
  for name in names:
    sweep = {}
    grid = list(lrs)
    while grid:
      for lr in grid:
        sweep[lr] = train(name, lr, seeds[0], data, steps=args.steps, batch=args.batch,
                          show_routing=(len(sweep) == 0 and name != "adamw"))
        print(f"{name:6s} lr {lr:<7g} val acc {sweep[lr]['val']:.3f}  "
              f"loss {sweep[lr]['loss']:.3f}", flush=True)
      best = max(sorted(sweep), key=lambda lr: sweep[lr]["val"])
      grid = _extend(sorted(sweep), best, args.max_extend - (len(sweep) - len(lrs)))
    runs = [sweep[best]] + [train(name, best, s, data, steps=args.steps, batch=args.batch)
                            for s in seeds[1:]]
    test = np.array([r["test"] for r in runs])
    edge = len(sweep) > 1 and best in (min(sweep), max(sweep))
    results[name] = dict(lr=best, lr_at_grid_edge=edge, test_mean=float(test.mean()), test_std=float(test.std()),
                         step_ms=float(np.median([r["step_ms"] for r in runs])),
                         sweep={str(k): v for k, v in sweep.items()})
  base = results.get("adamw", next(iter(results.values())))["step_ms"]
  print(f"\n{args.steps} steps of batch {args.batch}; learning rate by validation accuracy "
        f"over {lrs}, extended at an edge (seed {seeds[0]}); test accuracy over seeds {seeds}")
  print(f"{'optimizer':10s} {'lr':>7s} {'test accuracy':>16s} {'ms/step':>8s} {'vs first':>9s}")
  for name, r in results.items():
    print(f"{name:10s} {r['lr']:7g} {r['test_mean']:9.3f} ± {r['test_std']:.3f} "
          f"{r['step_ms']:8.2f} {r['step_ms'] / base:8.2f}x"
          + ("  (best rate at the grid's edge)" if r["lr_at_grid_edge"] else ""))
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
