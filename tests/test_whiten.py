"""Normalization and whitening blocks, SWAN and Muon by composition (paper Sec. 3.3,
App. "SWAN", "Muon"): against the FIM toolkit's structured optima, dense numpy, and
``optax.contrib.muon``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo
from fisher_optax.fisher import fim


def _apply(tx, g, params=None):
  params = g if params is None else params
  out, _ = tx.update(g, tx.init(params), params)
  return out


def _one_sample(m, n, seed=0):
  return np.random.default_rng(seed).standard_normal((1, m, n))


@pytest.mark.parametrize("shape", [(4, 7), (7, 4), (5, 5)])
def test_exact_whitening_is_the_whitening_structure_direction(shape):
  """``I (x) M`` optimum with a one-sample expectation: direction ``sqrt(n) M^-1/2 G``
  (``M = G G^T / n``) equals ``sqrt(n) * whiten(G)`` (smaller side for tall G)."""
  g = _one_sample(*shape)
  got = np.asarray(_apply(fo.whiten(method="exact"), {"w": jnp.asarray(g[0], jnp.float32)})["w"])
  m, n = shape
  if m <= n:
    want = fim.whitening(g).direction(g[0]) / np.sqrt(n)
  else:  # a tall matrix is whitened on its smaller side: the transpose's structure
    gt = np.swapaxes(g, 1, 2)
    want = (fim.whitening(gt).direction(gt[0]) / np.sqrt(m)).T
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_exact_whitening_of_a_rank_deficient_matrix_is_the_pseudo_inverse_root():
  rng = np.random.default_rng(1)
  g = rng.standard_normal((5, 2)) @ rng.standard_normal((2, 8))  # rank 2
  got = np.asarray(_apply(fo.whiten(method="exact"), jnp.asarray(g, jnp.float32)))
  u, s, vt = np.linalg.svd(g, full_matrices=False)
  np.testing.assert_allclose(got, u[:, :2] @ vt[:2], atol=2e-5)


def test_newton_schulz_within_its_documented_error_of_exact():
  rng = np.random.default_rng(2)
  for shape in [(8, 20), (20, 8), (16, 16), (3, 4, 12)]:
    g = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    ns = np.asarray(_apply(fo.whiten(), g))
    for x in ns.reshape((-1,) + ns.shape[-2:]):
      sv = np.linalg.svd(x, compute_uv=False)
      assert sv.min() > 0.6 and sv.max() < 1.25, sv  # Muon's coefficients: S' in ~[0.7, 1.2]
  # the classical cubic iteration converges to the exact polar factor
  g = jnp.asarray(rng.standard_normal((8, 20)), jnp.float32)
  cubic = _apply(fo.whiten(coeffs=(1.5, -0.5, 0.0), steps=60), g)
  np.testing.assert_allclose(np.asarray(cubic), np.asarray(_apply(fo.whiten(method="exact"), g)),
                             atol=2e-4)


def test_normalize_columns_and_swan_gradnorm():
  rng = np.random.default_rng(3)
  g = rng.standard_normal((6, 9)) * rng.uniform(0.1, 10, size=(6, 1))
  col = np.asarray(_apply(fo.normalize(), jnp.asarray(g, jnp.float32)))
  np.testing.assert_allclose(col, g / np.linalg.norm(g, axis=0), rtol=1e-5)
  # SWAN's GradNorm: rows of the canonical (m <= n) view standardised over the columns
  gn = np.asarray(_apply(fo.normalize(axis="rows", center=True), jnp.asarray(g, jnp.float32)))
  want = (g - g.mean(1, keepdims=True)) / g.std(1, keepdims=True)
  np.testing.assert_allclose(gn, want, rtol=1e-4, atol=1e-5)
  # normalization structure S (x) I: direction sqrt(m) G S^-1/2 (paper Prop.)
  np.testing.assert_allclose(col, fim.normalization(g[None]).direction(g) / np.sqrt(6),
                             rtol=1e-5)
  # a tall matrix: rows of its transpose
  gt = np.asarray(_apply(fo.normalize(axis="rows", center=True),
                         jnp.asarray(g.T, jnp.float32)))
  np.testing.assert_allclose(gt, want.T, rtol=1e-4, atol=1e-5)


def test_swan_is_whitening_of_gradnorm_and_keeps_no_matrix_state():
  rng = np.random.default_rng(4)
  g = rng.standard_normal((6, 10))
  params = {"w": jnp.zeros((6, 10)), "b": jnp.zeros((6,))}
  tx = fo.swan(0.1, consistent_rms=None)
  u = tx.update({"w": jnp.asarray(g, jnp.float32), "b": jnp.ones(6)}, tx.init(params),
                params)[0]["w"]
  gn = (g - g.mean(1, keepdims=True)) / g.std(1, keepdims=True)
  uu, _, vt = np.linalg.svd(gn, full_matrices=False)
  width = np.sqrt(max(1.0, 10 / 6))
  # Newton-Schulz: within its documented error of the exact whitening
  np.testing.assert_allclose(np.asarray(u), -0.1 * width * uu @ vt, atol=0.1 * width * 0.35)
  exact = optax.chain(fo.normalize(axis="rows", center=True), fo.whiten(method="exact"))
  np.testing.assert_allclose(np.asarray(_apply(exact, jnp.asarray(g, jnp.float32))), uu @ vt,
                             atol=5e-5)
  # the fallback (Adam on "b") is the only state
  assert fo.state_numbers(tx.init(params)) == fo.state_numbers(
      fo.in_float32(optax.adam(0.1)).init({"b": params["b"]}))


@pytest.mark.parametrize("consistent_rms", [pytest.param(None, marks=pytest.mark.slow), 0.2])
def test_composed_muon_equals_optax_contrib_muon_on_matrices(consistent_rms):
  key = jax.random.PRNGKey(0)
  params = {"w": jax.random.normal(key, (6, 10)), "tall": jax.random.normal(key, (12, 5)),
            "stack": jax.random.normal(key, (3, 4, 8)), "b": jnp.ones((3,))}
  dims = {"w": fo.MatrixDims(), "tall": fo.MatrixDims(), "stack": fo.MatrixDims(1, 2),
          "b": None}
  ours = fo.muon(0.02, consistent_rms=consistent_rms, dims=dims)
  theirs = optax.contrib.muon(
      0.02, consistent_rms=consistent_rms,
      muon_weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers(0, 1),
                                     "tall": optax.contrib.MuonDimensionNumbers(0, 1),
                                     "stack": optax.contrib.MuonDimensionNumbers(1, 2),
                                     "b": None})
  s1, s2 = ours.init(params), theirs.init(params)
  for t in range(5):
    g = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(10 + t), p.shape), params)
    u1, s1 = ours.update(g, s1, params)
    # optax's products follow JAX's default precision (TensorFloat-32 on NVIDIA GPUs);
    # ours are float32 on every backend
    with jax.default_matmul_precision("float32"):
      u2, s2 = theirs.update(g, s2, params)
    for k in ("w", "tall", "stack"):
      np.testing.assert_allclose(np.asarray(u1[k]), np.asarray(u2[k]), rtol=2e-5, atol=2e-7)


# three cases in the default run, the others in CI's slow step
_EXTREME = [(0.0, jnp.float32), (1e18, jnp.bfloat16), (1e-30, jnp.float16)]


@pytest.mark.parametrize("scale,dtype", [
    pytest.param(s, d, id=f"{s}-{jnp.dtype(d).name}",
                 marks=() if (s, d) in _EXTREME else pytest.mark.slow)
    for d in (jnp.float32, jnp.bfloat16, jnp.float16) for s in (0.0, 1e-30, 1.0, 1e18)])
def test_whitening_blocks_are_finite_for_extreme_gradients(dtype, scale):
  scale = min(scale, float(jnp.finfo(dtype).max) / 10)  # huge, still finite in the dtype
  g = {"w": (jax.random.normal(jax.random.PRNGKey(1), (6, 10)) * scale).astype(dtype)}
  for tx in (fo.whiten(), fo.whiten(method="exact"), fo.normalize(),
             fo.normalize(axis="rows", center=True), fo.swan(0.01), fo.muon(0.01)):
    u = _apply(tx, g)["w"]
    assert u.dtype == dtype and bool(jnp.all(jnp.isfinite(u)))
    if scale == 0.0:
      assert float(jnp.max(jnp.abs(u))) == 0.0
  if scale in (1e-30, 1e18) and dtype == jnp.float32:  # scale-free: same as unit gradients
    ref = _apply(fo.whiten(), {"w": jax.random.normal(jax.random.PRNGKey(1), (6, 10))})["w"]
    np.testing.assert_allclose(np.asarray(_apply(fo.whiten(), g)["w"]), np.asarray(ref),
                               rtol=1e-4, atol=1e-5)


def test_invalid_settings_raise():
  with pytest.raises(ValueError, match="method"):
    fo.whiten(method="svd")
  with pytest.raises(ValueError, match="steps"):
    fo.whiten(steps=0)
  with pytest.raises(ValueError, match="coeffs"):
    fo.whiten(coeffs=(1.0, 2.0))
  with pytest.raises(ValueError, match="axis"):
    fo.normalize(axis="diag")
  with pytest.raises(ValueError, match="ndim >= 2"):
    fo.whiten().update({"v": jnp.ones(3)}, optax.EmptyState())
