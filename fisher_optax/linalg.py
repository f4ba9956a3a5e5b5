"""Float32 linear algebra shared by the blocks: eigh, QR, subspace iteration, complements.

All functions act on one matrix (callers ``vmap`` over stacks) and compute in
float32 whatever the input dtype, matrix products at float32 precision on every backend
unless ``jax.default_matmul_precision`` says otherwise (:func:`matmul`; docs: "Numerics
policy"). Eigen/singular vectors are
returned with a canonical sign -- the entry of largest magnitude in each column is
positive -- so that results do not depend on the LAPACK/cuSOLVER sign convention,
precision or device. That matters because the low-rank methods carry moments over
a change of basis without rotating them (paper Alg. "Alice", GaLore).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

f32 = jnp.float32

# Inside ``jax.shard_map`` the rows of a tall matrix may be split over mesh axes, each
# device holding a contiguous block of rows in the mesh's order (the owner layout's
# refresh of a larger side's basis in place: :func:`rows_split`). The functions below that
# reduce over the rows (norms, ``A^T B``, the largest entry of a column, rows picked by
# index) then reduce over those axes too, so that one matrix's mathematics is the same
# whether its rows are whole or split; ``None``: whole.
_ROWS: contextvars.ContextVar = contextvars.ContextVar("fisher_optax_rows_split",
                                                       default=None)


@contextlib.contextmanager
def rows_split(axes: tuple):
  """Traces the body (inside ``jax.shard_map``) with every matrix's rows split in blocks
  over the mesh ``axes``: the reductions over rows of this module sum over them."""
  token = _ROWS.set(tuple(axes))
  try:
    yield
  finally:
    _ROWS.reset(token)


def rows_sum(x: jax.Array) -> jax.Array:
  """``x`` (a sum over this device's rows) summed over every block of rows."""
  axes = _ROWS.get()
  return x if axes is None else jax.lax.psum(x, axes)


def rows_max(x: jax.Array) -> jax.Array:
  axes = _ROWS.get()
  return x if axes is None else jax.lax.pmax(x, axes)


def row_index(m: int) -> jax.Array:
  """The global indices of this device's ``m`` rows."""
  axes = _ROWS.get()
  if axes is None:
    return jnp.arange(m)
  return jax.lax.axis_index(axes) * m + jnp.arange(m)


def total_rows(m: int) -> int:
  """The number of rows of the whole matrix of which this device holds ``m``."""
  axes = _ROWS.get()
  return m if axes is None else m * jax.lax.axis_size(axes)


def take_rows(a: jax.Array, idx: jax.Array) -> jax.Array:
  """Rows ``idx`` (global indices) of ``a`` (``m x n``), on every device."""
  axes = _ROWS.get()
  if axes is None:
    return a[idx]
  here = row_index(a.shape[0])
  local = idx - here[0]
  mine = (local >= 0) & (local < a.shape[0])
  picked = jnp.where(mine[:, None], a[jnp.clip(local, 0, a.shape[0] - 1)], 0.0)
  return jax.lax.psum(picked, axes)


def on_whole_rows(fn, a: jax.Array) -> jax.Array:
  """``fn(A)`` for a function of a whole matrix (an SVD) with an ``m x k`` result: where
  ``A``'s rows are split, ``A`` is gathered to every device, ``fn`` runs on it whole, and
  each device keeps its own rows of the result."""
  axes = _ROWS.get()
  if axes is None:
    return fn(a)
  token = _ROWS.set(None)
  try:
    whole = fn(jax.lax.all_gather(a, axes, axis=0, tiled=True))
  finally:
    _ROWS.reset(token)
  m = a.shape[0]
  return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(axes) * m, m, axis=0)


def tdot(a: jax.Array, b: jax.Array) -> jax.Array:
  """``A^T B`` for ``A`` (``m x p``) and ``B`` (``m x q``): a product over the rows."""
  return rows_sum(matmul(a.T, b))

# Every matrix product of the blocks requests float32 precision unless the user has
# chosen one with JAX's own ``jax.default_matmul_precision`` (config or context). JAX's
# default float32 product is not float32 on accelerators: TensorFloat-32 on NVIDIA GPUs
# (10-bit mantissa), one bfloat16 pass on TPUs. The blocks' products form the statistics
# that eigendecompositions and QR read and the rotations and projections that Adam-style
# normalisations divide by, so their rounding reaches the update magnified (docs:
# "Numerics policy" gives the measured effect). An explicit choice is followed, so a run
# that wants TensorFloat-32's speed in the optimizer can have it; the setting is read at
# trace time and is part of ``jax.jit``'s cache key.
PRECISION = jax.lax.Precision.HIGHEST


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` (``jnp.matmul`` broadcasting) at float32 precision on every backend, or at
  the precision set with ``jax.default_matmul_precision`` where one is set."""
  chosen = jax.config.jax_default_matmul_precision
  return jnp.matmul(a, b, precision=PRECISION if chosen is None else None)


# Products with a vector are written as broadcast-multiply-reduce, not ``@``: the same
# arithmetic, memory-bound on every backend either way. XLA:CPU compiles every ``dot``
# instruction into an LLVM module of its own (~40 ms each), while identical reduce
# fusions of same-shape matrices compile once: RACS's fixed point on 48 matrices of
# 768 x 768 compiled in 5.0 s with ``@`` and 2.7 s with these, at the same step time on
# the 130M preset (benchmarks/step_time.py).


def vec_mat(v: jax.Array, a: jax.Array) -> jax.Array:
  """``v^T A`` for a vector ``v`` (``m``) and a matrix ``A`` (``m x n``): an ``n``-vector."""
  return jnp.sum(v[:, None] * a, axis=0)


def mat_vec(a: jax.Array, v: jax.Array) -> jax.Array:
  """``A v`` for a matrix ``A`` (``m x n``) and a vector ``v`` (``n``): an ``m``-vector."""
  return jnp.sum(a * v[None, :], axis=1)


def project_rows(basis: jax.Array, a: jax.Array) -> jax.Array:
  """``U^T A`` for a basis ``U`` (``... x m x r``) and ``A`` (``... x m x n``); for
  ``r = 1`` as a multiply-reduce (see :func:`vec_mat`)."""
  if basis.shape[-1] == 1:
    return jnp.sum(basis * a, axis=-2, keepdims=True)
  return matmul(jnp.swapaxes(basis, -1, -2), a)


def canonical_signs(v: jax.Array) -> jax.Array:
  """Flips each column of ``v`` so that its largest-magnitude entry is positive (the
  first such entry, in row order)."""
  idx = jnp.argmax(jnp.abs(v), axis=0)
  s = jnp.sign(jnp.take_along_axis(v, idx[None, :], axis=0))
  axes = _ROWS.get()
  if axes is not None:  # the first block of rows that holds the column's largest entry
    top = jax.lax.all_gather(jnp.take_along_axis(jnp.abs(v), idx[None, :], axis=0)[0], axes)
    signs = jax.lax.all_gather(s[0], axes)
    s = jnp.take_along_axis(signs, jnp.argmax(top, axis=0)[None, :], axis=0)
  return v * jnp.where(s == 0, 1.0, s).astype(v.dtype)


def eigh_desc(a: jax.Array, *, signs: bool = True,
              symmetrize: bool = True) -> tuple[jax.Array, jax.Array]:
  """Eigen-decomposition of a symmetric matrix, eigenvalues in descending order.

  Returns ``(w, V)`` with ``a = V diag(w) V^T``, computed in float32, with canonical
  column signs (``signs=False``: LAPACK's signs, for a caller that fixes the signs of
  what it builds from ``V`` itself). ``symmetrize=False`` for a matrix symmetric by
  construction up to rounding (a Gram ``G G^T``, a Rayleigh quotient ``U^T Q U``): the
  solver then reads its lower triangle instead of ``(a + a^T) / 2`` (same matrix to
  rounding; the transposing copy compiled into XLA:CPU kernels of its own).
  """
  a = a.astype(f32)
  if symmetrize:
    a = 0.5 * (a + a.T)  # exactly symmetric, so eigh need not symmetrise again
  w, v = jnp.linalg.eigh(a, symmetrize_input=False)
  v = v[:, ::-1]
  return w[::-1], canonical_signs(v) if signs else v


def top_eigvecs(a: jax.Array, r: int, *, signs: bool = True,
                symmetrize: bool = True) -> jax.Array:
  """Top-``r`` eigenvectors of a symmetric matrix (float32 eigh, canonical signs unless
  ``signs=False``), ``m x r``; ``symmetrize`` as for :func:`eigh_desc`."""
  v = eigh_desc(a, signs=False, symmetrize=symmetrize)[1][:, :r]
  return canonical_signs(v) if signs else v


def top_left_singular(g: jax.Array, r: int, *, signs: bool = True) -> jax.Array:
  """Top-``r`` left singular vectors of ``g`` (float32 SVD, canonical signs unless
  ``signs=False``), ``m x r``. Where ``g``'s rows are split (:func:`rows_split`) and a
  device holds at least ``n`` of them: :func:`split_left_singular`."""
  axes = _ROWS.get()
  if axes is not None and g.shape[0] < g.shape[1]:
    return on_whole_rows(lambda whole: top_left_singular(whole, r, signs=signs), g)
  if axes is not None:
    u = split_left_singular(g.astype(f32), axes)
  else:
    u, _, _ = jnp.linalg.svd(g.astype(f32), full_matrices=False)
  return canonical_signs(u[:, :r]) if signs else u[:, :r]


def split_left_singular(a: jax.Array, axes: tuple) -> jax.Array:
  """This device's rows of the left singular vectors of a tall matrix whose rows are
  split in blocks over the mesh ``axes`` (each block ``b x n``, ``b >= n``), by a
  tall-skinny QR: ``A_i = Q_i R_i`` on each device, ``[R_1; ...; R_P] = Q' R``,
  ``R = U_R S V^T``, so ``A = (diag(Q_i) Q' U_R) S V^T`` and the left singular vectors
  are ``Q_i Q'_i U_R`` (``Q'_i``: block ``i`` of ``Q'``; Demmel et al. 2012,
  arXiv:0808.2664). Only ``n x n`` factors cross between devices, where gathering the
  matrix put all of it on every device (the 60M LLaMA's 32000 x 128 coefficients under
  FSDP: 16 MB, twice, in every device's temporary memory).

  Where every mesh axis of ``axes`` has a power-of-two size, ``Q' R`` is formed by the
  butterfly of the same paper (its all-reduce TSQR), one bit of each axis' index at a
  time: each device and the one whose index differs in that bit swap their ``n x n``
  factors and both factor the pair stacked lower index first, ``[R_lo; R_hi] = Q_j R``,
  keeping their own ``n x n`` half of ``Q_j``; ``Q'_i`` is the product of those halves
  (each pair factors the same stack, so every device ends with the same ``R``). Each
  device sends ``log2 P`` factors and holds two, where gathering them sent ``P - 1``
  and held all ``P`` (32 devices: 2 MB of 128 x 128 factors, and their copy for the
  QR, in every device's temporary memory). Other device counts gather the factors."""
  n = a.shape[1]
  q1, r1 = jnp.linalg.qr(a, mode="reduced")
  names = axes if isinstance(axes, tuple) else (axes,)
  sizes = [jax.lax.axis_size(name) for name in names]
  if any(s & (s - 1) for s in sizes):
    q2, r2 = jnp.linalg.qr(jax.lax.all_gather(r1, axes, axis=0, tiled=True), mode="reduced")
    block = jax.lax.dynamic_slice_in_dim(q2, jax.lax.axis_index(axes) * n, n, axis=0)
  else:
    block, r2 = None, r1
    # one axis at a time: ppermute over several axes numbers the devices in the
    # mesh's order, not in the order of the names given (jax 0.10)
    for name, size in zip(names, sizes):
      me, bit = jax.lax.axis_index(name), 1
      while bit < size:
        other = jax.lax.ppermute(r2, name, [(d, d ^ bit) for d in range(size)])
        low = (me & bit) == 0
        qj, r2 = jnp.linalg.qr(jnp.concatenate([jnp.where(low, r2, other),
                                                jnp.where(low, other, r2)]), mode="reduced")
        half = jnp.where(low, qj[:n], qj[n:])
        block = half if block is None else matmul(block, half)
        bit *= 2
  u_r, _, _ = jnp.linalg.svd(r2)
  return matmul(q1, u_r if block is None else matmul(block, u_r))


def orthonormalize(h: jax.Array) -> jax.Array:
  """Thin QR: an orthonormal basis (``m x r``) of the columns of ``h``."""
  q, _ = jnp.linalg.qr(h.astype(f32), mode="reduced")
  return q


def cholesky_qr(h: jax.Array) -> jax.Array:
  """Thin QR by matrix products and ``k x k`` Cholesky factors only: an orthonormal basis
  (``m x k``) of the columns of a full-column-rank ``h``, the same span as
  :func:`orthonormalize` (columns may differ in sign: here ``R`` has a positive diagonal).

  Shifted Cholesky QR (Fukaya, Kannan, Nakatsukasa, Zhang and Yamamoto, "Shifted
  Cholesky QR for computing the QR factorization of ill-conditioned matrices", SIAM J.
  Sci. Comput. 42(1), 2020), with ``X`` = ``h`` scaled to unit largest entry: two
  shifted passes ``R^T R = Q^T Q + s I``, ``Q <- Q R^{-1}`` (``Q = X`` first), then two
  plain passes ``Q <- Q chol(Q^T Q)^{-T}``. The shift is ``s = (m + k) eps ||Q||_F^2``
  (``eps``: float32 machine epsilon), below the paper's worst-case bound
  ``11 (m k + k (k + 1)) u ||X||_F^2``, which in float32 leaves the first factor too
  ill-conditioned for the plain passes beyond a condition number of about 1e4; each
  shifted pass divides the condition number by about ``1 / sqrt(s)``, so the result is
  orthonormal to float32 rounding up to condition numbers of 1e6 (tested at
  ``2048 x 256``; the paper's three passes reach 1e5). A rank-deficient or
  non-finite ``h`` gives non-finite columns: callers shift their operand so that it
  has full rank, and keep the previous basis when a result is not finite.

  Why not Householder QR: on GPUs a batched QR runs one matrix after another (cuSOLVER
  ``geqrf``), while the products, the batched ``k x k`` Cholesky factorizations and
  triangular solves here run as batched kernels (docs: "Performance").
  """
  x = h.astype(f32)
  m, k = x.shape[-2:]
  m = total_rows(m)
  top = rows_max(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True))
  x = x / jnp.where(top > 0, top, 1.0)

  eps = float(jnp.finfo(f32).eps)

  def step(i, q):  # passes 0 and 1 shifted, 2 and 3 plain
    gram = rows_sum(matmul(jnp.swapaxes(q, -1, -2), q))
    s = jnp.where(i < 2, (m + k) * eps, 0.0) * jnp.trace(gram, axis1=-2, axis2=-1)
    lower = jnp.linalg.cholesky(gram + s[..., None, None] * jnp.eye(k, dtype=f32))
    # Q <- Q L^{-T}: one right-side solve with L^T on Q as it is laid out; solving
    # L Q^T = Q^T instead copies Q into and out of its transpose in every pass
    return jax.lax.linalg.triangular_solve(lower, q, left_side=False, lower=True,
                                           transpose_a=True)

  # one compiled loop of four passes rather than four unrolled copies (compile time)
  return jax.lax.fori_loop(0, 4, step, x)


def shifted_step(y: jax.Array, u: jax.Array) -> jax.Array:
  """``Y + delta U`` with ``delta = 1e-6 ||Y||_F`` (``U`` itself where ``Y = 0``): for
  ``Y = A U`` (``A`` positive semi-definite, ``U`` orthonormal) this is ``(A + delta I) U``,
  of full column rank with condition number at most ``1 + 1e6``, what
  :func:`cholesky_qr` orthonormalizes in float32."""
  y = y.astype(f32)
  u = u.astype(f32)
  norm = jnp.sqrt(rows_sum(jnp.sum(jnp.square(y), axis=(-2, -1), keepdims=True)))
  return jnp.where(norm > 0, y + 1e-6 * norm * u, u)


def power_orthonormal(y: jax.Array, u: jax.Array) -> jax.Array:
  """The orthonormal factor of one power-iteration step: ``Q`` of the thin QR
  ``Y + delta U = Q R`` with ``R``'s diagonal positive (the unique thin QR), for ``Y = A U``
  with ``A`` positive semi-definite and ``U`` orthonormal, ``delta = 1e-6 ||Y||_F`` (``U``
  itself where ``Y = 0``).

  ``Y + delta U = (A + delta I) U``: ``A``'s eigenvectors, and full column rank with
  condition number at most ``1 + 1e6`` even for a rank-deficient or zero ``A`` (a
  statistic of fewer gradients than its side), whose null-space columns then come from
  ``U``. The same factor on every backend, computed the way that backend is fastest:

  XLA:CPU note. LAPACK's Householder QR is faster on this CPU than :func:`cholesky_qr`
  for square operands (per matrix, measured batched on 2 cores: 512 x 512 9 ms against
  28 ms, 1376 x 1376 72 ms against 257 ms), so CPU runs Householder QR with its
  columns re-signed to a positive ``R`` diagonal. On GPUs a batched Householder QR runs
  one matrix after another (an H200 took 23.6 ms for 32 matrices of 512 x 128 that
  Cholesky QR orthonormalized in 0.75 ms), so accelerators run :func:`cholesky_qr`. The
  two agree to float32 rounding (tests).
  """
  return positive_qr(shifted_step(y, u))


def positive_qr(x: jax.Array) -> jax.Array:
  """``Q`` of the thin QR ``X = Q R`` with ``R``'s diagonal positive, for a ``X`` of full
  column rank whose condition number is at most about 1e6: Householder QR re-signed on
  XLA:CPU, :func:`cholesky_qr` elsewhere (:func:`power_orthonormal`'s note)."""

  def householder(x):
    q, r = jnp.linalg.qr(x, mode="reduced")
    d = jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))
    return q * jnp.where(d == 0, 1.0, d)[..., None, :]

  return jax.lax.platform_dependent(x, cpu=householder, default=cholesky_qr)


def unit_max(x: jax.Array) -> jax.Array:
  """``x / max|x|`` (``x`` itself where that maximum is 0 or not finite): a scale that
  keeps products of tiny or huge entries inside float32's range."""
  top = jnp.max(jnp.abs(x))
  return x / jnp.where((top > 0) & jnp.isfinite(top), top, 1.0)


def orthonormal_columns(y: jax.Array) -> jax.Array:
  """An orthonormal ``n x r`` basis of the columns of any ``y`` (``n >= r``), in
  Gram--Schmidt order: the positive-diagonal thin QR factor of ``Y + delta E`` with
  ``E`` the first ``r`` columns of the identity and ``delta = 1e-6 ||Y||_F`` (``E``
  itself where ``Y = 0`` or is not finite).

  For a rank-deficient ``Y`` (a momentum of rank below ``r``), ``Y + delta E`` has full
  rank with a condition number of about ``1e6`` at most, so :func:`positive_qr` stays
  finite on every backend, and the columns beyond ``Y``'s rank are completed from
  ``E``. For ``Y`` of full column rank it is ``Y``'s own QR factor moved by about
  ``1e-6`` times ``Y``'s condition number: callers use :func:`positive_qr` of ``Y``
  itself where that is orthonormal (:func:`is_orthonormal`) and this where it is not.
  ``Y`` is scaled to a unit largest entry first (the factor does not depend on the
  scale)."""
  y = y.astype(f32)
  top = jnp.max(jnp.abs(y))
  ok = (top > 0) & jnp.isfinite(top)
  y = unit_max(y)
  e = jnp.eye(y.shape[-2], y.shape[-1], dtype=f32)
  norm = jnp.sqrt(jnp.sum(jnp.square(y)))
  return positive_qr(jnp.where(ok, y + 1e-6 * norm * e, e))


def complement_columns(u: jax.Array, cols: jax.Array) -> jax.Array:
  """Columns ``cols`` (indices in ``[0, m - r)``) of an orthonormal basis of the
  complement of span(``u``), ``u`` (``m x r``) orthonormal: ``m x len(cols)``.

  The paper (Sec. "Switching") approximates ``U_c`` by the QR decomposition of ``U``: the
  last ``m - r`` columns of the complete Householder QR of ``u``,
  ``Q = H_1 ... H_r = I - Y T Y^T`` (compact WY form: ``Y`` unit lower trapezoidal, ``T``
  upper triangular), the basis LAPACK's ``geqrf`` gives. Column ``r + j`` is
  ``Q e_{r+j} = e_{r+j} - Y T Y[r + j, :]^T``; the ``m x m`` ``Q`` is never formed (4 GB for
  a 32000-row side).

  ``Y`` and ``T`` come from Householder reconstruction (Ballard, Demmel, Grigori,
  Jacquelin, Nguyen and Solomonik, "Reconstructing Householder vectors from tall-skinny
  QR", IPDPS 2014): for an orthonormal ``u`` the Householder ``R`` is a sign matrix ``S``,
  so ``u - [S; 0] = Y W`` with ``W = -T Y_1^T S``. The top ``r x r`` block is an LU
  factorization without pivoting, ``u_1 - S = Y_1 W`` (:func:`_sign_lu`, which picks
  ``S_kk = -sign`` of each pivot as Householder does, so every pivot is at least 1 in
  magnitude); then ``Y_2 = u_2 W^{-1}`` and ``T = -W S Y_1^{-T}``. So
  ``Q e_{r+j} = e_{r+j} - Y t_j`` with ``t_j = -W S Y_1^{-T} W^{-T} u_2[j, :]^T``: two
  ``r x r`` triangular solves and products. These are the same columns as the Householder
  QR's (to float32 rounding; tests), computed without one: on GPUs a batched Householder
  QR runs one matrix after another, while the loop of rank-1 updates, the triangular
  solves and the products here run batched. On a 2-core CPU too it is the faster: 57
  matrices of 512 x 128, 88 columns each, in 76 ms against 311 ms for Householder QR and
  ``ormqr`` (medians of 7, jitted; 0.39 s against 0.15 s to compile), and Alice's 60M
  refresh step went from 7.5x to 6.8x ``optax.adam``'s update.
  """
  u = u.astype(f32)
  m, r = u.shape
  split = _ROWS.get() is not None
  lu, s = _sign_lu(take_rows(u, jnp.arange(r)) if split else u[:r])
  w = jnp.triu(lu)
  y1 = jnp.tril(lu, -1) + jnp.eye(r, dtype=f32)
  solve = jax.scipy.linalg.solve_triangular
  if split:  # this device's rows of Y: of Y_1 above row r, of Y_2 = u_2 W^{-1} below
    rows = row_index(m)
    y2_cols = solve(w, take_rows(u, r + cols).T, trans=1, lower=False).T
    y = jnp.where((rows < r)[:, None], y1[jnp.clip(rows, 0, r - 1)],
                  solve(w, u.T, trans=1, lower=False).T)
  else:
    rows = jnp.arange(m)
    y2 = solve(w, u[r:].T, trans=1, lower=False).T  # Y_2 W = u_2
    y2_cols = y2[cols]
  z = solve(y1, y2_cols.T, trans=1, lower=True, unit_diagonal=True)  # Y_1^T z = Y_2[cols]^T
  t = -matmul(w, s[:, None] * z)  # T Y_2[cols]^T, r x k
  units = (rows[:, None] == (r + cols)[None, :]).astype(f32)
  if split:
    return units - matmul(y, t)
  return units - jnp.concatenate([matmul(y1, t), matmul(y2, t)], axis=0)


def _sign_lu(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """LU factorization without pivoting of ``a - S`` (``r x r``), ``S = diag(s)`` chosen
  step by step as ``s_k = -sign(p_k)`` of the ``k``-th pivot ``p_k`` of ``a`` (``+1`` taken
  for ``sign(0)``), Householder's sign choice: every pivot of ``a - S`` is ``p_k - s_k``,
  at least 1 in magnitude. Returns ``(LU, s)`` with ``L`` (unit diagonal) below the
  diagonal of ``LU`` and the upper factor on and above it. One compiled loop of ``r``
  rank-1 updates."""
  r = a.shape[-1]
  idx = jnp.arange(r)

  def step(k, carry):
    a, s = carry
    p = a[k, k]
    sk = jnp.where(p >= 0, -1.0, 1.0).astype(f32)
    pivot = p - sk
    below = idx > k
    col = jnp.where(below, a[:, k] / pivot, 0.0)
    a = a - col[:, None] * jnp.where(below, a[k, :], 0.0)[None, :]
    at_k = idx == k
    a = jnp.where(at_k[:, None] & at_k[None, :], pivot, a)
    a = jnp.where(below[:, None] & at_k[None, :], col[:, None], a)
    return a, jnp.where(at_k, sk, s)

  return jax.lax.fori_loop(0, r, step, (a.astype(f32), jnp.zeros((r,), f32)))


def is_orthonormal(p: jax.Array, tol: float = 1e-3) -> jax.Array:
  """Whether ``p`` (``n x r``) is finite with ``|P^T P - I| < tol`` entrywise: a QR factor
  that float32 resolved (a rank-deficient operand gives non-finite or collapsed columns
  in :func:`cholesky_qr`)."""
  gram = matmul(jnp.swapaxes(p, -1, -2), p)
  err = jnp.max(jnp.abs(gram - jnp.eye(p.shape[-1], dtype=gram.dtype)))
  return jnp.isfinite(err) & (err < tol)


def ema(decay, old: jax.Array, new: jax.Array) -> jax.Array:
  """``decay * old + (1 - decay) * new`` in the inputs' dtype, with ``decay`` rounded to
  float32 (or the inputs' wider float) before ``1 - decay`` is formed.

  A Python float and the float32 array that ``optax.inject_hyperparams`` passes for it
  then give bit-identical statistics: in Python, ``1 - 0.95`` is formed in float64 and
  rounded afterwards, one ulp away from float32's ``1 - float32(0.95)``, and an
  eigendecomposition of a statistic with a degenerate spectrum turns one ulp into an
  arbitrary rotation of its eigenvectors."""
  dtype = jnp.result_type(old, new)
  d = jnp.asarray(decay, jnp.promote_types(dtype, f32))
  return (d * old + (1 - d) * new).astype(dtype)


def limit_growth(norm: jax.Array, phi: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
  """Fira's norm-growth limit (paper Eq. "norm-growth limiter"): ``eta = gamma /
  max(norm / phi, gamma)``, ``phi <- eta * norm``, with ``gamma = threshold``. Returns
  ``(eta, new_phi)`` for the current norm and the previous ``phi`` (used by the
  :func:`~fisher_optax.norm_growth_limiter` block and by :func:`~fisher_optax.compensate`).

  A non-finite norm leaves ``phi`` unchanged; with ``phi > 0`` it gives ``eta = 0``
  for ``inf`` and ``eta = NaN`` for NaN (the bad step stays visible); while ``phi = 0``
  there is no reference yet and ``eta = 1``.
  """
  norm = norm.astype(jnp.float32)
  safe_phi = jnp.where(phi > 0, phi, 1.0)
  eta = jnp.where(phi > 0, threshold / jnp.maximum(norm / safe_phi, threshold), 1.0)
  new_phi = eta * norm
  return eta, jnp.where(jnp.isfinite(new_phi), new_phi, phi)


def safe_rsqrt(x: jax.Array) -> jax.Array:
  """``x ** -1/2`` where ``x > 0``, else 0: a zero scale gives a zero (finite) update."""
  pos = x > 0
  return jnp.where(pos, jax.lax.rsqrt(jnp.where(pos, x, 1.0)), 0.0)


def all_finite(x: jax.Array) -> jax.Array:
  return jnp.all(jnp.isfinite(x))


def norm_ratio(coeffs: jax.Array, sigma: jax.Array, kind: str) -> jax.Array:
  """``||coeffs|| / (||sigma|| + 1e-8)`` per column (``channel``, shape ``batch + (1, n)``)
  or per matrix (``tensor``, shape ``batch + (1, 1)``)."""
  axes = (-2,) if kind == "channel" else (-2, -1)
  num = jnp.sqrt(jnp.sum(jnp.square(coeffs), axis=axes, keepdims=True))
  den = jnp.sqrt(jnp.sum(jnp.square(sigma), axis=axes, keepdims=True)) + 1e-8
  return num / den
