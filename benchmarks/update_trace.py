"""Record, or compare, the updates of every named optimizer over a few steps with refreshes.

    python benchmarks/update_trace.py --out before.npz      # in one checkout
    python benchmarks/update_trace.py --out after.npz       # in another
    python benchmarks/update_trace.py --compare before.npz after.npz

A guard for refactors that must not change the mathematics: each optimizer runs
``--steps`` jitted updates (refresh interval 2, so several refreshes) on a small tree of
matrices (a square one, a wide one, a tall one, a stack of two) and a vector, from
seeded gradients, and the updates of every step are saved. ``--compare`` prints, per
optimizer, the largest difference of any update relative to that update's largest
entry, and exits 1 when one exceeds ``--tol`` (float32 rounding: 1e-5 by default).

The script uses only the public API, so it runs on any checkout of the package
(``PYTHONPATH=<checkout> python benchmarks/update_trace.py ...``). Optimizers whose
updates depend on random draws are recorded in their draw-free setting (Alice-type
methods with ``leading = rank`` draw nothing); APOLLO's projections are random by design
and are left out (their distribution is tested in ``tests/test_apollo.py``).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax as fo

SETTINGS = {
    "racs": {},
    "alice": dict(rank=3, leading=3, interval=2),
    "alice0": dict(rank=3, leading=3, interval=2),
    "alice_soap": dict(rank=3, leading=3, interval=2),
    "galore": dict(rank=3, interval=2),
    "fira": dict(rank=3, interval=2),
    "eigen_adam": dict(interval=2),
    "soap": dict(precondition_frequency=2),
    "shampoo": dict(interval=2),
    "swan": {},
    "muon": {},
}


def tree(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  shapes = {"square": (8, 8), "wide": (6, 10), "tall": (12, 5), "stack": (2, 6, 9),
            "bias": (10,)}
  return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def record(steps: int) -> dict:
  params = jax.tree.map(jnp.zeros_like, tree(0))
  dims = {k: fo.MatrixDims() if v.ndim >= 2 else fo.NOT_A_MATRIX for k, v in params.items()}
  out = {}
  for name, kw in SETTINGS.items():
    tx = getattr(fo, name)(0.01, dims=dims, **kw)
    state, step = tx.init(params), jax.jit(tx.update)
    for t in range(steps):
      updates, state = step(tree(100 + t), state, params)
      for k, u in updates.items():
        out[f"{name}/{t}/{k}"] = np.asarray(u)
  return out


def compare(a_path: str, b_path: str, tol: float) -> int:
  a, b = np.load(a_path), np.load(b_path)
  worst: dict = {}
  for key in sorted(set(a.files) | set(b.files)):
    name = key.split("/")[0]
    if key not in a.files or key not in b.files:
      worst[name] = float("inf")
      continue
    x, y = a[key], b[key]
    scale = max(float(np.max(np.abs(x))), 1e-30)
    worst[name] = max(worst.get(name, 0.0), float(np.max(np.abs(x - y))) / scale)
  bad = 0
  for name, err in worst.items():
    flag = "ok" if err <= tol else "DIFFERS"
    bad += err > tol
    print(f"{name:12s} max |a - b| / max |a| over all steps and leaves: {err:.2e}  {flag}")
  return 1 if bad else 0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out")
  ap.add_argument("--steps", type=int, default=7)
  ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
  ap.add_argument("--tol", type=float, default=1e-5)
  args = ap.parse_args()
  if args.compare:
    sys.exit(compare(*args.compare, args.tol))
  if not args.out:
    ap.error("give --out FILE or --compare A B")
  np.savez(args.out, **record(args.steps))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
