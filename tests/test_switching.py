"""Subspace switching (paper Alg. "Subspace switching", Prop. "Subspace switching")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from tests import reference

M, N, R, L = 12, 20, 5, 2


def _setup(seed=0):
  rng = np.random.default_rng(seed)
  g = rng.standard_normal((M, N)).astype(np.float32)
  u_old, _ = np.linalg.qr(rng.standard_normal((M, R)))
  a = rng.standard_normal((R, R))
  q_old = (a @ a.T).astype(np.float32)
  return g, u_old.astype(np.float32), q_old


def _refresh(policy, key, b3=0.9, seed=0):
  g, u_old, q_old = _setup(seed)
  return np.asarray(policy.refresh(jnp.asarray(g), jnp.asarray(u_old), jnp.asarray(q_old), b3,
                                   key), np.float64), (g, u_old, q_old)


def _iteration_span_and_ritz(g, u_old, q_old, b3):
  g, u_old, q_old = (x.astype(np.float64) for x in (g, u_old, q_old))
  q = b3 * u_old @ q_old @ u_old.T + (1 - b3) * g @ g.T
  u1, _ = np.linalg.qr(q @ u_old)
  _, v = reference.eig_desc(u1.T @ q @ u1)
  return u1, u1 @ v


def test_orthonormal_leading_span_and_complement():
  key = jax.random.PRNGKey(3)
  u, (g, u_old, q_old) = _refresh(fo.switch(leading=L), key)
  np.testing.assert_allclose(u.T @ u, np.eye(R), atol=1e-5)
  u1, ritz = _iteration_span_and_ritz(g, u_old, q_old, 0.9)
  # leading columns span the top-L Ritz vectors
  proj = ritz[:, :L] @ ritz[:, :L].T
  np.testing.assert_allclose(proj @ u[:, :L], u[:, :L], atol=1e-4)
  # the other columns are orthogonal to the subspace-iteration span
  np.testing.assert_allclose(u1.T @ u[:, L:], 0.0, atol=1e-5)


def test_reproducible_from_seed_and_different_across_seeds():
  a, _ = _refresh(fo.switch(leading=L), jax.random.PRNGKey(0))
  b, _ = _refresh(fo.switch(leading=L), jax.random.PRNGKey(0))
  c, _ = _refresh(fo.switch(leading=L), jax.random.PRNGKey(1))
  np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(a[:, :L], c[:, :L], atol=1e-6)
  assert not np.allclose(a[:, L:], c[:, L:], atol=1e-3)


def test_seed_changes_alice_run_and_is_replayable():
  rng = np.random.default_rng(0)
  grads = [jnp.asarray(rng.standard_normal((10, 16)), jnp.float32) for _ in range(5)]

  def run(seed):
    tx = fo.alice(0.01, rank=4, leading=1, interval=2, seed=seed)
    p = {"w": jnp.zeros((10, 16))}
    s = tx.init(p)
    for g in grads:
      u, s = jax.jit(tx.update)({"w": g}, s, p)
    return np.asarray(u["w"])

  np.testing.assert_array_equal(run(0), run(0))
  assert not np.allclose(run(0), run(1))


def test_no_switching_keeps_full_ritz_basis():
  u, (g, u_old, q_old) = _refresh(fo.switch(leading=None), None)
  _, ritz = _iteration_span_and_ritz(g, u_old, q_old, 0.9)
  np.testing.assert_allclose(np.abs(u.T @ ritz), np.eye(R), atol=1e-4)


def test_complement_too_small_fills_with_next_ritz_vectors():
  """rank close to m: m - r < r - l, so the missing columns are the next Ritz vectors."""
  rng = np.random.default_rng(5)
  m, r, l = 6, 5, 1
  g = rng.standard_normal((m, 9)).astype(np.float32)
  u_old, _ = np.linalg.qr(rng.standard_normal((m, r)))
  pol = fo.switch(leading=l)
  u = np.asarray(pol.refresh(jnp.asarray(g), jnp.asarray(u_old, jnp.float32), None, 0.0,
                             jax.random.PRNGKey(0)), np.float64)
  q = g.astype(np.float64) @ g.T.astype(np.float64)
  u1, _ = np.linalg.qr(q @ u_old)
  _, v = reference.eig_desc(u1.T @ q @ u1)
  ritz = u1 @ v
  # 1 complement column available -> l + (r - l - 1) = 4 Ritz vectors, then 1 complement column
  np.testing.assert_allclose(np.abs(np.sum(u[:, :4] * ritz[:, :4], 0)), 1.0, atol=1e-4)
  np.testing.assert_allclose(u1.T @ u[:, 4], 0.0, atol=1e-5)


def test_invalid_leading():
  with pytest.raises(ValueError, match="leading"):
    fo.switch(leading=-1)
  with pytest.raises(ValueError, match="leading"):
    fo.alice(0.01, rank=8, leading=9)


def test_complement_draws_are_uniform_distinct_and_change_per_refresh():
  """``refresh_noise`` + ``complement_indices`` (the rule the tracker follows): k distinct
  indices, every index equally likely, and a different draw at every refresh count."""
  from fisher_optax import refresh as switching
  key, n, k, draws = jax.random.PRNGKey(0), 10, 3, 4000
  words = switching.refresh_noise(key, jnp.int32(7), draws, n)
  assert words.shape == (draws, n) and words.dtype == jnp.uint32
  idx = np.asarray(jax.vmap(lambda w: switching.complement_indices(w, k))(words))
  assert all(len(set(row)) == k for row in idx) and idx.min() >= 0 and idx.max() < n
  freq = np.bincount(idx.ravel(), minlength=n) / (draws * k)
  np.testing.assert_allclose(freq, 1.0 / n, atol=0.015)  # ~5 standard deviations
  other = switching.refresh_noise(key, jnp.int32(8), draws, n)
  assert not np.array_equal(np.asarray(words), np.asarray(other))


@pytest.mark.parametrize("r", [3, 5, pytest.param(7, marks=pytest.mark.slow)])
def test_a_tall_gradient_is_read_as_itself_and_gives_the_gram_s_bases(r):
  """``m > n`` (alice_soap's right basis of a vocabulary-sized side): the operand is
  ``G``, not the ``m x m`` Gram; the first basis (thin SVD, completed by the complement
  of ``G``'s column span when ``r > n``) spans the top eigenvectors of ``G G^T``
  (float64 eigh), and a later refresh equals the one read from the Gram."""
  m, n = 12, 5
  rng = np.random.default_rng(4)
  g = (rng.standard_normal((m, n)) * np.linspace(3.0, 0.5, n)).astype(np.float32)
  pol = fo.switch(leading=None)
  x = pol.operand(jnp.asarray(g))
  assert x.shape == (m, n)
  u = np.asarray(pol.first(jnp.asarray(g), r), np.float64)
  np.testing.assert_allclose(u.T @ u, np.eye(r), atol=1e-5)
  w, v = reference.eig_desc(g.astype(np.float64) @ g.T.astype(np.float64))
  k = min(r, n)
  # the top-k eigenvectors, each up to sign (canonical signs on both sides)
  np.testing.assert_allclose(np.abs(u[:, :k].T @ v[:, :k]), np.eye(k), atol=1e-4)
  if r > n:  # the completion lies in the null space of G^T
    np.testing.assert_allclose(g.T.astype(np.float64) @ u[:, n:], 0.0, atol=1e-4)
  # the Gram in float32 (numpy): a jnp product here would run at JAX's default precision,
  # TensorFloat-32 on NVIDIA GPUs, and move the eigenvectors by ~2e-4
  gram = jnp.asarray(g @ g.T)
  np.testing.assert_allclose(np.asarray(pol.first_from(gram, r))[:, :k], u[:, :k], atol=1e-4)

  u_old, _ = np.linalg.qr(rng.standard_normal((m, r)))
  a = rng.standard_normal((r, r))
  args = (jnp.asarray(u_old, jnp.float32), jnp.asarray(a @ a.T, jnp.float32), 0.9, None)
  from_g = np.asarray(pol.refresh_from(x, *args))
  from_gram = np.asarray(pol.refresh_from(gram, *args))
  np.testing.assert_allclose(from_g, from_gram, atol=1e-4)


def test_complement_columns_are_the_complete_qr_columns_without_forming_q():
  """``linalg.complement_columns(u, cols)`` = columns ``r + cols`` of the complete
  Householder QR of ``u`` (what the switching draw samples from), orthonormal and
  orthogonal to span(u); ``jax.jit`` and ``jax.vmap`` (the batched refresh) agree."""
  rng = np.random.default_rng(5)
  u, _ = np.linalg.qr(rng.standard_normal((30, 6)))
  u = jnp.asarray(u, jnp.float32)
  cols = jnp.asarray([17, 0, 23, 5])
  q, _ = jnp.linalg.qr(u, mode="complete")
  got = fo.linalg.complement_columns(u, cols)
  np.testing.assert_allclose(got, q[:, 6 + cols], atol=1e-6)
  np.testing.assert_allclose(np.asarray(got).T @ np.asarray(got), np.eye(4), atol=1e-5)
  np.testing.assert_allclose(np.asarray(u).T @ np.asarray(got), 0.0, atol=1e-5)
  jitted = jax.jit(fo.linalg.complement_columns)(u, cols)
  batched = jax.vmap(fo.linalg.complement_columns)(u[None], cols[None])[0]
  np.testing.assert_allclose(jitted, got, atol=1e-6)
  np.testing.assert_allclose(batched, got, atol=1e-6)


@pytest.mark.parametrize("m,r,kind", [pytest.param(40, 12, "random", marks=pytest.mark.slow),
                                      (9, 8, "random"), (7, 1, "random"),
                                      pytest.param(512, 128, "random", marks=pytest.mark.slow),
                                      (10, 4, "unit"),
                                      (10, 4, "negated unit"), (12, 5, "zero pivot")])
def test_complement_by_householder_reconstruction_equals_lapacks_qr(m, r, kind):
  """The reconstructed reflectors give LAPACK's complete-QR columns (float64 ``geqrf``
  through NumPy), including the cases where Householder QR takes no reflection (a
  column that is already +-e_k: ``tau = 0``) and a zero pivot (``sign(0)`` taken as +1,
  as LAPACK's ``dlarfg`` does)."""
  rng = np.random.default_rng(m * 100 + r)
  if kind == "random":
    u = np.linalg.qr(rng.standard_normal((m, r)))[0]
  elif kind in ("unit", "negated unit"):
    u = np.eye(m)[:, :r] * (1.0 if kind == "unit" else -1.0)
  else:  # the first pivot is exactly 0: the first column has no component along e_1
    u = np.linalg.qr(np.concatenate([np.zeros((1, r)), rng.standard_normal((m - 1, r))]))[0]
    assert u[0, 0] == 0.0
  q = np.linalg.qr(u, mode="complete")[0]
  cols = np.arange(m - r)
  got = np.asarray(fo.linalg.complement_columns(jnp.asarray(u, jnp.float32), jnp.asarray(cols)))
  np.testing.assert_allclose(got, q[:, r:], atol=2e-6 * np.sqrt(m))
  np.testing.assert_allclose(got.T @ got, np.eye(m - r), atol=2e-6 * np.sqrt(m))
  np.testing.assert_allclose(u.T @ got, 0.0, atol=2e-6 * np.sqrt(m))


def test_complement_of_a_full_basis_is_empty():
  u = jnp.eye(5)
  assert fo.linalg.complement_columns(u, jnp.arange(0)).shape == (5, 0)


def test_complement_of_a_bfloat16_or_non_finite_basis():
  """A bfloat16 basis is read in float32 (the float32 result of the rounded basis); a
  non-finite basis gives non-finite columns, which the refresh's guard replaces by the
  previous basis (``tests/test_refresh.py``), never finite garbage."""
  u = jnp.asarray(np.linalg.qr(np.random.default_rng(1).standard_normal((12, 4)))[0],
                  jnp.bfloat16)
  cols = jnp.arange(5)
  got = fo.linalg.complement_columns(u, cols)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, fo.linalg.complement_columns(u.astype(jnp.float32), cols))
  bad = u.astype(jnp.float32).at[3, 1].set(jnp.nan)
  assert not np.isfinite(np.asarray(fo.linalg.complement_columns(bad, cols))).all()


def test_switching_refresh_of_a_tall_gradient_against_float64():
  """``m > n`` with switching: the leading columns span the top Ritz vectors of the
  float64 subspace iteration on ``Q = b3 U Q~ U^T + (1 - b3) G G^T`` (formed densely
  here), the drawn columns are orthonormal and orthogonal to that iteration's span --
  read from ``G`` itself, never from an ``m x m`` matrix."""
  m, n, r, lead = 14, 5, 4, 2
  rng = np.random.default_rng(6)
  g = (rng.standard_normal((m, n)) * np.linspace(3.0, 0.5, n)).astype(np.float32)
  u_old, _ = np.linalg.qr(rng.standard_normal((m, r)))
  a = rng.standard_normal((r, r))
  q_old = (a @ a.T).astype(np.float32)
  pol = fo.switch(leading=lead)
  u = np.asarray(pol.refresh(jnp.asarray(g), jnp.asarray(u_old, jnp.float32),
                             jnp.asarray(q_old), 0.9, jax.random.PRNGKey(2)), np.float64)
  np.testing.assert_allclose(u.T @ u, np.eye(r), atol=1e-5)
  u1, ritz = _iteration_span_and_ritz(g, u_old.astype(np.float32), q_old, 0.9)
  proj = ritz[:, :lead] @ ritz[:, :lead].T
  np.testing.assert_allclose(proj @ u[:, :lead], u[:, :lead], atol=1e-4)
  np.testing.assert_allclose(u1.T @ u[:, lead:], 0.0, atol=1e-5)


def test_basis_from_is_the_first_refresh_at_step_one_and_the_switching_refresh_after():
  """The tracker's single refresh branch: ``basis_from(..., first)`` is ``first_from`` when
  ``first`` and ``refresh_from`` otherwise, under ``jit`` and ``vmap`` (the GPU path)."""
  from fisher_optax import refresh as switching
  pol = fo.switch(leading=1)
  m, n, r, b = 6, 9, 3, 4
  g = jax.random.normal(jax.random.PRNGKey(0), (b, m, n))
  c = jax.vmap(pol.operand)(g)
  u_old = jax.vmap(lambda x: pol.first_from(x, r))(c)
  q_old = jnp.broadcast_to(jnp.eye(r), (b, r, r))
  noise = switching.refresh_noise(jax.random.PRNGKey(1), jnp.int32(4), b, m - r)
  for first in (True, False):
    got = jax.jit(jax.vmap(lambda x, u, q, w: pol.basis_from(x, u, q, 0.9, w,
                                                             jnp.bool_(first))))(
        c, u_old, q_old, noise)
    want = (jax.vmap(lambda x: pol.first_from(x, r))(c) if first else
            jax.vmap(lambda *a: pol.refresh_from(a[0], a[1], a[2], 0.9, a[3]))(
                c, u_old, q_old, noise))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
  svd = fo.svd_refresh()
  np.testing.assert_allclose(np.asarray(svd.basis_from(g[0], u_old[0], None, 0.0, None, False)),
                             np.asarray(svd.first_from(g[0], r)), atol=1e-6)


def test_random_words_of_chosen_matrices_and_widths_are_the_starts_of_the_widest_rows():
  """``rng.words`` for some matrices at a smaller width (a tracker draws per width, each
  matrix's row as long as it reads) gives the starts of those matrices' rows at the
  widest: the same words as one draw at the widest width for every matrix."""
  from fisher_optax import rng
  key, count = jax.random.PRNGKey(5), jnp.int32(3)
  widest = rng.words(key, count, 10, 40)
  some = rng.words(key, count, 3, 7, rows=jnp.asarray([4, 7, 9], jnp.uint32))
  np.testing.assert_array_equal(np.asarray(some), np.asarray(widest)[[4, 7, 9], :7])
