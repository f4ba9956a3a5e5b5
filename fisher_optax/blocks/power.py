"""Low-rank tracking of the momentum by one warm-started power step per step, with error
feedback (Dion: Ahn, Xu, Abreu, Langford 2025, arXiv:2504.05295, Alg. 1; the
``microsoft/dion`` reference ``dion_update``).

Per canonical ``m x n`` matrix (``m <= n``: the right factor ``Q`` spans the smaller
side, as the reference keeps it) with momentum ``M`` and ``Q`` (``m x r``)::

    B = M + G                                  (the momentum takes the gradient)
    P = orth(B^T Q)                            (n x r, one power step warm-started at Q)
    R = B P                                    (m x r)
    M <- B - (1 - mu) R P^T                    (error feedback: what P does not take
                                                stays in the momentum undecayed)
    Q <- R diag(1 / (||R_:j|| + eps))          (unit columns)
    out = Q P^T                                (rank r, unit singular values when R's
                                                columns are orthogonal)

In the reference's orientation (its ``B`` is ours transposed, tall) these are its
``P = orth(B Q)``, ``R = B^T P``, ``M <- B - (1 - mu) P R^T`` and the update
``P Q^T``. In the paper's framework (arXiv:2502.07752, Sec. 5) ``Q`` is a tracked basis
of the smaller side refreshed by one step of subspace iteration on ``B B^T`` at every
step (``Q_new`` spans ``B B^T Q``), the coefficients ``B^T Q`` are orthonormalized
instead of passed to Adam, and the complement is compensated by error feedback instead
of :func:`~fisher_optax.compensate`'s optimal term.

``orth`` is the thin QR factor with a positive ``R`` diagonal (Gram--Schmidt's order, as
the reference's Householder, Cholesky and randomized Cholesky QR give up to column
signs, which cancel in ``Q P^T`` and ``R P^T``): :func:`fisher_optax.linalg.positive_qr`
(batched Cholesky QR on accelerators). The column ordering matters (a rotation of ``P``
would change the column normalization of ``R``), so no polar factor is used. Where
that factor is not orthonormal in float32 (``B^T Q`` of rank below ``r``), the matrix
takes :func:`fisher_optax.linalg.orthonormal_columns` instead, the QR factor of ``B^T Q``
shifted by ``1e-6`` times the identity's first columns; every such fallback of the tree
sits in one ``lax.cond``, so an ordinary step computes one QR per matrix.

Edge cases: an all-zero ``B`` (a matrix that has seen only zero gradients) gives ``P =
0`` and keeps ``Q`` (unit columns), as the reference does; a ``B`` of rank below ``r``
still gets an orthonormal ``P`` (:func:`~fisher_optax.linalg.orthonormal_columns`), whose
extra columns contribute nothing to the update; products and norms are scaled so that
tiny (1e-30) and huge (1e18) gradients neither underflow nor overflow in float32.
Non-finite gradients give non-finite updates and state (visible; the reference
replaces NaN factors by zeros and keeps a NaN momentum, which silently stops the
matrix); wrap with ``optax.apply_if_finite`` to skip such steps.

The initial ``Q`` is ``N(0, 1)`` per matrix, as the reference's ``torch.randn``; matrix
``j`` of the tree (leaves in order, stack entries in order) draws it from
``fold_in(fold_in(PRNGKey(seed), 0), j)`` (:mod:`fisher_optax.rng`). Its scale does not
matter (``orth`` ignores it); a run that must reproduce a reference run sets the
reference's ``state["Q"]`` to this ``Q`` (transposed to the reference's orientation
where that is not the same).

State per ``m x n`` matrix: ``mn + mr`` (momentum in the leaf's layout, ``Q``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, linalg, matrices, rng, validation


class PowerTrackState(NamedTuple):
  """``momentum``: ``M``, shaped like the parameters (float32 unless ``state_dtype``);
  ``basis``: ``Q``, ``batch + (m, r)`` on the smaller side ``m`` of each matrix."""
  momentum: optax.Updates
  basis: optax.Updates


def power_rank(rank: Union[int, float], m: int) -> int:
  """The rank of one matrix whose smaller side is ``m``: an integer ``rank`` clipped to
  ``m``; a fraction ``0 < rank <= 1`` of ``m`` rounded up (the reference's
  ``ceil(rank_fraction * min(m, n))``), at least 1."""
  if isinstance(rank, float):
    return max(1, min(m, math.ceil(rank * m)))
  return min(int(rank), m)


def check_rank(rank) -> Union[int, float]:
  """``rank`` as a Python int ``>= 1`` or a float fraction in ``(0, 1]``, or a clear
  ``ValueError``."""
  if isinstance(rank, float):
    if not 0.0 < rank <= 1.0:
      raise ValueError("`rank` as a float is a fraction of min(m, n) in (0, 1]; got "
                       f"{rank!r} (give an int for an absolute rank)")
    return rank
  validation.check_int("rank", rank, low=1)
  return validation.static_int("rank", rank)


def power_track(*, rank: Union[int, float], mu: float = 0.95, eps: float = 1e-8,
                seed: int = 0, dims: matrices.DimsSpec = None,
                state_dtype: Optional[jnp.dtype] = None) -> optax.GradientTransformation:
  """One warm-started power step per step on the momentum, with error feedback (Dion's
  update direction ``Q P^T``; module docstring).

  Args:
    rank: ``r``: an int (clipped per matrix to ``min(m, n)``: at or above it the factor
      is full rank) or a float fraction of ``min(m, n)`` in ``(0, 1]``, rounded up; static.
    mu: error-feedback momentum ``mu`` in [0, 1): the part of ``B`` that ``P`` takes is
      kept with weight ``mu``, the rest with weight 1.
    eps: added to the column norms of ``R``.
    seed: seed of the initial ``Q``.
    dims: matrix axes per leaf (default: the last two).
    state_dtype: dtype of ``M`` and ``Q`` in the state (default float32; the
      arithmetic is float32 regardless).

  Returns:
    An ``optax.GradientTransformation`` whose updates (in the gradients' dtype) are the
    rank-``r`` directions, before any scale.
  """
  rank = check_rank(rank)
  validation.check_range("mu", mu, low=0.0, high=1.0)
  validation.check_range("eps", eps, low=0.0, high=1.0)
  sdtype = jnp.float32 if state_dtype is None else state_dtype
  what = "power_track"

  def init_fn(params):
    lifted = lifting.Lifted(params, dims, side="smaller", what=what)
    key = rng.refresh_key(jax.random.PRNGKey(seed), 0)
    first, bases = 0, []
    for v in lifted.views:
      r = power_rank(rank, v.m)
      idx = rng.matrix_indices(first, v.batch_shape).reshape(-1)
      draw = jax.vmap(lambda i, m=v.m, r=r: jax.random.normal(rng.matrix_key(key, i), (m, r)))
      bases.append(draw(idx).reshape(v.batch_shape + (v.m, r)).astype(sdtype))
      first += v.num_matrices
    return PowerTrackState(momentum=optax.tree.zeros_like(params, dtype=sdtype),
                           basis=lifted.unflatten(bases))

  def update_fn(updates, state, params=None):
    del params
    b = jax.tree.map(lambda m, g: m.astype(jnp.float32) + g.astype(jnp.float32),
                     state.momentum, updates)
    lifted = lifting.Lifted(b, dims, side="smaller", what=what, canonical=True)
    bs, qs = lifted.canonical_grads, lifted.leaves_of(state.basis)
    ys = lifted.per_matrix(power_operand, bs, qs)
    ps = orthonormal_factors(lifted, ys)
    outs = lifted.per_matrix(lambda bc, q, p: power_step(bc, q, p, mu, eps), bs, qs, ps)
    directions, momenta, bases = zip(*outs) if outs else ((), (), ())
    grads = lifted.leaves_of(updates)
    out = lifted.unflatten([lifting.from_canonical_as(d, v, jnp.dtype(g.dtype))
                            for d, v, g in zip(directions, lifted.views, grads)])
    momentum = lifted.unflatten([lifting.from_canonical_as(m, v, jnp.dtype(sdtype))
                                 for m, v in zip(momenta, lifted.views)])
    basis = lifted.unflatten([q.astype(sdtype) for q in bases])
    return out, PowerTrackState(momentum=momentum, basis=basis)

  return optax.GradientTransformation(init_fn, update_fn)


def power_operand(b: jax.Array, q: jax.Array) -> jax.Array:
  """``B^T Q`` of one matrix, with ``B`` and ``Q`` divided by their largest entries: its
  QR factor does not depend on their scale, and tiny or huge gradients then neither
  underflow nor overflow."""
  return linalg.matmul(jnp.swapaxes(linalg.unit_max(b), -1, -2), linalg.unit_max(q))


def orthonormal_factors(lifted: lifting.Lifted, ys: list) -> list:
  """``P = orth(Y)`` per leaf: :func:`~fisher_optax.linalg.positive_qr`, and where that is
  not orthonormal for some matrix, :func:`~fisher_optax.linalg.orthonormal_columns` for
  that matrix (each matrix's factor depends on its own ``Y`` only); the second pass
  runs, inside one ``lax.cond``, only on steps that need it."""
  ps = lifted.per_matrix(linalg.positive_qr, ys)
  oks = lifted.per_matrix(linalg.is_orthonormal, ps)
  if not ps:
    return ps

  def shifted(ops):
    ys, ps, oks = ops
    pick = lambda y, p, ok: jnp.where(ok, p, linalg.orthonormal_columns(y))  # noqa: E731
    return lifted.per_matrix(pick, ys, ps, oks)

  every = jnp.all(jnp.stack([jnp.all(ok) for ok in oks]))
  return jax.lax.cond(every, lambda ops: ops[1], shifted, (ys, ps, oks))


def power_step(b: jax.Array, q: jax.Array, p: jax.Array, mu,
               eps) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One matrix (canonical ``m x n``, ``Q`` ``m x r``, ``P = orth(B^T Q)`` ``n x r``): the
  direction ``Q_new P^T``, the new momentum ``B - (1 - mu) R P^T`` and ``Q_new`` (module
  docstring), float32."""
  b = b.astype(jnp.float32)
  q = q.astype(jnp.float32)
  r = linalg.matmul(b, p)
  zero = jnp.all(b == 0)
  # an all-zero B (the reference's fix_all_zero_or_nan): no update, Q kept
  p = jnp.where(zero, 0.0, p)
  r = jnp.where(zero, q, r)
  momentum = b - (1.0 - mu) * linalg.matmul(r, jnp.swapaxes(p, -1, -2))
  q_new = r / (_column_norms(r) + eps)
  return linalg.matmul(q_new, jnp.swapaxes(p, -1, -2)), momentum, q_new


def _column_norms(x: jax.Array) -> jax.Array:
  """Euclidean norms of the columns of ``x`` (``1 x r``), scaled so that the sum of
  squares does not overflow for entries near float32's range."""
  top = jnp.max(jnp.abs(x), axis=-2, keepdims=True)
  top = jnp.where((top > 0) & jnp.isfinite(top), top, 1.0)
  return top * jnp.sqrt(jnp.sum(jnp.square(x / top), axis=-2, keepdims=True))
