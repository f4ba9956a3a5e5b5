"""Subspace refresh policies for :func:`fisher_optax.low_rank_track`, incl. switching.

A policy decides the new basis ``U`` (``m x r``, orthonormal) at a refresh step.
They are plain frozen dataclasses (static configuration), not transformations:
``low_rank_track(refresh=...)`` calls their ``basis_from`` inside its refresh branch (a
``lax.cond``).

* :func:`switch` -- paper Alg. "Subspace switching" (Sec. 5.2) on top of Alg.
  "Subspace iteration" (App.). With tracking decay ``b3`` and tracked
  ``Q~ = U_old^T Q U_old`` the reconstructed state is
  ``Q = b3 U_old Q~ U_old^T + (1 - b3) G G^T``; one subspace-iteration step forms
  ``Q U_old = b3 U_old Q~ + (1 - b3) C U_old`` with the Gram ``C = G G^T``
  (:meth:`Switch.operand`; ``Q`` itself never built), ``U' = QR(Q U_old)``,
  Rayleigh-Ritz ``eigh(U'^T Q U')`` (descending), keeps the top ``leading`` Ritz
  vectors and fills the other ``rank - leading`` columns with columns drawn uniformly
  without replacement from an orthonormal basis of the complement of ``span(U')``
  (last ``m - r`` columns of the complete QR of ``U'``; only the drawn columns are
  computed, :func:`fisher_optax.linalg.complement_columns`). If the complement has fewer
  than ``rank - leading`` columns the missing ones are the next Ritz vectors, so
  ``leading=None`` (or ``rank = m``) keeps the full Ritz basis: plain subspace
  iteration, no switching. The first refresh (step 1) takes the top-``r``
  eigenvectors of ``G G^T`` (float32 eigh; for a tall ``G``, ``m > n``, its thin SVD;
  no random mixing).
* :func:`subspace_refresh` -- GaLore's projection by warm-started subspace iteration
  and Rayleigh-Ritz (no SVD; the default of :func:`fisher_optax.galore` and
  :func:`fisher_optax.fira`).
* :func:`svd_refresh` -- GaLore as released: top-``r`` left singular vectors of the
  current gradient at every refresh (float32 SVD).

Randomness: the PRNG key lives in the optimizer state (replicated); at the refresh at
step count ``c`` matrix ``j`` of the tree draws its ``m - r`` words with
``jax.random.bits`` from ``fold_in(fold_in(key, c), j)`` (``refresh_noise``,
:mod:`fisher_optax.rng`);
its complement columns are the first ``k`` of the argsort of its ``m - r`` words
(:func:`complement_indices`). Every device draws the same columns.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import linalg, rng, validation


def refresh_noise(key: jax.Array, count: jax.Array, num_matrices: int,
                  width: int) -> jax.Array:
  """The random words of the refresh at step ``count``: ``(num_matrices, max(width, 1))``
  uint32; matrix ``j`` of the tracked tree (leaves in flatten order, the matrices of a
  stack in order) reads row ``j`` (:func:`fisher_optax.rng.words`: ``jax.random.bits`` of
  ``fold_in(fold_in(key, count), j)``), its first ``m - r`` words."""
  return rng.words(key, count, num_matrices, max(width, 1))


def complement_indices(noise: jax.Array, k: int) -> jax.Array:
  """``k`` distinct indices drawn uniformly from ``range(len(noise))``: the first ``k`` of
  the (stable) argsort of i.i.d. 32-bit words, one sort round of
  ``jax.random.permutation``."""
  return jnp.argsort(noise)[:k]


def shifted_orthonormal(y: jax.Array, u: jax.Array) -> jax.Array:
  """``QR(Q U)`` of one subspace-iteration step, by Cholesky QR
  (:func:`fisher_optax.linalg.cholesky_qr`: products and ``r x r`` factors, batched on
  accelerators) of ``Y + delta U`` with ``Y = Q U`` and ``delta = 1e-6 ||Y||_F`` (of ``U``
  itself where ``Y = 0``).

  ``Q`` is positive semi-definite and ``U`` orthonormal, so ``(Q + delta I) U`` has full
  column rank with condition number at most ``1 + 1e6`` (within what Cholesky QR
  orthonormalizes in float32): a rank-deficient ``Q`` (a
  gradient of rank below ``r``, a zero gradient) still gives an orthonormal basis, its
  null-space columns taken from ``U``. ``Q + delta I`` has ``Q``'s eigenvectors, so
  the iteration's fixed points are unchanged; only directions whose eigenvalue is
  below ``delta`` (at most ``1e-6 sqrt(r)`` of the largest) converge more slowly.
  Cholesky QR on every backend, the same algorithm everywhere: on this 2-core CPU, Alice's
  60M refresh step read 7.92x ``optax.adam``'s update with Householder QR and 8.95x
  with it (paired runs on a quiet machine), on an H200 the batched Householder QR it
  replaces runs one matrix after another.
  """
  return linalg.cholesky_qr(linalg.shifted_step(y, u))


@dataclasses.dataclass(frozen=True)
class Switch:
  """Subspace iteration + Rayleigh-Ritz + switching. Build with :func:`switch`."""

  leading: Optional[int] = None
  seed: int = 0
  iters: int = 1

  # operand() of a wide matrix is its Gram G G^T, a sum over its columns
  reads_gram = True

  @property
  def random(self) -> bool:
    return self.leading is not None

  def operand(self, g: jax.Array) -> jax.Array:
    """What a refresh reads of the gradient (float32): its Gram matrix ``C = G G^T``
    (``m x m``) when ``m <= n``, else ``G`` itself (``batch + (m, n)``).

    Reading ``C`` rather than ``G`` makes the refresh a function of ``(m, r)`` only, so
    matrices of one ``m`` and different ``n`` (a LLaMA's attention, MLP and output
    kernels) share one compiled refresh (``grouping.map_grouped``);
    forming ``C`` costs ``m^2 n`` against the ``4 m n r`` of applying ``G G^T`` twice.
    A tall ``G`` (``m > n``: :func:`fisher_optax.alice_soap`'s right basis, whose ``m`` is
    the parameter's larger side, e.g. a 32000-token vocabulary) keeps ``G``: its Gram
    would be larger than ``G`` (``m^2 > m n``) and its eigh ``O(m^3)``. An operand is a
    Gram iff it is square (``m x m``; for ``m = n`` the Gram is taken)."""
    g = g.astype(jnp.float32)
    if g.shape[-2] > g.shape[-1]:
      return g
    return linalg.matmul(g, jnp.swapaxes(g, -1, -2))

  def first(self, g: jax.Array, r: int) -> jax.Array:
    """Step-1 basis: top-``r`` eigenvectors of ``G G^T``."""
    return self.first_from(self.operand(g), r)

  def first_from(self, c: jax.Array, r: int, *, signs: bool = True) -> jax.Array:
    """``first`` from ``operand``: eigh of ``C``; for a tall ``G`` the same
    vectors from its thin SVD (``O(m n^2)``), completed by the complement of its left
    singular vectors (eigenvalue 0 of ``G G^T``) when ``r > n``. ``signs=False`` leaves
    the final canonical sign fix to the caller (not possible when ``r > n``: the
    complement is drawn from the signed vectors)."""
    m, n = linalg.total_rows(c.shape[0]), c.shape[1]  # c's rows may be split
    if m == n:  # the Gram, symmetric by construction
      return linalg.top_eigvecs(c, r, signs=signs, symmetrize=False)
    if r <= n:
      return linalg.top_left_singular(c, r, signs=signs)
    u = linalg.top_left_singular(c, n)
    return jnp.concatenate([u, linalg.complement_columns(u, jnp.arange(r - n))], axis=1)

  def basis_from(self, c: jax.Array, u_old: jax.Array, q_old: Optional[jax.Array], b3,
                 noise: Optional[jax.Array], first: jax.Array) -> jax.Array:
    """The basis of a refresh step from ``operand``: ``first_from`` where the
    scalar ``first`` is true (step 1), else :meth:`refresh_from`. One ``lax.cond`` per
    matrix, so the two refreshes share everything around them in one compiled branch
    (operands, grouping, the non-finite guard, the re-expression of ``Q~``), and the
    canonical sign fix that ends both runs once, after the cond: the compiled program
    holds each of them once, not once per branch."""
    m, r = u_old.shape
    rows = linalg.total_rows(c.shape[0])  # a tall c's rows may be split (linalg.rows_split)
    after = rows == c.shape[1] or r <= c.shape[1]  # see first_from(signs=False)
    if rows > c.shape[1] >= r:  # a thin SVD, split where c's rows are
      begin = lambda: self.first_from(c, r, signs=not after)  # noqa: E731
    else:  # the Gram's eigh, or a complement drawn from the whole basis
      begin = lambda: linalg.on_whole_rows(  # noqa: E731
          lambda whole: self.first_from(whole, r, signs=not after), c)
    u = jax.lax.cond(first, begin, lambda: self.refresh_from(c, u_old, q_old, b3, noise,
                                                             signs=not after))
    return linalg.canonical_signs(u) if after else u

  def noise_size(self, m: int, r: int) -> int:
    """Random words a refresh of an ``m x r`` basis reads: ``m - r`` when switching."""
    return m - r if self.random else 0

  def refresh(self, g: jax.Array, u_old: jax.Array, q_old: Optional[jax.Array],
              b3, key: Optional[jax.Array]) -> jax.Array:
    """New basis from ``Q = b3 U_old Q~ U_old^T + (1 - b3) G G^T`` (one matrix); the
    complement draw reads ``m - r`` words of ``jax.random.bits(key)``."""
    m, r = u_old.shape
    noise = (None if key is None or not self.noise_size(m, r)
             else jax.random.bits(key, (m - r,), jnp.uint32))
    return self.refresh_from(self.operand(g), u_old, q_old, b3, noise)

  def refresh_from(self, c: jax.Array, u_old: jax.Array, q_old: Optional[jax.Array],
                   b3, noise: Optional[jax.Array], *, signs: bool = True,
                   iters=None, start: Optional[jax.Array] = None) -> jax.Array:
    """``refresh`` from ``operand`` (``C = G G^T``, or a tall ``G``) and the random
    words ``noise`` (at least ``m - r`` uint32, ``refresh_noise``). ``signs=False``
    leaves the final canonical sign fix to the caller. ``iters`` (default ``self.iters``)
    may be a traced integer (then the steps run as one compiled loop); ``start`` is the
    iteration's first basis (default ``u_old``)."""
    m, r = u_old.shape
    m = linalg.total_rows(m)  # a tall c's rows may be split over devices (rows_split)
    gram = c.shape[-1] == m  # else c is a tall G: C u = G (G^T u)
    fix = linalg.canonical_signs if signs else (lambda x: x)

    def q_times(u):
      cu = linalg.matmul(c, u) if gram else linalg.matmul(c, linalg.tdot(c, u))
      out = (1 - b3) * cu if q_old is not None else cu
      if q_old is not None:
        out = out + b3 * linalg.matmul(u_old, linalg.matmul(q_old, linalg.tdot(u_old, u)))
      return out

    u1 = u_old if start is None else start
    n = self.iters if iters is None else iters
    if isinstance(n, int):
      for _ in range(n):
        u1 = shifted_orthonormal(q_times(u1), u1)
    else:
      u1 = jax.lax.fori_loop(0, n, lambda _, u: shifted_orthonormal(q_times(u), u), u1)
    # the Rayleigh quotient U^T Q U is symmetric by construction; every result is re-signed
    _, v = linalg.eigh_desc(linalg.tdot(u1, q_times(u1)), signs=False, symmetrize=False)
    ritz = linalg.matmul(u1, v)
    if self.leading is None or m == r:
      return fix(ritz)
    if isinstance(self.leading, int):
      k_c = min(r - min(self.leading, r), m - r)
      if k_c == 0:
        return fix(ritz)
      comp = linalg.complement_columns(u1, complement_indices(noise[:m - r], k_c))
      # the last k_c Ritz columns replaced in place
      return fix(jax.lax.dynamic_update_slice(ritz, comp, (0, r - k_c)))
    # traced ``leading`` (optax.inject_hyperparams): draw the largest possible number of
    # complement columns and keep the first ``k_c`` -- the same indices as above, since
    # they are a prefix of one permutation
    k_max = min(r, m - r)
    k_c = jnp.minimum(r - jnp.clip(self.leading, 0, r), m - r)
    comp = linalg.complement_columns(u1, complement_indices(noise[:m - r], k_max))
    j = jnp.arange(r)
    from_comp = j >= r - k_c
    picked = comp[:, jnp.clip(j - (r - k_c), 0, k_max - 1)]
    return fix(jnp.where(from_comp[None, :], picked, ritz))


@dataclasses.dataclass(frozen=True)
class SubspaceRefresh(Switch):
  """GaLore's projection without an SVD. Build with :func:`subspace_refresh`."""

  iters: int = 2

  def operand(self, g: jax.Array) -> jax.Array:
    """:meth:`Switch.operand` of ``G / max|G|``: the same eigenvectors, and a Gram that
    neither overflows nor underflows in float32 for gradients of any finite scale, so
    the basis does not depend on the gradient's scale."""
    g = g.astype(jnp.float32)
    top = jnp.max(jnp.abs(g), axis=(-2, -1), keepdims=True)
    return super().operand(g / jnp.where(top > 0, top, 1.0))

  def start(self, m: int, r: int) -> jax.Array:
    """The first refresh's start: a fixed orthonormal ``m x r`` basis, the Q factor of a
    Gaussian matrix drawn by ``numpy.random.default_rng(seed)`` when the update is traced
    (a constant of the compiled program: no PRNG state, and no random-number kernels
    to compile)."""
    gauss = np.random.default_rng(self.seed).standard_normal((m, r))
    return jnp.asarray(np.linalg.qr(gauss)[0], jnp.float32)

  def first_from(self, c: jax.Array, r: int, *, signs: bool = True) -> jax.Array:
    """Step-1 basis: ``2 * iters`` subspace-iteration steps from :meth:`start`, then
    Rayleigh-Ritz."""
    return self.refresh_from(c, self.start(c.shape[0], r), None, 0.0, None, signs=signs,
                             iters=2 * self.iters)

  def basis_from(self, c, u_old, q_old, b3, noise, first):
    """Every refresh is one loop of subspace-iteration steps and a Rayleigh-Ritz step:
    ``2 * iters`` steps from :meth:`start` at the first refresh, ``iters`` from the
    previous basis after it. One compiled loop serves both (the step count is data), so
    the refresh compiles once rather than once per branch and per unrolled step."""
    del q_old, b3, noise
    m, r = u_old.shape
    start = jnp.where(first, self.start(m, r), u_old)
    n = jnp.where(first, 2 * self.iters, self.iters)
    return self.refresh_from(c, u_old, None, 0.0, None, iters=n, start=start)


@dataclasses.dataclass(frozen=True)
class SvdRefresh:
  """GaLore's refresh: top-``r`` left singular vectors of ``G``. Build with :func:`svd_refresh`."""

  random = False
  seed = 0
  reads_gram = False

  def operand(self, g: jax.Array) -> jax.Array:
    """The gradient itself (float32): an SVD reads ``G``."""
    return g.astype(jnp.float32)

  def first(self, g: jax.Array, r: int) -> jax.Array:
    return linalg.top_left_singular(g, r)

  first_from = first

  def noise_size(self, m: int, r: int) -> int:
    del m, r
    return 0

  def basis_from(self, c, u_old, q_old, b3, noise, first):
    """The first refresh and the later ones are the same SVD."""
    del q_old, b3, noise, first
    return self.first_from(c, u_old.shape[-1])

  def refresh(self, g, u_old, q_old, b3, key):
    del q_old, b3, key
    return linalg.top_left_singular(g, u_old.shape[1])

  refresh_from = refresh


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


def subspace_refresh(*, iters: int = 2, seed: int = 0) -> SubspaceRefresh:
  """GaLore's refresh by subspace iteration (the default of :func:`fisher_optax.galore`
  and :func:`fisher_optax.fira`): the top-``r`` left singular subspace of ``G`` from
  matrix products and ``r x r`` factorizations, no SVD.

  At a refresh, with ``C = G G^T`` and the previous basis ``U``: ``iters`` steps
  ``U <- QR((C + delta I) U)`` (Cholesky QR of the shifted step), then
  Rayleigh-Ritz ``U <- U V`` with ``V`` the eigenvectors of ``U^T C U`` (descending,
  ``r x r``), canonical signs: warm-started subspace iteration (Golub and Van Loan,
  Matrix Computations, Sec. 8.2.4; the paper's App. Alg. "Subspace iteration" without
  switching). The first refresh starts from a fixed Gaussian orthonormal basis and runs
  ``2 * iters`` steps. The result estimates :func:`svd_refresh`'s ``svd_r(G)`` and
  captures nearly all of its energy ``||U^T G||_F^2`` when the spectrum decays (tests:
  at least 0.99 on decaying, flat-topped, rank-deficient and zero spectra); on a
  slowly decaying or near-flat spectrum with a small gap at ``r`` it captures less
  (docs: "Numerics policy" gives the measured fractions).

  Why: on GPUs ``jnp.linalg.svd`` runs cuSOLVER ``gesvd`` one matrix after another; the
  products, Cholesky factors and small eigendecompositions here are batched per shape.

  Args:
    iters: subspace-iteration steps per refresh (the first refresh runs twice as many).
    seed: seed of the fixed start of the first refresh (no PRNG state is stored).
  """
  validation.check_int("iters", iters, low=1)
  return SubspaceRefresh(leading=None, seed=seed, iters=validation.static_int("iters", iters))


def svd_refresh() -> SvdRefresh:
  """GaLore refresh policy: ``U = top-r left singular vectors of G`` (float32 SVD)."""
  return SvdRefresh()
