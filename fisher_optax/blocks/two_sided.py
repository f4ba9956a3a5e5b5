"""Two-sided row/column scaling: the RACS preconditioner (paper Sec. 4, Prop. "Two-sided
scaling", Alg. "RACS").

Structure ``F ~ S (x) Q`` with positive diagonal ``S = diag(s)`` (n x n) and
``Q = diag(q)`` (m x m). With ``P = G * G`` (elementwise, float32) the optimum is
the fixed point of (paper Eq. "iterative procedure double scaling")::

    s = P^T q / ||q||^2,      q = P s / ||s||^2,

started from ``q = 1`` and run ``iters`` times; at convergence ``s`` and ``q``
are the right/left principal singular vectors of ``P`` (up to scale). States are
EMAs without bias correction, started at 0::

    s_t = beta s_{t-1} + (1 - beta) s,    q_t = beta q_{t-1} + (1 - beta) q
    G~  = diag(q_t)^-1/2  G  diag(s_t)^-1/2        (square-root NGD, Sec. 4)

Numerics (design decisions; docs: "Numerics policy"):
  * ``P`` is formed from ``G / max|G|``; the iteration gives ``q`` exactly as for
    ``P`` (q is invariant to scaling ``P``) and ``s`` is rescaled by ``max|G|^2``,
    so the update is invariant to scaling ``G`` over 1e-15 .. 1e15 in float32.
  * ``eps`` is a *relative* floor: ``q`` is clamped at ``eps * max(q)`` and ``s`` at
    ``eps * max(s)`` (an absolute floor would break scale invariance).
  * zero rows / columns / gradients give a zero (finite) update there, never NaN;
  * a non-finite gradient entry stays non-finite in the output (visible, as with
    ``optax.adam``) and leaves ``s, q`` unchanged; wrap in ``optax.apply_if_finite``
    to skip such steps.

Cost: ``2 * iters`` matrix-vector products over ``P`` plus a few elementwise passes,
no decomposition (measured step times: the documentation's performance page).

State per matrix: ``m + n`` numbers (the limiter's scalar is in
:func:`fisher_optax.norm_growth_limiter`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, linalg, matrices, validation


class ScaleByTwoSidedState(NamedTuple):
  """``s``: column scales ``batch + (n,)``; ``q``: row scales ``batch + (m,)`` (float32)."""
  s: optax.Updates
  q: optax.Updates
  SHARDING = {"q": "rows"}  # roles for parallel/sharding.py


def two_sided_fixed_point(g: jax.Array, iters: int) -> tuple[jax.Array, jax.Array]:
  """``(s, q)`` after ``iters`` rounds of the fixed point for ``P = G * G`` (one matrix).

  Returned in the paper's gauge (``q`` from ``q_0 = 1``; ``s`` carries the scale of
  ``P``), computed stably from the max-normalised gradient.
  """
  g = g.astype(jnp.float32)
  c = jnp.max(jnp.abs(g))
  c = jnp.where((c > 0) & jnp.isfinite(c), c, 1.0)
  p = jnp.square(g / c)
  tiny = jnp.finfo(jnp.float32).tiny
  q = jnp.ones((g.shape[0],), jnp.float32)
  s = jnp.zeros((g.shape[1],), jnp.float32)
  def body(_, sq):
    s, q = sq
    s = linalg.vec_mat(q, p) / jnp.maximum(jnp.sum(q * q), tiny)
    q = linalg.mat_vec(p, s) / jnp.maximum(jnp.sum(s * s), tiny)
    return s, q

  # A loop, not unrolled: the same arithmetic (updates bitwise equal), but one loop body
  # per matrix instead of ``iters`` copies halves the update's compile time (130M preset:
  # 84 matrices); ``iters`` may also be traced (``optax.inject_hyperparams``).
  s, q = jax.lax.fori_loop(0, iters, body, (s, q))
  return s * (c * c), q


def _scale(g, s, q, s_max, q_max, eps):
  rs = linalg.safe_rsqrt(jnp.maximum(s, eps * s_max))
  rq = linalg.safe_rsqrt(jnp.maximum(q, eps * q_max))
  g = g.astype(jnp.float32)
  big = jnp.finfo(jnp.float32).max
  out = jnp.nan_to_num(g * rq[:, None] * rs[None, :], nan=0.0, posinf=big, neginf=-big)
  return jnp.where(jnp.isfinite(g), out, g)  # non-finite gradient entries stay visible


def scale_by_two_sided(*, beta: float = 0.9, iters: int = 5, eps: float = 1e-8,
                       dims: matrices.DimsSpec = None) -> optax.GradientTransformation:
  """RACS two-sided scaling ``G -> diag(q)^-1/2 G diag(s)^-1/2`` (paper Alg. "RACS" l.5-8).

  Args:
    beta: EMA decay of ``s`` and ``q``, in [0, 1).
    iters: fixed-point iterations per step (paper: 5), >= 1.
    eps: relative floor of the scales, in [0, 1).
    dims: matrix axes of each leaf (default: the last two). Every leaf must be a
      matrix or a stack of matrices; route others elsewhere (``mask=``).

  Returns:
    An ``optax.GradientTransformation``. Updates keep the gradient dtype; the
    state is float32.
  """
  validation.check_range("beta", beta, low=0.0, high=1.0)
  validation.check_int("iters", iters, low=1)
  if not isinstance(iters, jax.core.Tracer):
    iters = int(iters)
  validation.check_range("eps", eps, low=0.0, high=1.0)
  what = "scale_by_two_sided (RACS)"

  def init_fn(params):
    lifted = lifting.Lifted(params, dims, what=what)
    return ScaleByTwoSidedState(
        s=lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (v.n,), jnp.float32)),
        q=lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (v.m,), jnp.float32)))

  def per_matrix(g, s, q):
    s_new, q_new = two_sided_fixed_point(g, iters)
    s_t = linalg.ema(beta, s, s_new)
    q_t = linalg.ema(beta, q, q_new)
    # s_t, q_t >= 0 and max propagates NaN, so the maxima alone tell whether both are
    # finite; reusing them for the floors saves four small reductions per matrix
    s_max, q_max = jnp.max(s_t), jnp.max(q_t)
    ok = jnp.isfinite(s_max) & jnp.isfinite(q_max)
    s_t, q_t = jnp.where(ok, s_t, s), jnp.where(ok, q_t, q)
    s_max = jnp.where(ok, s_max, jnp.max(s))
    q_max = jnp.where(ok, q_max, jnp.max(q))
    return _scale(g, s_t, q_t, s_max, q_max, eps), s_t, q_t

  def update_fn(updates, state, params=None):
    del params
    lifted = lifting.Lifted(updates, dims, what=what, canonical=True)
    res = lifted.per_matrix(per_matrix, lifted.canonical_grads, lifted.leaves_of(state.s),
                            lifted.leaves_of(state.q))
    out, s, q = zip(*res) if res else ((), (), ())  # no matrices: nothing to scale
    return lifted.to_leaves(out), ScaleByTwoSidedState(s=lifted.unflatten(s), q=lifted.unflatten(q))

  return optax.GradientTransformation(init_fn, update_fn)
