"""GaLore's refresh without an SVD (``fo.subspace_refresh``): how much of the exact top-r
energy it captures, on the spectra the paper's gradients and the degenerate cases give,
from a cold start and warm-started from an unrelated basis; scale invariance; and the
Cholesky QR underneath it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from fisher_optax import linalg

M, N, R = 64, 160, 16


def spectrum(kind):
  i = np.arange(1, M + 1, dtype=np.float64)
  return {"exponential": 0.9 ** i,
          "polynomial": 1.0 / i,
          "flat_top_inside_r": 1.0 / np.maximum(i - R // 2 + 1, 1.0),
          "flat_top_beyond_r": np.where(i <= 2 * R, 1.0, 0.05 / i),
          "rank_deficient": np.where(i <= R // 2, 1.0 / i, 0.0),
          "zero": np.zeros(M)}[kind]


def gradient(kind, seed=0):
  rng = np.random.default_rng(seed)
  u = np.linalg.qr(rng.standard_normal((M, M)))[0]
  v = np.linalg.qr(rng.standard_normal((N, M)))[0]
  return ((u * spectrum(kind)) @ v.T).astype(np.float32)


def energy(u, g):
  return float(np.sum((np.asarray(u, np.float64).T @ g.astype(np.float64)) ** 2))


def exact_energy(g):
  s = np.linalg.svd(g.astype(np.float64), compute_uv=False)
  return float(np.sum(s[:R] ** 2))


def starts():
  """The bases a refresh starts from: none (the first refresh), a random orthonormal
  basis and the exact basis of an unrelated gradient with the same spectrum."""
  rng = np.random.default_rng(7)
  unrelated = np.linalg.svd(gradient("polynomial", seed=11))[0][:, :R]
  return {"first": None,
          "random": np.linalg.qr(rng.standard_normal((M, R)))[0].astype(np.float32),
          "unrelated": unrelated.astype(np.float32)}


def refresh(pol, g, u_old):
  g = jnp.asarray(g)
  if u_old is None:
    return np.asarray(jax.jit(lambda g: pol.first(g, R))(g))
  return np.asarray(jax.jit(lambda g, u: pol.refresh(g, u, None, 0.0, None))(g, u_old))


KINDS = ["exponential", "polynomial", "flat_top_inside_r", "flat_top_beyond_r",
         "rank_deficient", "zero"]


@pytest.mark.parametrize("start", ["first", "random",
                                   pytest.param("unrelated", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", KINDS)
def test_captures_the_exact_top_r_energy(kind, start):
  g = gradient(kind)
  u = refresh(fo.subspace_refresh(), g, starts()[start])
  assert u.shape == (M, R) and np.all(np.isfinite(u))
  np.testing.assert_allclose(u.T @ u, np.eye(R), atol=2e-5)
  exact = exact_energy(g)
  if exact == 0.0:
    assert energy(u, g) == 0.0
  else:
    assert energy(u, g) >= 0.99 * exact, (energy(u, g) / exact)


@pytest.mark.parametrize("scale", [1e-30, pytest.param(1e-8, marks=pytest.mark.slow),
                                   pytest.param(1e8, marks=pytest.mark.slow), 1e30])
def test_basis_does_not_depend_on_the_gradient_scale(scale):
  """``1e30 * G`` squares to 1e60 (float32 overflows at 3.4e38) and ``1e-30 * G`` to
  1e-60: the refresh reads ``G / max|G|``."""
  g = gradient("polynomial")
  pol = fo.subspace_refresh()
  for u_old in (None, starts()["random"]):
    ref = refresh(pol, g, u_old)
    np.testing.assert_allclose(refresh(pol, (g * np.float32(scale)), u_old), ref, atol=1e-5)


def test_a_non_finite_gradient_keeps_the_previous_basis():
  """Through ``low_rank_track``: a refresh on a NaN gradient keeps the previous basis."""
  tx = fo.low_rank_track(rank=R, interval=1, refresh=fo.subspace_refresh())
  p = {"w": jnp.zeros((M, N))}
  state = tx.init(p)
  _, state = tx.update({"w": jnp.asarray(gradient("polynomial"))}, state)
  before = np.asarray(state.basis["w"])
  _, state = tx.update({"w": jnp.full((M, N), jnp.nan)}, state)
  np.testing.assert_array_equal(np.asarray(state.basis["w"]), before)


def test_the_exact_svd_stays_available_and_agrees_on_a_decaying_spectrum():
  """``svd_refresh`` (the release's SVD) and ``subspace_refresh`` span the same subspace
  when the spectrum has a gap at ``r``."""
  g = gradient("exponential")
  u_svd = refresh(fo.svd_refresh(), g, None)
  u_it = refresh(fo.subspace_refresh(iters=4), g, None)
  s = np.linalg.svd(u_svd.T @ u_it, compute_uv=False)
  assert s.min() > 0.99


@pytest.mark.parametrize("cond", [1.0, 1e3, 1e6])
@pytest.mark.parametrize("shape", [(10, 3), (512, 128)])
def test_cholesky_qr_is_orthonormal_and_spans_the_columns(shape, cond):
  m, k = shape
  rng = np.random.default_rng(0)
  u = np.linalg.qr(rng.standard_normal((m, k)))[0]
  v = np.linalg.qr(rng.standard_normal((k, k)))[0]
  h = (u * np.logspace(0, -np.log10(cond), k)) @ v.T * 1e3
  q = np.asarray(linalg.cholesky_qr(jnp.asarray(h, jnp.float32)), np.float64)
  np.testing.assert_allclose(q.T @ q, np.eye(k), atol=5e-6)
  assert np.linalg.norm(q @ (q.T @ h) - h) <= 1e-5 * np.linalg.norm(h)
  # the same span as Householder QR, columns up to sign
  hh = np.asarray(linalg.orthonormalize(jnp.asarray(h, jnp.float32)), np.float64)
  if cond == 1.0:
    np.testing.assert_allclose(np.abs(q.T @ hh), np.eye(k), atol=1e-4)


def test_cholesky_qr_batches_over_leading_axes():
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 20, 5))
  q = linalg.cholesky_qr(x)
  np.testing.assert_allclose(np.einsum("bmi,bmj->bij", q, q), np.broadcast_to(np.eye(5),
                                                                                (3, 5, 5)),
                             atol=2e-6)


@pytest.mark.parametrize("rank", [64, 16, 0])
def test_power_orthonormal_is_the_positive_diagonal_qr_of_the_shifted_step(rank):
  """SOAP's power step ``QR(L U)``: the unique thin QR (positive ``R`` diagonal) of
  ``(L + delta I) U``, defined for a statistic of any rank (0: a zero statistic keeps
  ``U``). The backend's implementation (Householder on CPU) equals Cholesky QR, the
  accelerators', to float32 rounding."""
  d = 64
  rng = np.random.default_rng(rank)
  g = rng.standard_normal((d, rank)).astype(np.float32)
  stat = g @ g.T
  u = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
  y = stat @ u
  q = np.asarray(linalg.power_orthonormal(jnp.asarray(y), jnp.asarray(u)), np.float64)
  np.testing.assert_allclose(q.T @ q, np.eye(d), atol=2e-5)
  norm = np.linalg.norm(y)
  x = y + 1e-6 * norm * u if norm > 0 else u
  r = q.T @ x
  np.testing.assert_allclose(np.tril(r, -1), 0.0, atol=1e-4 * max(np.abs(r).max(), 1.0))
  assert np.all(np.diagonal(r) > 0)
  chol = np.asarray(linalg.cholesky_qr(jnp.asarray(x, jnp.float32)), np.float64)
  k = rank if rank < d else d
  # the columns spanning the statistic's range agree; the others span its null space (set
  # by rounding at condition number ~1e6, so compared as a subspace)
  np.testing.assert_allclose(chol[:, :k], q[:, :k], atol=5e-4)
  if 0 < rank < d:
    np.testing.assert_allclose(g.T @ q[:, rank:], 0.0, atol=1e-3 * np.abs(g).max())
    np.testing.assert_allclose(g.T @ chol[:, rank:], 0.0, atol=1e-3 * np.abs(g).max())
  if rank == 0:
    np.testing.assert_allclose(q, u, atol=1e-5)


@pytest.mark.parametrize("kind,iters,least", [("slow", 2, 0.96), ("slow", 4, 0.99),
                                              ("near_flat", 2, 0.88), ("near_flat", 4, 0.90)])
def test_where_it_captures_less_than_the_exact_energy(kind, iters, least):
  """The documented weaker cases (docs: "Numerics"), warm-started from a random basis:
  singular values ``i^-1/2`` (slow decay through ``r``) and a nearly flat spectrum
  (1 up to ``r + r/8``, then 0.9: a small gap at ``r``)."""
  i = np.arange(1, M + 1, dtype=np.float64)
  s = i ** -0.5 if kind == "slow" else np.where(i <= R + R // 8, 1.0, 0.9)
  rng = np.random.default_rng(0)
  u = np.linalg.qr(rng.standard_normal((M, M)))[0]
  v = np.linalg.qr(rng.standard_normal((N, M)))[0]
  g = ((u * s) @ v.T).astype(np.float32)
  got = energy(refresh(fo.subspace_refresh(iters=iters), g, starts()["random"]), g)
  assert got >= least * float(np.sum(s[:R] ** 2))


def test_galore_refresh_must_be_a_galore_policy():
  with pytest.raises(TypeError, match="subspace_refresh"):
    fo.galore(1e-2, rank=2, refresh=fo.switch(leading=1))
  fo.fira(1e-2, rank=2, refresh=fo.svd_refresh())  # the release's SVD is accepted
