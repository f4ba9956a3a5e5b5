"""NorMuon's blocks on their own -- ``scale_by_row_moments`` (one second moment per
neuron) and ``scale_to_rms`` -- and composed: ``fo.normuon``'s properties, and the two
compositions of RACS's two-sided scaling with whitening (before and after it)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo

M, N = 6, 10


def _grads(steps, shape=(M, N), seed=0):
  keys = jax.random.split(jax.random.key(seed), steps)
  scales = jnp.linspace(0.1, 3.0, shape[-1])  # unequal columns: the scaling matters
  return [jax.random.normal(k, shape) * scales for k in keys]


@pytest.mark.parametrize("unit,axis", [("fan_out", 0), ("fan_in", 1)])
def test_row_moments_follow_their_equation_over_steps(unit, axis):
  """``v <- b2 v + (1 - b2) mean(O * O over the other side)``, ``out = O / (sqrt(v) + eps)``
  in float64 over four steps; the state holds one number per unit."""
  b2, eps = 0.9, 1e-8
  tx = fo.scale_by_row_moments(b2=b2, eps=eps, unit=unit)
  params = {"w": jnp.zeros((M, N))}
  state = tx.init(params)
  assert state.nu["w"].shape == ((N,) if unit == "fan_out" else (M,))
  v = np.zeros(N if unit == "fan_out" else M)
  for g in _grads(4):
    out, state = tx.update({"w": g}, state)
    o = np.asarray(g, np.float64)
    v = b2 * v + (1 - b2) * np.mean(o ** 2, axis=axis)
    scale = 1 / (np.sqrt(v) + eps)
    want = o * (scale[None, :] if axis == 0 else scale[:, None])
    np.testing.assert_allclose(out["w"], want, rtol=2e-6)
    np.testing.assert_allclose(state.nu["w"], v, rtol=2e-6)


def test_row_moments_with_b2_zero_give_every_unit_the_same_norm():
  tx = fo.scale_by_row_moments(b2=0.0, eps=0.0)
  out, _ = tx.update({"w": _grads(1)[0]}, tx.init({"w": jnp.zeros((M, N))}))
  np.testing.assert_allclose(jnp.linalg.norm(out["w"], axis=0), np.sqrt(M), rtol=1e-5)


def test_row_moments_read_the_fan_out_side_of_an_out_in_weight():
  """With ``dims`` naming an ``(out, in)`` layout, the units are its rows (the same
  neurons as the columns of the ``(in, out)`` transpose)."""
  g = _grads(2)
  a = fo.scale_by_row_moments()
  b = fo.scale_by_row_moments(dims=fo.MatrixDims(rows=-1, cols=-2))
  sa, sb = a.init({"w": jnp.zeros((M, N))}), b.init({"w": jnp.zeros((N, M))})
  for x in g:
    ua, sa = a.update({"w": x}, sa)
    ub, sb = b.update({"w": x.T}, sb)
    np.testing.assert_allclose(ub["w"], ua["w"].T, rtol=1e-6)


def test_scale_to_rms():
  tx = fo.scale_to_rms(0.2)
  g = {"w": _grads(1)[0], "z": jnp.zeros((3, 4)), "s": jnp.ones((2, 3, 4)) * jnp.arange(2.)[:, None, None]}
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(out["w"] ** 2)), 0.2, rtol=1e-6)
  np.testing.assert_array_equal(out["z"], 0.0)                          # zero stays zero
  np.testing.assert_array_equal(out["s"][0], 0.0)                       # per matrix of a stack
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(out["s"][1] ** 2)), 0.2, rtol=1e-6)
  bad, _ = tx.update({"w": g["w"].at[0, 0].set(jnp.nan)}, None)
  assert jnp.isnan(bad["w"]).all()                                       # visible
  with pytest.raises(ValueError, match="rms"):
    fo.scale_to_rms(0.0)


def test_normuon_update_rms_and_equal_neurons_with_b2_zero():
  """The update's RMS is ``0.2 * lr`` on every matrix; with ``b2 = 0`` every output unit
  (fan-out column of an ``(in, out)`` kernel) gets the same norm."""
  lr = 0.03
  params = {"w": jnp.zeros((M, N)), "tall": jnp.zeros((N, M))}
  tx = fo.normuon(lr, b2=0.0, eps=0.0)
  state = tx.init(params)
  for t, g in enumerate(_grads(3)):
    u, state = tx.update({"w": g, "tall": g.T * 2.0}, state, params)
    for k in ("w", "tall"):
      np.testing.assert_allclose(jnp.sqrt(jnp.mean(u[k] ** 2)), 0.2 * lr, rtol=1e-5)
      norms = jnp.linalg.norm(u[k], axis=0)
      np.testing.assert_allclose(norms, norms[0], rtol=1e-4)
  # with b2 > 0 the neurons' norms differ (the EMA lags the current update)
  tx = fo.normuon(lr)
  state = tx.init(params)
  for g in _grads(3):
    u, state = tx.update({"w": g, "tall": g.T}, state, params)
  norms = jnp.linalg.norm(u["w"], axis=0)
  assert float(jnp.max(norms) / jnp.min(norms)) > 1.01


def test_normuon_state_in_describe_and_memory():
  params = {"w": jnp.zeros((16, 40)), "b": jnp.zeros(40)}
  desc = fo.describe(fo.normuon(1e-2), params)
  row = {r.path: r for r in desc.rows}["w"]
  formula, _ = fo.paper_state_numbers("normuon", 16, 40)
  assert row.rule == "normuon" and row.state_numbers == formula == 16 * 40 + 40


def _racs_then_whiten(lr):
  return optax.chain(fo.scale_by_momentum(0.95), fo.scale_by_two_sided(beta=0.9),
                     fo.whiten(), fo.scale_to_rms(0.2), optax.scale_by_learning_rate(lr))


def _whiten_then_racs(lr):
  return optax.chain(fo.scale_by_momentum(0.95), fo.whiten(),
                     fo.scale_by_two_sided(beta=0.9), fo.scale_to_rms(0.2),
                     optax.scale_by_learning_rate(lr))


@pytest.mark.parametrize("shape", [(M, N), (N, M)], ids=str)
@pytest.mark.parametrize("make,order", [(_racs_then_whiten, "before"),
                                        (_whiten_then_racs, "after")])
def test_compositions_match_dense_float64_re_derivations(make, order, shape):
  """Six steps of each composition against :class:`tests.reference.WhiteningCompositionRef`
  (float64: the momentum, RACS's fixed point and EMA, Newton--Schulz on the smaller side,
  the RMS), on a wide and a tall matrix."""
  from tests import reference
  lr = 0.01
  tx = make(lr)
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  ref = reference.WhiteningCompositionRef(*shape, lr=lr, order=order)
  for t, g in enumerate(_grads(6, shape, seed=4), start=1):
    u, state = jax.jit(tx.update)({"w": g}, state, params)
    want = ref.step(np.asarray(g, np.float64))
    err = np.linalg.norm(np.asarray(u["w"], np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-4, f"{order} step {t}: relative error {err:.2e}"


@pytest.mark.parametrize("make", [_racs_then_whiten, _whiten_then_racs])
def test_two_sided_scaling_composed_with_whitening(make):
  """The compositions of the docs' "compose your own" section: each matrix update has
  RMS ``0.2 * lr``; the two-sided scaling after whitening equilibrates the whitened
  update's rows and columns (RACS's fixed point of ``O * O``), before whitening those of
  the momentum. State: the momentum and ``m + n`` scales per matrix."""
  lr = 0.01
  params = {"w": jnp.zeros((M, N))}
  tx = make(lr)
  state = tx.init(params)
  assert fo.state_numbers(state) == M * N + M + N + 1  # + the momentum's counter
  for g in _grads(3):
    u, state = jax.jit(tx.update)({"w": g}, state, params)
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(u["w"] ** 2)), 0.2 * lr, rtol=1e-5)
  assert not np.allclose(u["w"], fo.normuon(lr).update({"w": g}, fo.normuon(lr).init(params),
                                                        params)[0]["w"])


def test_normuon_is_its_chain_of_blocks_on_matrices():
  lr = 0.01
  params = {"w": jnp.zeros((M, N))}
  chain = optax.chain(fo.scale_by_momentum(0.95), fo.whiten(),
                      fo.scale_by_row_moments(b2=0.95), fo.scale_to_rms(0.2),
                      optax.scale_by_learning_rate(lr))
  named = fo.normuon(lr, stack_matrices=False)
  sc, sn = chain.init(params), named.init(params)
  for g in _grads(4):
    uc, sc = chain.update({"w": g}, sc, params)
    un, sn = named.update({"w": g}, sn, params)
    np.testing.assert_array_equal(uc["w"], un["w"])


def test_normuon_state_on_the_llama_example_matches_its_formula():
  """``benchmarks/memory.py``'s trees: on the example LLaMA (``tiny``), every matrix
  NorMuon receives holds ``fan_in * fan_out + fan_out`` numbers, as ``describe`` and
  ``paper_state_numbers`` say; the state total adds the fallback's Adam."""
  from flax import nnx
  from examples.llama import presets
  from examples.llama.model import Llama
  cfg = presets.model_config("tiny")
  params = nnx.state(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))), nnx.Param)
  tx = presets.make_optimizer("normuon", "tiny", 1e-3)
  rows = fo.describe(tx, params).rows
  routed = [r for r in rows if r.rule == "normuon"]
  assert routed and all("embed" not in r.path and "lm_head" not in r.path for r in routed)
  for r in routed:
    fan_in, fan_out = (int(x) for x in r.view.split(" x ")[-2:])
    batch = int(np.prod([int(x) for x in r.view.split(" x ")[:-2]] or [1]))
    assert r.state_numbers == batch * fo.paper_state_numbers("normuon", fan_in, fan_out)[0]
  state = jax.eval_shape(tx.init, params)
  assert fo.state_numbers(state) == sum(r.state_numbers for r in rows) + 2  # two counters


@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e30])
def test_scale_to_rms_is_scale_free_and_keeps_zero(scale):
  """Entries of 1e-30 or 1e30 neither underflow nor overflow in the norm: the RMS is
  still ``rms``; an all-zero matrix stays zero."""
  tx = fo.scale_to_rms(0.2)
  g = {"w": _grads(1)[0] * scale}
  out, _ = tx.update(g, tx.init(g))
  want = 0.0 if scale == 0 else 0.2
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(out["w"] ** 2)), want, rtol=1e-5)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=pytest.mark.slow), jnp.float32])
def test_new_blocks_on_bad_inputs_and_odd_shapes(dtype):
  """Zero and NaN entries, bfloat16, a 1 x n matrix and a stack: outputs keep the input
  dtype, zeros stay zero, a NaN entry stays visible in its matrix; the new block's own
  state stays finite (NorMuon's momentum, like Muon's and Adam's, takes the NaN in:
  ``optax.apply_if_finite`` skips such a step, ``tests/test_robustness.py``)."""
  for tx in (fo.scale_by_row_moments(), fo.scale_to_rms(0.2),
             fo.normuon(1e-2, dims=fo.MatrixDims())):
    params = {"w": jnp.zeros((4, 6), dtype), "row": jnp.zeros((1, 6), dtype),
              "stack": jnp.zeros((2, 3, 5), dtype)}
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    out, state = tx.update(zeros, state, params)
    for k in params:
      assert out[k].dtype == dtype
      np.testing.assert_array_equal(out[k], 0.0)
    bad = {"w": jnp.ones((4, 6), dtype).at[1, 2].set(jnp.nan),
           "row": jnp.ones((1, 6), dtype).at[0, 0].set(jnp.nan),
           "stack": jnp.ones((2, 3, 5), dtype)}
    out, state = tx.update(bad, state, params)
    assert jnp.isnan(out["w"]).any() and jnp.isnan(out["row"]).any()
    assert jnp.isfinite(out["stack"]).all()
    if isinstance(state, fo.ScaleByRowMomentsState):
      assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state))
