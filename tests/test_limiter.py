"""Norm-growth limiter (Fira; paper Alg. "RACS" l.9-10)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo


def test_growth_bounded_by_threshold_and_first_step_untouched():
  tx = fo.norm_growth_limiter(1.01)
  params = {"w": jnp.zeros((2, 3, 4)), "b": jnp.zeros(3)}
  state = tx.init(params)
  assert state.phi["w"].shape == (2,) and state.phi["b"].shape == ()
  x = {"w": jnp.ones((2, 3, 4)), "b": jnp.ones(3)}
  out, state = tx.update(x, state)
  np.testing.assert_allclose(out["w"], x["w"])  # eta = 1 while phi = 0
  prev = np.linalg.norm(np.asarray(out["w"]).reshape(2, -1), axis=1)
  for k in range(1, 5):
    big = {"w": x["w"] * jnp.array([10.0 ** k, 1.0])[:, None, None], "b": x["b"] * 100}
    out, state = tx.update(big, state)
    norms = np.linalg.norm(np.asarray(out["w"]).reshape(2, -1), axis=1)
    assert norms[0] <= 1.01 * prev[0] * (1 + 1e-6)
    np.testing.assert_allclose(norms[1], prev[1], rtol=1e-6)  # no growth -> untouched
    prev = norms
  assert float(jnp.linalg.norm(out["b"])) <= 1.01 ** 4 * np.sqrt(3) * (1 + 1e-5)


def test_shrinking_updates_pass_unchanged():
  tx = fo.norm_growth_limiter(1.01)
  state = tx.init({"w": jnp.zeros((3, 3))})
  _, state = tx.update({"w": jnp.ones((3, 3))}, state)
  out, state = tx.update({"w": 0.5 * jnp.ones((3, 3))}, state)
  np.testing.assert_allclose(out["w"], 0.5)
  np.testing.assert_allclose(state.phi["w"], 1.5)


def test_zero_first_steps_do_not_freeze():
  tx = fo.norm_growth_limiter(1.01)
  state = tx.init({"w": jnp.zeros((3, 3))})
  out, state = tx.update({"w": jnp.zeros((3, 3))}, state)
  out, state = tx.update({"w": jnp.ones((3, 3))}, state)
  np.testing.assert_allclose(out["w"], 1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_invalid_limiter(bad):
  with pytest.raises(ValueError, match="limiter"):
    fo.norm_growth_limiter(bad)
