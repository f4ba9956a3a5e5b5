"""RACS two-sided scaling (paper Prop. "Two-sided scaling")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from fisher_optax.blocks.two_sided import two_sided_fixed_point


def test_fixed_point_is_principal_singular_pair_of_g_squared():
  g = np.random.default_rng(0).standard_normal((7, 11)).astype(np.float32)
  s, q = two_sided_fixed_point(jnp.asarray(g), iters=200)
  u, sv, vt = np.linalg.svd(g.astype(np.float64) ** 2)
  s, q = np.asarray(s, np.float64), np.asarray(q, np.float64)
  np.testing.assert_allclose(s / np.linalg.norm(s), np.abs(vt[0]), atol=1e-5)
  np.testing.assert_allclose(q / np.linalg.norm(q), np.abs(u[:, 0]), atol=1e-5)
  # at the fixed point ||s|| ||q|| = sigma_1(P) since P ~ sigma_1 u v^T gives s = sigma1 v / ||q||...
  np.testing.assert_allclose(q @ (g.astype(np.float64) ** 2) @ s / (q @ q) / (s @ s), 1.0,
                             rtol=1e-4)


def _run(tx, grads, shape, dtype=jnp.float32):
  params = {"w": jnp.zeros(shape, dtype)}
  state = tx.init(params)
  upd = jax.jit(tx.update)
  outs = []
  for g in grads:
    u, state = upd({"w": jnp.asarray(g, dtype)}, state, params)
    outs.append(u["w"])
  return outs, state


@pytest.mark.parametrize("scale", [1e-15, 1e-8, 1e-3, 1e3, 1e8, 1e15])
def test_update_invariant_to_gradient_scale(scale):
  rng = np.random.default_rng(1)
  grads = [rng.standard_normal((8, 12)).astype(np.float32) for _ in range(4)]
  tx = fo.racs(0.02)
  base, _ = _run(tx, grads, (8, 12))
  scaled, _ = _run(tx, [g * scale for g in grads], (8, 12))
  for a, b in zip(base, scaled):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-9)


def test_zero_rows_columns_and_gradients_give_finite_zero_updates():
  g = np.random.default_rng(2).standard_normal((6, 9)).astype(np.float32)
  g[2, :] = 0
  g[:, 4] = 0
  tx = fo.scale_by_two_sided()
  outs, state = _run(tx, [g, g, np.zeros_like(g), g], (6, 9))
  for o in outs:
    o = np.asarray(o)
    assert np.all(np.isfinite(o))
    assert np.all(o[2, :] == 0) and np.all(o[:, 4] == 0)
  assert np.all(np.asarray(outs[2]) == 0)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state))


def test_first_step_is_scaled_gradient_with_ema_weights():
  """t = 1: s_1 = (1-beta) s, q_1 = (1-beta) q  =>  G~ = G / ((1-beta) sqrt(q s))."""
  g = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
  (out,), _ = _run(fo.scale_by_two_sided(beta=0.9, iters=5), [g], (5, 7))
  s, q = two_sided_fixed_point(jnp.asarray(g), 5)
  expect = g / (0.1 * np.sqrt(np.outer(np.asarray(q), np.asarray(s))))
  np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5)


def test_bf16_in_bf16_out_and_float32_state():
  g = np.random.default_rng(4).standard_normal((2, 6, 8))
  outs, state = _run(fo.scale_by_two_sided(), [g, g], (2, 6, 8), dtype=jnp.bfloat16)
  assert outs[-1].dtype == jnp.bfloat16
  assert state.s["w"].dtype == jnp.float32 and state.s["w"].shape == (2, 8)
  assert state.q["w"].shape == (2, 6)


def test_rejects_vectors_with_clear_error():
  with pytest.raises(ValueError, match="matrices"):
    fo.scale_by_two_sided().init({"b": jnp.zeros(5)})


@pytest.mark.parametrize("kw", [dict(beta=1.0), dict(beta=-0.1), dict(iters=0), dict(eps=-1.0)])
def test_invalid_settings(kw):
  with pytest.raises(ValueError, match=list(kw)[0]):
    fo.scale_by_two_sided(**kw)
