"""The per-matrix, per-side mathematics of :func:`~fisher_optax.rotate`: the statistics
``L``/``R`` (paper Sec. 3.4-3.5), their eigenbases refreshed by ``eigh`` or by SOAP's
power-QR step, the rotations in and out of the eigenbases, and Shampoo's eigenvalue
powers. One matrix, one side at a time; the block ``vmap``s and groups them."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from fisher_optax import linalg


class SideRefresh(NamedTuple):
  """A refreshed side of one matrix: the new basis and its eigenvalues, the order of the
  old basis vectors (power-QR's sort; ``arange`` for eigh), ``new^T old`` (to re-express
  inner state) and whether the decomposition was finite (else the old basis is kept)."""
  basis: jax.Array
  eigenvalues: jax.Array
  order: jax.Array
  change: jax.Array
  ok: jax.Array


def stats_update(stat: Optional[jax.Array], g: jax.Array, side: str,
                 b3: Optional[float]) -> Optional[jax.Array]:
  """``L <- b3 L + (1 - b3) G G^T`` (left) or with ``G^T G`` (right); sums if ``b3`` is None."""
  if stat is None:
    return None
  outer = linalg.matmul(g, g.T) if side == "left" else linalg.matmul(g.T, g)
  return stat + outer if b3 is None else linalg.ema(b3, stat, outer)


def power_qr(stat: jax.Array, basis: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """SOAP's refresh: sort the old basis by ``diag(U^T L U)``, one power iteration
  ``QR(L U)`` (:func:`fisher_optax.linalg.power_orthonormal`: the positive-diagonal QR of
  ``(L + delta I) U``, batched on accelerators). Returns the new basis, the sort order and
  ``L`` times the new basis.

  Products: ``L U`` once serves the estimates (``diag(U^T L U)`` is the column sums of
  ``U * (L U)``) and the iteration (``L U[:, idx] = (L U)[:, idx]``); the caller reads the
  new eigenvalue estimates ``diag(Q^T L Q)`` from ``L Q`` the same way: two ``d^3``
  products where four were."""
  lu = linalg.matmul(stat, basis)
  est = jnp.sum(basis * lu, axis=0)
  idx = jnp.argsort(-est)
  q = linalg.power_orthonormal(lu[:, idx], basis[:, idx])
  return q, idx, linalg.matmul(stat, q)


def side_refresh(stat: jax.Array, basis: jax.Array, use_eigh: bool) -> SideRefresh:
  """One side of one matrix: ``eigh`` (descending) or :func:`power_qr`. A non-finite
  decomposition keeps the previous basis (and, by the caller, its eigenvalues)."""
  d = stat.shape[-1]
  if use_eigh:
    w, new = linalg.eigh_desc(stat)
    idx = jnp.arange(d)
  else:
    new, idx, lq = power_qr(stat, basis)
    w = jnp.sum(new * lq, axis=0)
  ok = jnp.all(jnp.isfinite(new))
  new = jnp.where(ok, new, basis)
  idx = jnp.where(ok, idx, jnp.arange(d))
  return SideRefresh(new, w, idx, linalg.matmul(new.T, basis), ok)


def rotate_in(x: jax.Array, bl: Optional[jax.Array], br: Optional[jax.Array]) -> jax.Array:
  """``U_L^T X U_R`` (a missing side is the identity)."""
  if bl is not None:
    x = linalg.matmul(bl.T, x)
  if br is not None:
    x = linalg.matmul(x, br)
  return x


def rotate_out(x: jax.Array, bl: Optional[jax.Array], br: Optional[jax.Array]) -> jax.Array:
  """``U_L X U_R^T`` (a missing side is the identity)."""
  if bl is not None:
    x = linalg.matmul(bl, x)
  if br is not None:
    x = linalg.matmul(x, br.T)
  return x


def eig_floor(w: jax.Array, stats_eps: float) -> jax.Array:
  """``max(stats_eps, d * eps_f32 * max(w))``: float32 eigh cannot resolve eigenvalues
  below ~``d eps ||L||``; flooring them there makes the powers well defined (the same on
  the whole unresolved subspace, whatever basis eigh picked for it)."""
  rel = w.shape[-1] * jnp.finfo(jnp.float32).eps * jnp.max(w)
  return jnp.maximum(w, jnp.maximum(jnp.maximum(jnp.asarray(stats_eps, jnp.float32), rel),
                                    jnp.finfo(jnp.float32).tiny))


def eig_scale(x: jax.Array, el: Optional[jax.Array], er: Optional[jax.Array],
              power: Optional[float], stats_eps: float) -> jax.Array:
  """Shampoo: ``X * (lam_L,i lam_R,j)^power`` with floored eigenvalues."""
  if power is None:
    return x
  if el is not None:
    x = x * eig_floor(el, stats_eps)[:, None] ** power
  if er is not None:
    x = x * eig_floor(er, stats_eps)[None, :] ** power
  return x


def permute(x: jax.Array, i1: Optional[jax.Array], i2: Optional[jax.Array]) -> jax.Array:
  """``X[i1, :][:, i2]`` (a missing order is the identity): the inner state following
  power-QR's sort."""
  if i1 is not None:
    x = x[i1, :]
  if i2 is not None:
    x = x[:, i2]
  return x
