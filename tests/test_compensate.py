"""Compensation (paper Sec. 5.3, Thm. "Optimal compensation") and Fira's variant."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo


def _chain(method, **kw):
  return optax.chain(fo.low_rank_track(rank=3, interval=10),
                     fo.on_coefficients(optax.identity(), rank=3),
                     fo.compensate(method=method, **kw))


@pytest.mark.parametrize("method", ["optimal", "fira"])
def test_compensation_orthogonal_to_span_u(method):
  tx = _chain(method, alpha_c=1.0, limiter=None)
  rng = np.random.default_rng(0)
  p = {"w": jnp.zeros((7, 11))}
  s = tx.init(p)
  for _ in range(3):
    g = jnp.asarray(rng.standard_normal((7, 11)), jnp.float32)
    out, s = tx.update({"w": g}, s)
    u = np.asarray(s[0].basis["w"], np.float64)
    low = u @ u.T @ np.asarray(g, np.float64)
    comp = np.asarray(out["w"], np.float64) - low
    # orthogonal up to float32 rounding, relative to each column's size (the columns are
    # ~6 long at step 1: an absolute 1e-5 was at the edge of a float32 eigenbasis)
    bound = 1e-5 * np.linalg.norm(comp, axis=0)
    np.testing.assert_array_less(np.abs(u.T @ comp), np.broadcast_to(bound, (3, 11)))
    assert np.linalg.norm(comp) > 0.1


def test_optimal_compensation_scale_matches_theorem():
  """One step, b1 = 0: C = sqrt(m - r) R / ||R_j|| columnwise, i.e. every column of C
  has norm sqrt(m - r) (Thm. "Optimal compensation" with a 1-sample expectation)."""
  tx = _chain("optimal", alpha_c=1.0, b1=0.0, limiter=None)
  g = jnp.asarray(np.random.default_rng(1).standard_normal((7, 11)), jnp.float32)
  s = tx.init({"w": g})
  out, s = tx.update({"w": g}, s)
  u = np.asarray(s[0].basis["w"], np.float64)
  comp = np.asarray(out["w"], np.float64) - u @ u.T @ np.asarray(g, np.float64)
  np.testing.assert_allclose(np.linalg.norm(comp, axis=0), np.sqrt(7 - 3), rtol=1e-4)


def test_full_rank_means_no_compensation_and_finite():
  tx = optax.chain(fo.low_rank_track(rank=5), fo.on_coefficients(optax.identity(), rank=5),
                   fo.compensate(alpha_c=1.0))
  g = jnp.asarray(np.random.default_rng(2).standard_normal((5, 8)), jnp.float32)
  out, _ = tx.update({"w": g}, tx.init({"w": g}))
  np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(g), atol=1e-5)


def test_zero_columns_give_zero_compensation():
  g = np.random.default_rng(3).standard_normal((6, 9)).astype(np.float32)
  g[:, 2] = 0
  tx = _chain("optimal", alpha_c=1.0)
  out, _ = tx.update({"w": jnp.asarray(g)}, tx.init({"w": jnp.asarray(g)}))
  assert np.all(np.isfinite(np.asarray(out["w"])))
  np.testing.assert_array_equal(np.asarray(out["w"])[:, 2], 0.0)


def test_invalid_method():
  with pytest.raises(ValueError, match="method"):
    fo.compensate(method="nope")
