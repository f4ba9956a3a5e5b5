"""fisher_optax.fisher.structure_errors against the dense fisher_optax.fisher.fim on small layers: every
structure's error without forming F equals the dense one to 1e-8 relative (float64)."""

import numpy as np
import pytest

from fisher_optax.fisher import fim
from fisher_optax.fisher import structure_errors as se

SHAPES = [(6, 9), (7, 7), (4, 12)]


def _samples(shape, n=20, seed=0):
  """Gradients with structure (a low-rank mean and row/column scales) plus noise."""
  rng = np.random.default_rng(seed)
  m, k = shape
  base = rng.standard_normal((m, 2)) @ rng.standard_normal((2, k))
  scale = np.outer(rng.uniform(0.5, 2.0, m), rng.uniform(0.5, 2.0, k))
  return np.stack([scale * (base + rng.standard_normal((m, k))) for _ in range(n)])


def _rel(dense_f, f_tilde):
  return np.linalg.norm(f_tilde - dense_f) / np.linalg.norm(dense_f)


def _dense(name, g, rank):
  f = fim.empirical_fim(g)
  if name in fim.STRUCTURES:
    return fim.STRUCTURES[name](g).error / np.linalg.norm(f)
  if name == "alice":
    return fim.alice(g, rank).error / np.linalg.norm(f)
  if name == "alice_no_comp":
    a = fim.alice(g, rank)
    u, d = a.factors["U"], a.factors["D"]
    core = fim.blockdiag([u @ np.diag(d[:, i]) @ u.T for i in range(g.shape[2])])
    return _rel(f, core)
  if name == "kronecker":  # Van Loan: the top singular value of the rearranged F
    _, m, n = g.shape
    r = np.stack([f[a * m:(a + 1) * m, b * m:(b + 1) * m].reshape(-1, order="F")
                  for a in range(n) for b in range(n)])
    sigma = np.linalg.svd(r, compute_uv=False)[0]
    return np.sqrt(max(np.sum(f * f) - sigma ** 2, 0.0)) / np.linalg.norm(f)
  raise KeyError(name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [20, 3])
def test_every_structure_equals_the_dense_fim(shape, n):
  g = _samples(shape, n)
  got = se.structure_errors(g, rank=2, smaller_first=False)
  assert set(got) == set(se.STRUCTURES)
  for name, res in got.items():
    want = _dense(name, g, 2)
    np.testing.assert_allclose(res.relative, want, rtol=1e-8, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(res.error, want * np.linalg.norm(fim.empirical_fim(g)),
                               rtol=1e-8, atol=1e-12, err_msg=name)


def test_orderings_the_paper_proves():
  """Nested families: the general S (x) M fits at least as well as both normalization and
  whitening and as RACS's two-sided scaling; the Kronecker optimum beats them all and
  Shampoo's bound solution; compensation never hurts Alice; Eigen-Adam is Alice at full
  rank."""
  g = _samples((6, 9), 30, seed=3)
  r = se.structure_errors(g, rank=3)
  e = {k: v.relative for k, v in r.items()}
  assert e["general"] <= min(e["normalization"], e["whitening"], e["two_sided"]) + 1e-12
  assert e["kronecker"] <= min(e["general"], e["shampoo"]) + 1e-12
  assert e["alice"] <= e["alice_no_comp"] + 1e-12
  full = se.structure_errors(g, rank=5, structures=("alice_no_comp",))["alice_no_comp"]
  assert full.relative >= e["eigen_adam"] - 1e-12


def test_a_kronecker_fisher_is_fit_exactly():
  """N = mn samples whose vecs are an orthonormal basis (times sqrt(mn)) give F = I,
  which is diagonal, two-sided, general and Kronecker at once: all fit it exactly."""
  rng = np.random.default_rng(0)
  m, n = 4, 5
  q, _ = np.linalg.qr(rng.standard_normal((m * n, m * n)))
  g = np.stack([q[:, k].reshape((m, n), order="F") for k in range(m * n)]) * np.sqrt(m * n)
  r = se.structure_errors(g, rank=2, structures=("kronecker", "general", "two_sided",
                                                 "diagonal"), smaller_first=False)
  for name in ("kronecker", "general", "two_sided", "diagonal"):
    assert r[name].relative < 1e-7, (name, r[name])


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (3, 40), (7, 7)])
@pytest.mark.parametrize("n", [20, 3])
def test_both_kronecker_routes_equal_the_dense_optimum(shape, n):
  """The side iteration and the Gram iteration (the smaller side's blocks of the samples'
  Gram matrix, for wide layers) give the same Van Loan optimum as the dense SVD."""
  g = _samples(shape, n, seed=n)
  want = _dense("kronecker", g, 2)
  samples = se.LayerSamples(g)
  for route in ("sides", "gram"):
    got = se.kronecker(samples, route=route)
    np.testing.assert_allclose(got.relative, want, rtol=1e-8, atol=1e-12, err_msg=route)
  with pytest.raises(ValueError, match="route must be"):
    se.kronecker(samples, route="dense")


def test_kronecker_takes_the_gram_route_for_a_wide_layer():
  """An output-layer shape (a few rows, many columns) is cheaper through the Gram route;
  a square one through the sides; the choice never changes the result (above)."""
  wide = se.LayerSamples(np.ones((4, 8, 2000)))
  square = se.LayerSamples(np.ones((4, 64, 64)))
  assert se._gram_is_cheaper(wide) and not se._gram_is_cheaper(square)


def test_structure_numbers():
  r = se.structure_errors(_samples((6, 9)), rank=2)
  assert r["diagonal"].numbers == 54 and r["two_sided"].numbers == 15
  assert r["alice"].numbers == 6 * 2 + 2 * 9 + 9 and r["soap"].numbers == 36 + 81 + 54


def test_tall_layers_are_read_on_their_smaller_side():
  g = _samples((9, 6))
  tall = se.structure_errors(g, rank=2)
  wide = se.structure_errors(np.swapaxes(g, 1, 2), rank=2)
  for k in se.STRUCTURES:
    np.testing.assert_allclose(tall[k].relative, wide[k].relative, rtol=1e-10)


@pytest.mark.parametrize("scale", [1e-150, 1e-30, 1e30, 1e150])
def test_tiny_and_huge_samples_give_the_unit_scale_errors(scale):
  """Relative errors do not depend on the samples' scale; the absolute error scales with
  F, i.e. with ``scale^2``. Without rescaling, 1e+-150 under- or overflows float64."""
  g = _samples((6, 9), 8, seed=5)
  want = se.structure_errors(g, rank=2)
  got = se.structure_errors(g * scale, rank=2)
  for k in se.STRUCTURES:
    np.testing.assert_allclose(got[k].relative, want[k].relative, rtol=1e-9, err_msg=k)
    np.testing.assert_allclose(got[k].error, want[k].error * scale ** 2, rtol=1e-9,
                               err_msg=k)
  for route in ("sides", "gram"):
    np.testing.assert_allclose(se.kronecker(se.LayerSamples(g * scale), route=route).relative,
                               want["kronecker"].relative, rtol=1e-9, err_msg=route)


def test_float32_arithmetic_rescales_too():
  g = _samples((6, 9), 8, seed=6)
  want = se.structure_errors(g, rank=2)["soap"].relative
  got = se.structure_errors(g * 1e20, rank=2, dtype=np.float32)["soap"].relative
  np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (np.zeros((3, 4, 5)), "every gradient sample is zero"),
    (np.ones((1, 4, 5)), "at least two gradient samples"),
    (np.full((3, 4, 5), np.nan), "non-finite"),
    (np.ones((3, 1, 5)), "no matrix"),
    (np.ones((3, 4)), r"\[N, m, n\]"),
])
def test_bad_input_names_the_layer(bad, match):
  with pytest.raises(ValueError, match=match) as e:
    se.structure_errors(bad, rank=1, name="layers/0/q")
  assert "layers/0/q" in str(e.value)


def test_bad_rank_and_structure():
  g = _samples((6, 9))
  with pytest.raises(ValueError, match="rank must be in \\[1, 5\\]"):
    se.structure_errors(g, rank=6, name="w")
  with pytest.raises(ValueError, match="needs rank"):
    se.structure_errors(g, structures=("alice",))
  with pytest.raises(ValueError, match="unknown structure"):
    se.structure_errors(g, structures=("adam",))
