"""Complement compensation: make a low-rank update full-rank (paper Sec. 5.3).

``method="optimal"`` -- paper Alg. "Compensation" with the optimal diagonal of
Thm. "Optimal compensation" (decay ``b1``)::

    R   = G - U sigma                                     (= U_c U_c^T G)
    p  <- b1 p + (1 - b1) colsum(R^2)                     (= colsum(G^2) - colsum(sigma^2))
    C   = sqrt(m - r) R diag(p)^-1/2
    eta = limiter(||C||_F, phi)                           (fisher_optax.blocks.limiter)
    out = U coeffs + alpha_c * eta * C

``colsum(R^2)`` equals the paper's ``colsum(G^2) - colsum(sigma^2)`` in exact
arithmetic (``U`` orthonormal) but cannot cancel to a negative or tiny value in
floating point, which would blow ``C`` up; columns with ``p = 0`` get 0. A column whose
residual is at rounding level (``||R_j||^2 <= 1e-10 ||G_j||^2``: its exact value is 0,
as when ``G``'s column lies in ``span(U)``) counts as exactly 0, in ``p`` and in ``C``. The
result is orthogonal to span(U) before the ``U coeffs`` term is added.

``method="fira"`` -- Fira's compensation as in its release (``fira_adamw.py``)::

    phi_j = ||coeffs_{:,j}|| / (||sigma_{:,j}|| + 1e-8)    (per column of r x n)
    out   = scale * U coeffs + alpha_c * eta * (G - scale * U sigma) diag(phi)

where ``scale`` is GaLore's ``alpha``: the release's ``project_back`` multiplies
by ``alpha`` before the residual is formed, so the residual keeps
``(1 - alpha) U U^T G``. We keep that behaviour.

State per matrix: ``p`` (``n``, optimal only) and the limiter's ``phi`` (1).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fisher_optax import grouping, linalg, matrices, validation
from fisher_optax.blocks import subspace


# Squared relative size below which a residual column counts as 0 (float32 rounding of
# ``G - U U^T G`` is ~1e-7 relative per entry; 1e-10 on squares is a 1e-5 relative norm).
RESIDUAL_FLOOR = 1e-10


class CompensateState(NamedTuple):
  """``p``: ``batch + (n,)`` column statistics (``None`` for Fira); ``phi``: ``batch``."""
  p: Optional[optax.Updates]
  phi: optax.Updates


def compensate(*, method: str = "optimal", alpha_c: float = 1.0, b1: float = 0.9,
               limiter: Optional[float] = 1.01, scale: float = 1.0,
               dims: matrices.DimsSpec = None,
               side: str = "smaller") -> optax.GradientTransformation:
  """Maps :class:`~fisher_optax.blocks.subspace.Subspace` nodes to compensated dense updates.

  Args:
    method: ``"optimal"`` (Alice, Thm. "Optimal compensation") or ``"fira"``.
    alpha_c: factor on the compensation term (Alice's ``alpha_c``; Fira uses 1), >= 0.
    b1: decay of ``p`` (optimal method), [0, 1).
    limiter: norm-growth threshold ``gamma > 0`` on the compensation term, or
      ``None`` for no limiter.
    scale: factor on the back-projection ``U coeffs`` (and, for Fira, on
      ``U sigma`` in the residual); GaLore/Fira's ``alpha``. Alice uses 1.
    dims: matrix axes per leaf, as given to :func:`low_rank_track`.
    side: the side the basis spans, as given to :func:`low_rank_track` (``"larger"``:
      the canonical matrix is ``m >= n`` and ``p`` runs along its smaller side).
  """
  subspace.check_side(side)
  if method not in ("optimal", "fira"):
    raise ValueError(f"`method` must be 'optimal' or 'fira', got {method!r}")
  validation.check_range("b1", b1, low=0.0, high=1.0)
  validation.check_range("alpha_c", alpha_c, low=0.0, high=float("inf"))
  validation.check_range("limiter", limiter, low=0.0, high=float("inf"), low_open=True,
                      allow_none=True)
  what = "compensate"

  def init_fn(params):
    lifted = subspace.lift(params, dims, what, side)
    p = None
    if method == "optimal":
      p = lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (v.n,), jnp.float32))
    phi = lifted.per_view(lambda v: jnp.zeros(v.batch_shape, jnp.float32))
    return CompensateState(p=p, phi=phi)

  def update_fn(updates, state, params=None):
    del params
    p_tree = state.p if method == "optimal" else jax.tree.map(lambda _: None, state.phi)
    # traced once per matrix shape (grouping.shared)
    arrays = grouping.shared(functools.partial(
        _compensate_arrays, method=method, alpha_c=alpha_c, b1=b1, limiter=limiter,
        scale=scale))

    def one(s, p, phi):
      dense, p_new, phi = arrays(s.grad, s.basis, s.sigma, s.coeffs, p, phi)
      return subspace.to_leaf(s, dense), p_new, phi

    res = jax.tree.map(one, updates, p_tree, state.phi, is_leaf=subspace.is_subspace)
    pick = lambda i: jax.tree.map(lambda _, r: r[i], state.phi, res)
    p = pick(1) if method == "optimal" else None
    return pick(0), CompensateState(p=p, phi=pick(2))

  return optax.GradientTransformation(init_fn, update_fn)


def _optimal_residual(g, u, sigma, p, b1):
  """The residual ``G - U sigma`` and the new ``p`` of the optimal method. A
  column whose residual is at rounding level (its true value is 0, e.g. G's column lies in
  span(U)) is exactly 0: rounding noise scaled by its own tiny ``p`` would be a unit-size
  update in a random direction."""
  resid = g - linalg.matmul(u, sigma)
  rsq = jnp.sum(jnp.square(resid), axis=-2)
  real = rsq > RESIDUAL_FLOOR * jnp.sum(jnp.square(g), axis=-2)
  resid = jnp.where(real[..., None, :], resid, 0.0)
  p_new = linalg.ema(b1, p, jnp.where(real, rsq, 0.0))
  p_new = jnp.where(jnp.isfinite(p_new), p_new, p)
  return resid, p_new


def _compensate_arrays(g, u, sigma, coeffs, p, phi, *, method, alpha_c, b1, limiter, scale):
  """One :class:`~fisher_optax.blocks.subspace.Subspace`'s arrays (gradient, basis,
  ``sigma``, coefficients; canonical layout) -> (dense canonical update, ``p``, ``phi``)."""
  m, r = u.shape[-2], u.shape[-1]
  if method == "optimal":
    resid, p_new = _optimal_residual(g, u, sigma, p, b1)
    c = math.sqrt(m - r) * resid * linalg.safe_rsqrt(p_new)[..., None, :]
  else:
    p_new = None
    c = (g - scale * linalg.matmul(u, sigma)) * linalg.norm_ratio(coeffs, sigma, "channel")
  c = jnp.where(jnp.isfinite(c), c, 0.0)
  if limiter is not None:
    norm = jnp.sqrt(jnp.sum(jnp.square(c), axis=(-2, -1)))
    eta, phi = linalg.limit_growth(norm, phi, limiter)
    c = c * eta[..., None, None]
  return scale * linalg.matmul(u, coeffs) + alpha_c * c, p_new, phi
