"""Whitening: ``Whitening(G) = (G G^T)^{-1/2} G`` (paper Sec. 3.3 "Normalization and
Whitening", Eq. "whiten and normal operator"; App. "Operators for gradient", "SWAN",
"Muon", "Newton Schulz iteration").

Structure ``F ~ I_n (x) M`` (paper Prop. "Normalization and whitening"): the optimum is
``M* = E[G G^T] / n`` and its square-root NGD direction ``sqrt(n) E[G G^T]^{-1/2} G``;
with a one-sample estimate of the expectation that is ``sqrt(n) Whitening(G)``, the
whitening operator up to the scalar ``sqrt(n)`` (which the paper and Muon fold into the
learning rate). Whitening is the orthogonal polar factor ``U V^T`` of ``G = U S V^T``
(the closest semi-orthogonal matrix in Frobenius norm); for a rank-deficient ``G`` it is
``U_r V_r^T`` over the non-zero singular values (the pseudo-inverse square root).

Two ways to compute it, on the smaller side (``m <= n``; a tall matrix is whitened as
its transpose, like ``optax.contrib.muon``):

* ``method="newton_schulz"`` (default): ``X_0 = G / (||G||_F + eps)``, then ``steps``
  quintic iterations ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and coefficients
  ``(a, b, c)`` (default: Muon's ``(3.4445, -4.7750, 2.0315)``, tuned for speed: the
  singular values land in roughly [0.7, 1.2] instead of exactly 1 -- the documented
  error of this mode, ``tests/test_whiten.py``). Coefficients ``(1.5, -0.5, 0)`` give the
  classical cubic Newton--Schulz iteration, which converges to ``U V^T`` (given enough
  steps). The gradient is divided by its largest magnitude before the Frobenius norm,
  so huge (1e18) and tiny (1e-30) gradients do not overflow or underflow in float32.
* ``method="exact"``: float32 SVD, ``U V^T`` over singular values above ``rcond * s_max``
  -- the reference for tests and small matrices.

Everything runs in float32; updates are returned in the parameter dtype. Zero gradients
give zero updates; non-finite entries give non-finite updates (visible, as with
``optax.adam``; wrap with ``optax.apply_if_finite`` to skip such steps). No state.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, linalg, matrices, validation

MUON_COEFFS = (3.4445, -4.7750, 2.0315)
CUBIC_COEFFS = (1.5, -0.5, 0.0)


def newton_schulz(g: jax.Array, coeffs: Sequence[float] = MUON_COEFFS, steps: int = 5,
                  eps: float = 1e-8) -> jax.Array:
  """Approximate ``(G G^T)^{-1/2} G`` of one ``m x n`` matrix (``m <= n``), float32."""
  x = g.astype(jnp.float32)
  c = jnp.max(jnp.abs(x))
  x = x / jnp.where((c > 0) & jnp.isfinite(c), c, 1.0)
  x = x / (jnp.linalg.norm(x) + eps)
  a, b, cc = (float(v) for v in coeffs)

  def body(_, x):
    s = linalg.matmul(x, x.T)
    return a * x + linalg.matmul(b * s + cc * linalg.matmul(s, s), x)

  if isinstance(steps, int):
    for i in range(steps):
      x = body(i, x)
    return x
  return jax.lax.fori_loop(0, steps, body, x)  # traced (optax.inject_hyperparams)


def exact_whitening(g: jax.Array, rcond: float = 1e-6) -> jax.Array:
  """``(G G^T)^{+1/2} G = U_r V_r^T`` of one matrix by a float32 SVD."""
  u, s, vt = jnp.linalg.svd(g.astype(jnp.float32), full_matrices=False)
  keep = (s > rcond * jnp.max(s)) & (s > 0)
  return linalg.matmul(u * keep[None, :].astype(jnp.float32), vt)


def whiten(*, method: str = "newton_schulz", coeffs: Sequence[float] = MUON_COEFFS,
           steps: int = 5, eps: float = 1e-8, rcond: float = 1e-6,
           dims: matrices.DimsSpec = None) -> optax.GradientTransformation:
  """``G -> (G G^T)^{-1/2} G`` on the smaller side of every matrix (paper Sec. 3.3).

  Args:
    method: ``"newton_schulz"`` (``steps`` quintic iterations with ``coeffs``) or
      ``"exact"`` (SVD).
    coeffs: Newton--Schulz coefficients ``(a, b, c)`` of ``a X + b (X X^T) X +
      c (X X^T)^2 X``; default Muon's. ``(1.5, -0.5, 0.0)`` is the classical cubic one.
    steps: Newton--Schulz iterations, >= 1.
    eps: added to the Frobenius norm of the (max-scaled) input.
    rcond: ``"exact"`` only: singular values below ``rcond * s_max`` count as zero.
    dims: matrix axes of each leaf (default: the last two; others are batch axes).

  Returns:
    A stateless ``optax.GradientTransformation``; updates keep the gradient dtype.
  """
  if method not in ("newton_schulz", "exact"):
    raise ValueError(f"`method` must be 'newton_schulz' or 'exact', got {method!r}")
  validation.check_int("steps", steps, low=1)
  if not isinstance(steps, jax.core.Tracer):
    steps = int(steps)
  if len(tuple(coeffs)) != 3:
    raise ValueError(f"`coeffs` must be three numbers (a, b, c), got {coeffs!r}")
  validation.check_range("eps", eps, low=0.0, high=1.0)
  validation.check_range("rcond", rcond, low=0.0, high=1.0)
  coeffs = tuple(float(c) for c in coeffs)

  def per_matrix(g, view):
    del view
    if method == "exact":
      return exact_whitening(g, rcond)
    return newton_schulz(g, coeffs, steps, eps)

  def update_fn(updates, state, params=None):
    del params
    return lifting.map_stateless(per_matrix, updates, dims, side="smaller",
                                  what="whiten", whole=True), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_shape(*, consistent_rms: Optional[float] = None, floor: bool = True,
                   dims: matrices.DimsSpec = None) -> optax.GradientTransformation:
  """The magnitude convention of whitened updates (Muon's; ``optax.contrib.muon``'s).

  A whitened ``m x n`` matrix has unit singular values, so its RMS is
  ``1 / sqrt(max(m, n))``. Multiplies every matrix by ``sqrt(max(m, n)) * consistent_rms``
  (RMS ``consistent_rms``: Moonshot's convention, arXiv 2502.16982, which lets AdamW
  learning rates carry over) or, when ``None``, by ``sqrt(max(1, n / m))`` with ``m`` the
  rows (fan-in) and ``n`` the columns (fan-out) of the leaf (Jordan et al.'s width
  scaling); with ``floor=False`` by ``sqrt(n / m)`` (Dion's ``sqrt(d_out / d_in)``,
  arXiv:2504.05295: a matrix that narrows is scaled down). Stateless.
  """
  if consistent_rms is not None:
    validation.check_range("consistent_rms", consistent_rms, low=0.0, high=float("inf"))

  def per_matrix(g, view):
    fan_in, fan_out = view.fan_in, view.fan_out
    if consistent_rms is None:
      c = math.sqrt(max(1.0, fan_out / fan_in) if floor else fan_out / fan_in)
    else:
      c = math.sqrt(max(fan_in, fan_out)) * consistent_rms
    return g * c

  def update_fn(updates, state, params=None):
    del params
    return lifting.map_stateless(per_matrix, updates, dims, what="scale_by_shape"), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
