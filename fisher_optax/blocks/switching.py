"""Subspace refresh policies for :func:`fisher_optax.low_rank_track`, incl. switching.

A policy decides the new basis ``U`` (``m x r``, orthonormal) at a refresh step.
They are plain frozen dataclasses (static configuration), not transformations:
``low_rank_track(refresh=...)`` calls them inside its refresh branch (a ``lax.switch``).

* :func:`switch` -- paper Alg. "Subspace switching" (Sec. 5.2) on top of Alg.
  "Subspace iteration" (App.). With tracking decay ``b3`` and tracked
  ``Q~ = U_old^T Q U_old`` the reconstructed state is
  ``Q = b3 U_old Q~ U_old^T + (1 - b3) G G^T``; one subspace-iteration step forms
  ``Q U_old = b3 U_old Q~ + (1 - b3) G (G^T U_old)`` (``O(mnr)``, ``Q`` never
  built), ``U' = QR(Q U_old)``, Rayleigh-Ritz ``eigh(U'^T Q U')`` (descending),
  keeps the top ``leading`` Ritz vectors and fills the other ``rank - leading``
  columns with columns drawn uniformly without replacement from an orthonormal
  basis of the complement of ``span(U')`` (last ``m - r`` columns of the complete
  QR of ``U'``). If the complement has fewer than ``rank - leading`` columns the
  missing ones are the next Ritz vectors, so ``leading=None`` (or ``rank = m``)
  keeps the full Ritz basis: plain subspace iteration, no switching. The first
  refresh (step 1) takes the top-``r`` eigenvectors of ``G G^T`` (float32 eigh,
  no random mixing).
* :func:`svd_refresh` -- GaLore: top-``r`` left singular vectors of the current
  gradient at every refresh.

Randomness: the PRNG key lives in the optimizer state (replicated); the key of
leaf ``i`` at step count ``c`` is ``fold_in(fold_in(key, i), c)``, split once per
matrix of a stack (:func:`refresh_keys`). Every device draws the same columns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from fisher_optax import linalg, matrices, validation


def refresh_keys(key: jax.Array, leaf_index: int, count: jax.Array,
                 batch_shape: tuple[int, ...]) -> jax.Array:
  """Per-matrix keys, shape ``batch_shape + key.shape``, for one refresh of one leaf."""
  k = jax.random.fold_in(jax.random.fold_in(key, leaf_index), count)
  n = 1
  for b in batch_shape:
    n *= b
  keys = jax.random.split(k, n)
  return keys.reshape(batch_shape + keys.shape[1:])


def refresh_keys_all(key: jax.Array, count: jax.Array,
                     batch_shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
  """:func:`refresh_keys` of every leaf (leaf ``i`` has ``batch_shapes[i]``), equal to
  calling it leaf by leaf, with one vmapped hash per distinct stack size instead of one per
  leaf (compile time; :func:`fisher_optax.matrices.vmap_grouped`)."""
  sizes = [math.prod(b) for b in batch_shapes]
  idx = [jnp.asarray(i, jnp.uint32) for i in range(len(batch_shapes))]
  keys = matrices.vmap_grouped(
      lambda n: lambda i: jax.random.split(jax.random.fold_in(jax.random.fold_in(key, i), count),
                                           n), idx, sizes)
  return [k.reshape(b + k.shape[-1:]) for k, b in zip(keys, batch_shapes)]


def complement_indices(key: jax.Array, num_complement: int, k: int) -> jax.Array:
  """``k`` distinct indices drawn uniformly from ``range(num_complement)``."""
  return jax.random.permutation(key, num_complement)[:k]


@dataclasses.dataclass(frozen=True)
class Switch:
  """Subspace iteration + Rayleigh-Ritz + switching. Build with :func:`switch`."""

  leading: Optional[int] = None
  seed: int = 0
  iters: int = 1

  @property
  def random(self) -> bool:
    return self.leading is not None

  def first(self, g: jax.Array, r: int) -> jax.Array:
    """Step-1 basis: top-``r`` eigenvectors of ``G G^T``."""
    g = g.astype(jnp.float32)
    return linalg.top_eigvecs(g @ g.T, r)

  def refresh(self, g: jax.Array, u_old: jax.Array, q_old: Optional[jax.Array],
              b3, key: Optional[jax.Array]) -> jax.Array:
    """New basis from ``Q = b3 U_old Q~ U_old^T + (1 - b3) G G^T`` (one matrix)."""
    g = g.astype(jnp.float32)
    m, r = u_old.shape

    def q_times(u):
      out = (1 - b3) * (g @ (g.T @ u)) if q_old is not None else g @ (g.T @ u)
      if q_old is not None:
        out = out + b3 * (u_old @ (q_old @ (u_old.T @ u)))
      return out

    u1 = u_old
    for _ in range(self.iters):
      u1 = linalg.orthonormalize(q_times(u1))
    _, v = linalg.eigh_desc(u1.T @ q_times(u1))
    ritz = u1 @ v
    if self.leading is None or m == r:
      return linalg.canonical_signs(ritz)
    if isinstance(self.leading, int):
      k_c = min(r - min(self.leading, r), m - r)
      if k_c == 0:
        return linalg.canonical_signs(ritz)
      comp = linalg.complement_basis(u1)
      cols = [ritz[:, : r - k_c], comp[:, complement_indices(key, m - r, k_c)]]
      return linalg.canonical_signs(jnp.concatenate(cols, axis=1))
    # traced ``leading`` (optax.inject_hyperparams): draw the largest possible number of
    # complement columns and keep the first ``k_c`` -- the same indices as above, since
    # they are a prefix of one permutation
    k_max = min(r, m - r)
    k_c = jnp.minimum(r - jnp.clip(self.leading, 0, r), m - r)
    comp = linalg.complement_basis(u1)[:, complement_indices(key, m - r, k_max)]
    j = jnp.arange(r)
    from_comp = j >= r - k_c
    picked = comp[:, jnp.clip(j - (r - k_c), 0, k_max - 1)]
    return linalg.canonical_signs(jnp.where(from_comp[None, :], picked, ritz))


@dataclasses.dataclass(frozen=True)
class SvdRefresh:
  """GaLore's refresh: top-``r`` left singular vectors of ``G``. Build with :func:`svd_refresh`."""

  random = False
  seed = 0

  def first(self, g: jax.Array, r: int) -> jax.Array:
    return linalg.top_left_singular(g, r)

  def refresh(self, g, u_old, q_old, b3, key):
    del q_old, b3, key
    return linalg.top_left_singular(g, u_old.shape[1])


def switch(*, leading: Optional[int] = None, seed: int = 0, iters: int = 1) -> Switch:
  """Subspace switching policy (paper Alg. "Subspace switching").

  Args:
    leading: number ``l`` of leading Ritz vectors kept; the other ``rank - l``
      columns are sampled from the complement. ``None`` keeps all ``rank`` Ritz
      vectors (no switching). Clipped per matrix to the clipped rank.
    seed: seed of the PRNG key stored in the optimizer state.
    iters: subspace-iteration steps per refresh (paper: 1).
  """
  validation.check_int("leading", leading, low=0, allow_none=True)
  validation.check_int("iters", iters, low=1)
  if leading is not None and not isinstance(leading, jax.core.Tracer):
    leading = int(leading)
  return Switch(leading=leading, seed=seed, iters=validation.static_int("iters", iters))


def svd_refresh() -> SvdRefresh:
  """GaLore refresh policy: ``U = top-r left singular vectors of G`` (float32 SVD)."""
  return SvdRefresh()
