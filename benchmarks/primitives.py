"""Time the factorizations inside a low-rank refresh, batched as the stacked layout runs them.

    python benchmarks/primitives.py [--preset 60M] [--reps 5] [--jsonl] [--only racs]

Alice's refresh of one stack of same-shape matrices (``B`` matrices, ``m x r`` bases) is
built from: the Gram ``G G^T`` (a batched product), subspace-iteration steps
orthonormalized by Cholesky QR (:func:`fisher_optax.linalg.cholesky_qr`: products and
``r x r`` factors), the Rayleigh-Ritz eigendecomposition of an ``r x r`` matrix, and, for
switching, complement columns from a Householder QR of the basis
(:func:`fisher_optax.linalg.complement_columns`). On a GPU a batched ``eigh`` above
32 x 32 and a batched Householder QR run one matrix after another; this script times
each piece at a preset's shapes so that their share of the refresh step is measured,
not guessed, together with candidates: ``eigh`` by cuSOLVER's batched Jacobi
(``jax.lax.linalg.eigh(implementation=JACOBI)``, GPU only; cuSOLVER documents it up to
32 x 32, so at larger ``r`` the row may record an error), ``eigh`` by Jacobi sweeps
written as gathers and elementwise rotations (:func:`jacobi_eigh`, batched on every
backend), and Householder QR of the same ``m x r`` matrices for comparison with Cholesky
QR. Also the whole refresh of one
stack (:meth:`fisher_optax.refresh.Switch.refresh_from`, vmapped), and per weight stack
RACS's fixed point (its products with a vector as multiply-reduce, as the library writes
them, and as ``dot`` for comparison; for a bfloat16 gradient, also with ``P = (G / c)^2``
recomputed inside each product instead of stored) beside a copy of the stack (bandwidth
yardstick).

Each row: batch ``B``, shape, compile seconds, median milliseconds of ``--reps`` runs,
and milliseconds per matrix. The shapes are the preset's LLaMA (:func:`shapes`) and its
Alice rank.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from examples.llama import presets  # noqa: E402
from fisher_optax import linalg, refresh  # noqa: E402
from fisher_optax.blocks.two_sided import two_sided_fixed_point  # noqa: E402


def shapes(preset: str) -> tuple[list[tuple[int, int, int]], int, int, int, int]:
  """The preset's weight stacks ``(B, m, n)`` with ``m <= n`` (``4L`` ``h x h``, ``3L``
  ``h x f``: gate and up, and down read transposed; the output layer ``h x vocab``),
  and ``(B, m, r, leading)`` of the one group the refresh runs: its operand is the
  ``m x m`` Gram, so every matrix of one ``m`` shares one batched refresh."""
  cfg = presets.MODELS[preset]
  h, f, layers, vocab = cfg["hidden"], cfg["intermediate"], cfg["layers"], cfg["vocab_size"]
  r, leading, _ = presets.LOW_RANK[preset]
  weights = [(4 * layers, h, h), (3 * layers, h, f), (1, h, vocab)]
  return weights, sum(b for b, _, _ in weights), h, r, leading


def fixed_point_by_dots(g: jax.Array, iters: int = 5, *,
                        recompute: bool = False) -> tuple[jax.Array, jax.Array]:
  """Candidates for RACS's fixed point (:func:`two_sided_fixed_point`): its products with
  a vector as matrix products (``dot``) instead of multiply-reduce, the same arithmetic;
  with ``recompute``, multiply-reduce again but ``P = (G / c)^2`` formed inside each
  product from ``G`` in its own dtype (a bfloat16 gradient is then read at 2 bytes an
  entry, and ``P`` is never written), also the same arithmetic. For timing against the
  library's form.

  XLA hoists a loop-invariant ``P`` out of the loop: written plainly inside the loop
  body, it compiles to the library's program, ``P`` stored (the primitives test checks
  the temporary memory both ways). An ``optimization_barrier`` that ties ``G`` to the
  iterates keeps it inside, with the same results; on this CPU that form was 2.4-7.9x
  slower on the 60M layers' stacks with a bfloat16 gradient (``--only racs``)."""
  c = jnp.max(jnp.abs(g.astype(jnp.float32)))
  c = jnp.where((c > 0) & jnp.isfinite(c), c, 1.0)
  tiny = jnp.finfo(jnp.float32).tiny
  if recompute:
    def p_of(v):  # G read afresh for each product: not loop-invariant behind the barrier
      x, v = jax.lax.optimization_barrier((g, v))
      return jnp.square(x.astype(jnp.float32) / c), v

    def vec_mat(v):
      p, v = p_of(v)
      return jnp.sum(v[:, None] * p, axis=0)

    def mat_vec(v):
      p, v = p_of(v)
      return jnp.sum(p * v[None, :], axis=1)
  else:
    p = jnp.square(g.astype(jnp.float32) / c)
    vec_mat = lambda v: linalg.matmul(v, p)  # noqa: E731
    mat_vec = lambda v: linalg.matmul(p, v)  # noqa: E731

  def body(_, sq):
    s, q = sq
    s = vec_mat(q) / jnp.maximum(jnp.sum(q * q), tiny)
    q = mat_vec(s) / jnp.maximum(jnp.sum(s * s), tiny)
    return s, q

  s, q = jax.lax.fori_loop(0, iters, body, (jnp.zeros((g.shape[1],), jnp.float32),
                                            jnp.ones((g.shape[0],), jnp.float32)))
  return s * (c * c), q


def round_robin(n: int) -> np.ndarray:
  """``(n - 1, n // 2, 2)`` index pairs for even ``n``: every pair of ``range(n)`` exactly
  once, ``n / 2`` disjoint pairs a round (the circle method of a round-robin tournament)."""
  idx, out = list(range(n)), []
  for _ in range(n - 1):
    out.append([(idx[i], idx[n - 1 - i]) for i in range(n // 2)])
    idx = [idx[0], idx[-1]] + idx[1:-1]
  return np.asarray(out, np.int32)


def jacobi_eigh(a: jax.Array, sweeps: int = 8) -> tuple[jax.Array, jax.Array]:
  """A candidate for the refresh's ``r x r`` eigendecomposition that runs batched on a GPU
  (cuSOLVER runs a batch of ``eigh`` above 32 x 32 one matrix after another): cyclic
  Jacobi with the round-robin parallel ordering (Brent and Luk 1985), ``n / 2`` disjoint
  rotations a round, ``n - 1`` rounds a sweep, a fixed number of sweeps (one compiled
  loop, no convergence test). Each rotation zeroes ``a_pq`` (``t = tan(phi)`` the smaller
  root of ``t^2 + 2 theta t - 1 = 0``, ``theta = (a_qq - a_pp) / (2 a_pq)``; Golub and
  Van Loan, Sec. 8.5) and is applied to rows, columns and ``V``. An odd ``n`` is padded
  with an isolated zero row and column, which no rotation touches. Returns ``(w, V)``,
  eigenvalues descending. For the benchmark and its test only, not used by the library."""
  n = a.shape[-1]
  n2 = n + n % 2
  a = jnp.pad(a.astype(jnp.float32), ((0, n2 - n), (0, n2 - n)))
  rounds = jnp.asarray(round_robin(n2))

  def rotate(k, carry):
    a, v = carry
    p, q = rounds[k % (n2 - 1), :, 0], rounds[k % (n2 - 1), :, 1]
    app, aqq, apq = a[p, p], a[q, q], a[p, q]
    off = apq != 0
    theta = jnp.where(off, (aqq - app) / jnp.where(off, 2 * apq, 1.0), 0.0)
    t = jnp.where(off, jnp.where(theta >= 0, 1.0, -1.0)
                  / (jnp.abs(theta) + jnp.sqrt(theta * theta + 1)), 0.0)
    c = jax.lax.rsqrt(t * t + 1)
    s = t * c
    rp, rq = a[p, :], a[q, :]
    a = a.at[p, :].set(c[:, None] * rp - s[:, None] * rq).at[q, :].set(
        s[:, None] * rp + c[:, None] * rq)
    cp, cq = a[:, p], a[:, q]
    a = a.at[:, p].set(cp * c - cq * s).at[:, q].set(cp * s + cq * c)
    vp, vq = v[:, p], v[:, q]
    v = v.at[:, p].set(vp * c - vq * s).at[:, q].set(vp * s + vq * c)
    return a, v

  a, v = jax.lax.fori_loop(0, sweeps * (n2 - 1), rotate,
                           (a, jnp.eye(n2, dtype=jnp.float32)))
  w, v = jnp.diagonal(a)[:n], v[:n, :n]
  order = jnp.argsort(-w)
  return w[order], v[:, order]


def timed(fn, *args, reps: int) -> tuple[float, float]:
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return compile_s, 1e3 * statistics.median(times)


def cases(b: int, m: int, r: int, leading: int):
  """``(name, fn, args)`` for the refresh group of ``b`` matrices, ``m x r`` bases."""
  rng = np.random.default_rng(0)
  u = jax.vmap(linalg.cholesky_qr)(jnp.asarray(rng.standard_normal((b, m, r)), jnp.float32))
  y = jnp.asarray(rng.standard_normal((b, m, r)), jnp.float32)
  h = jnp.einsum("bmr,bms->brs", y, y)
  g = jnp.asarray(rng.standard_normal((b, m, 2 * m)), jnp.float32)
  gram = jnp.einsum("bmn,bkn->bmk", g, g) / (2 * m)
  switch = refresh.Switch(leading=leading)
  noise = jax.random.bits(jax.random.key(0), (b, m - r), jnp.uint32)
  out = [
      ("cholesky_qr m x r", jax.vmap(linalg.cholesky_qr), (y,)),
      ("householder qr m x r", jax.vmap(linalg.orthonormalize), (y,)),
      ("eigh r x r (default)", jax.vmap(lambda a: jnp.linalg.eigh(a, symmetrize_input=False)),
       (h,)),
      ("complement_columns", jax.vmap(linalg.complement_columns, in_axes=(0, None)),
       (u, jnp.arange(r - leading))),
      ("eigh m x m gram (first refresh)",
       jax.vmap(lambda c: jnp.linalg.eigh(c, symmetrize_input=False)), (gram,)),
      ("alice refresh_from (switching)",
       jax.vmap(lambda c, u0, z: switch.refresh_from(c, u0, None, 0.0, z)), (gram, u, noise)),
  ]
  out.insert(3, ("eigh r x r (jacobi sweeps)", jax.vmap(jacobi_eigh), (h,)))
  if jax.default_backend() != "cpu":
    jacobi = jax.lax.linalg.EighImplementation.JACOBI
    out.insert(3, ("eigh r x r (cusolver jacobi)", lambda a: jax.lax.linalg.eigh(
        a, symmetrize_input=False, implementation=jacobi), (h,)))  # cuSOLVER syevjBatched
  return out


def report(row: dict, as_json: bool):
  if as_json:
    print(json.dumps(row), flush=True)
    return
  what = f"{row['primitive']:40s} B{row['batch']:<3d} {row['shape']:>14s}"
  if "error" in row:
    print(f"{what}: {row['error']}", flush=True)
  else:
    print(f"{what} {row['ms']:9.2f} ms ({row['ms_per_matrix']:7.3f} ms a matrix)"
          f"  compile {row['compile_s']:5.1f} s", flush=True)


def measure(name, fn, fargs, b, shape, preset, reps) -> dict:
  row = dict(preset=preset, primitive=name, batch=b, shape=shape, backend=jax.default_backend())
  try:
    compile_s, ms = timed(fn, *fargs, reps=reps)
  except Exception as e:  # a primitive this backend lacks is part of the report
    return dict(row, error=f"{type(e).__name__}: {str(e)[:200]}")
  return dict(row, compile_s=compile_s, ms=ms, ms_per_matrix=ms / b)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="60M")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--jsonl", action="store_true")
  ap.add_argument("--only", default="all", choices=("all", "refresh", "racs"),
                  help="the refresh's factorizations, RACS's fixed point per weight stack, "
                       "or both")
  args = ap.parse_args(argv)
  weights, b, m, r, leading = shapes(args.preset)
  # the refresh group first: a run cut at its time limit keeps what matters most
  for name, fn, fargs in (cases(b, m, r, leading) if args.only != "racs" else ()):
    shape = f"{m}x{m} r{r}" if "m x m" in name or "refresh" in name else (
        f"{r}x{r}" if "r x r" in name else f"{m}x{r}")
    report(measure(name, fn, fargs, b, shape, args.preset, args.reps), args.jsonl)
  gram = jax.vmap(refresh.Switch().operand)
  racs = jax.vmap(lambda g: two_sided_fixed_point(g, 5))
  for bw, mw, nw in (weights if args.only != "refresh" else ()):
    g = jnp.asarray(np.random.default_rng(0).standard_normal((bw, mw, nw)), jnp.float32)
    for name, fn in (("gram G G^T", gram), ("copy (bandwidth yardstick)", lambda x: x * 2.0),
                     ("racs fixed point, 5 iters", racs),
                     ("racs fixed point by dots", jax.vmap(fixed_point_by_dots))):
      report(measure(name, fn, (g,), bw, f"{mw}x{nw}", args.preset, args.reps), args.jsonl)
    g16 = g.astype(jnp.bfloat16)  # the gradient of a bfloat16 model, as training reads it
    for name, fn in (("racs fixed point, bf16 G", racs),
                     ("racs fixed point, bf16 G, P recomputed",
                      jax.vmap(lambda x: fixed_point_by_dots(x, recompute=True)))):
      report(measure(name, fn, (g16,), bw, f"{mw}x{nw}", args.preset, args.reps), args.jsonl)

if __name__ == "__main__":
  main()
