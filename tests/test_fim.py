"""The paper's propositions as executable checks (fisher_optax.fisher.fim), and consistency of the
FIM directions with the optimizers' preconditioned directions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo
from fisher_optax.fisher import fim

M, N = 4, 6


def _samples(seed, k=40, m=M, n=N):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((1, m, n))
          + rng.standard_normal((k, m, n)) * rng.uniform(0.2, 2.0, size=(1, m, n)))


def _sym(rng, d):
  a = rng.standard_normal((d, d))
  return 0.5 * (a + a.T)


@pytest.mark.parametrize("name", list(fim.STRUCTURES))
def test_closed_form_direction_equals_dense_inverse_sqrt(name):
  g = _samples(0)
  a = fim.STRUCTURES[name](g)
  dense = fim.devec(fim._psd_power(a.matrix, -0.5) @ fim.vec(g[3]), M, N)
  np.testing.assert_allclose(a.direction(g[3]), dense, atol=1e-10)
  assert a.error == pytest.approx(np.linalg.norm(a.matrix - fim.empirical_fim(g)))


def test_empirical_fim_uses_column_stacking():
  g = _samples(1, k=3)
  f = fim.empirical_fim(g)
  # block (i, j) of F is E[g_i g_j^T] for columns g_i, g_j
  i, j = 1, 4
  block = np.mean([x[:, i:i + 1] @ x[:, j:j + 1].T for x in g], axis=0)
  np.testing.assert_allclose(f[i * M:(i + 1) * M, j * M:(j + 1) * M], block)


# ------------------------------------------------------------- exact minimisers


def _perturbations(name, a, rng):
  """Random members of the same family near the optimum."""
  f = a.factors
  for _ in range(40):
    eps = 10.0 ** rng.uniform(-4, -1)
    if name == "diagonal":
      d = f["d"] * np.exp(eps * rng.standard_normal(f["d"].shape))
      yield np.diag(fim.vec(d))
    elif name == "whitening":
      yield np.kron(np.eye(N), f["M"] + eps * _sym(rng, M))
    elif name == "normalization":
      yield np.kron(np.diag(f["s"] * np.exp(eps * rng.standard_normal(N))), np.eye(M))
    elif name == "two_sided":
      yield np.kron(np.diag(f["s"] * np.exp(eps * rng.standard_normal(N))),
                    np.diag(f["q"] * np.exp(eps * rng.standard_normal(M))))
    elif name == "general":
      yield np.kron(np.diag(f["s"] * np.exp(eps * rng.standard_normal(N))),
                    f["M"] + eps * _sym(rng, M))
    elif name == "eigen_adam":  # D_i with the 1-step U fixed (Thm., step ii)
      d = f["D"] * np.exp(eps * rng.standard_normal(f["D"].shape))
      yield fim.blockdiag([f["U"] @ np.diag(d[:, i]) @ f["U"].T for i in range(N)])
    elif name == "soap":  # D~ with U_L, U_R fixed
      d = f["D"] * np.exp(eps * rng.standard_normal(f["D"].shape))
      k = np.kron(f["U_R"], f["U_L"])
      yield k @ np.diag(fim.vec(d)) @ k.T


@pytest.mark.parametrize("name", ["diagonal", "whitening", "normalization", "two_sided",
                                  "general", "eigen_adam", "soap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_forms_are_stationary(name, seed):
  """No random perturbation inside the family lowers ||F~ - F||_F (for Eigen-Adam and SOAP:
  inside the family with their bases fixed, i.e. step (ii) of the 1-step refinement)."""
  g = _samples(seed)
  a = fim.STRUCTURES[name](g)
  f = fim.empirical_fim(g)
  rng = np.random.default_rng(100 + seed)
  for cand in _perturbations(name, a, rng):
    assert np.linalg.norm(cand - f) >= a.error - 1e-9


def test_racs_fixed_point_is_principal_singular_pair_of_expected_g_squared():
  g = _samples(3)
  a = fim.two_sided(g)
  u, sv, vt = np.linalg.svd(np.mean(g ** 2, axis=0))
  s, q = a.factors["s"], a.factors["q"]
  np.testing.assert_allclose(s / np.linalg.norm(s), np.abs(vt[0]), atol=1e-8)
  np.testing.assert_allclose(q / np.linalg.norm(q), np.abs(u[:, 0]), atol=1e-8)
  np.testing.assert_allclose(np.linalg.norm(s) * np.linalg.norm(q), sv[0], rtol=1e-8)


def test_general_fixed_point_s_is_perron_vector():
  """Thm.: diag(S*) is the principal eigenvector of K_ij = <F_ii, F_jj>_F."""
  g = _samples(4)
  a = fim.general(g)
  blocks = [np.mean([x[:, i:i + 1] @ x[:, i:i + 1].T for x in g], axis=0) for i in range(N)]
  k = np.array([[np.sum(bi * bj) for bj in blocks] for bi in blocks])
  w, v = np.linalg.eigh(k)
  s = a.factors["s"]
  np.testing.assert_allclose(s / np.linalg.norm(s), np.abs(v[:, -1]), atol=1e-8)


@pytest.mark.parametrize("seed", range(4))
def test_compensation_theorem_s_is_optimal(seed):
  g = _samples(seed, k=30, m=6, n=5)
  u = fim.eigen_adam(g).factors["U"][:, :2]
  s = fim.compensation_optimum(g, u)
  best = fim.compensation_error(g, u, s)
  rng = np.random.default_rng(seed)
  for _ in range(30):
    cand = s * np.exp(10.0 ** rng.uniform(-4, -1) * rng.standard_normal(s.shape))
    assert fim.compensation_error(g, u, cand) >= best - 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_nested_structures_order_their_optimal_errors(seed):
  """A family that contains another never has a larger optimal error."""
  e = {k: a.error for k, a in fim.all_structures(_samples(seed)).items()}
  tol = 1e-9
  assert e["normalization"] >= e["two_sided"] - tol      # S(x)I  >=  S(x)Q
  assert e["whitening"] >= e["general"] - tol            # I(x)M  >=  S(x)M
  assert e["normalization"] >= e["general"] - tol        # S(x)I  >=  S(x)M
  assert e["two_sided"] >= e["diagonal"] - tol           # S(x)Q  >=  diagonal
  # the 1-step D is optimal for its bases, and these families contain, with the same
  # eigenbases, whitening (Eigen-Adam) and Shampoo's R^1/2 (x) L^1/2 (SOAP):
  assert e["whitening"] >= e["eigen_adam"] - tol
  assert e["shampoo"] >= e["soap"] - tol


def test_orderings_the_paper_does_not_guarantee_actual_behaviour():
  """Documented behaviour, not theorems (20 fixed seeds, 4 x 5 layers, 30 samples):
  Eigen-Adam's 1-step refinement is not always better than Adam's diagonal optimum,
  SOAP is usually but not always better than Eigen-Adam, and Shampoo's upper-bound
  solution is not stationary (a plain rescaling lowers its error)."""
  eig_beats_diag = soap_beats_eig = shampoo_rescale_helps = 0
  for seed in range(20):
    g = _samples(seed, k=30, m=4, n=5)
    r = fim.all_structures(g)
    f = fim.empirical_fim(g)
    eig_beats_diag += r["eigen_adam"].error <= r["diagonal"].error
    soap_beats_eig += r["soap"].error <= r["eigen_adam"].error
    sh = r["shampoo"].matrix
    c = np.sum(sh * f) / np.sum(sh * sh)  # best rescaling
    shampoo_rescale_helps += np.linalg.norm(c * sh - f) < r["shampoo"].error - 1e-9
  assert 0 < eig_beats_diag < 20
  assert 10 < soap_beats_eig < 20
  assert shampoo_rescale_helps == 20


# ------------------------------------------------- consistency with the optimizers


def _one_sample(seed=7, m=M, n=N):
  return np.random.default_rng(seed).standard_normal((1, m, n))


def _first_update(tx, g):
  p = {"w": jnp.zeros(g.shape, jnp.float32)}
  u, _ = tx.update({"w": jnp.asarray(g, jnp.float32)}, tx.init(p), p)
  return np.asarray(u["w"], np.float64)


def test_adam_direction_is_the_diagonal_structure():
  g = _one_sample()
  got = _first_update(optax.scale_by_adam(b1=0.0, b2=0.0, eps=0.0), g[0])
  np.testing.assert_allclose(got, fim.diagonal(g).direction(g[0]), atol=1e-6)


def test_racs_direction_is_the_two_sided_structure():
  g = _one_sample()
  got = _first_update(fo.scale_by_two_sided(beta=0.0, iters=100), g[0])
  np.testing.assert_allclose(got, fim.two_sided(g).direction(g[0]), rtol=1e-4)


def test_eigen_adam_direction_is_the_shared_eigenspace_structure():
  g = _one_sample()
  tx = fo.rotate(fo.scale_by_moments(0.0, 0.0, 0.0), sides="left", b3=0.0, interval=1)
  np.testing.assert_allclose(_first_update(tx, g[0]), fim.eigen_adam(g).direction(g[0]),
                             atol=1e-5)


def test_soap_bases_are_the_eigenbases_of_the_expected_statistics():
  """SOAP's structure needs several samples (one sample makes U_L^T G U_R diagonal, so D~
  is singular); with N samples accumulated (b3=None) the rotate block's bases are the
  structure's U_L = eig(E[GG^T]), U_R = eig(E[G^T G]). The elementwise Adam step in that
  basis is the diagonal structure, checked above."""
  g = _samples(5, k=12)
  tx = fo.rotate(optax.identity(), sides="both", b3=None, interval=1)
  p = {"w": jnp.zeros((M, N))}
  s = tx.init(p)
  for x in g:
    _, s = tx.update({"w": jnp.asarray(x, jnp.float32)}, s, p)
  f = fim.soap(g).factors
  for got, want in [(s.left.basis["w"], f["U_L"]), (s.right.basis["w"], f["U_R"])]:
    np.testing.assert_allclose(np.abs(np.asarray(got, np.float64).T @ want),
                               np.eye(want.shape[0]), atol=1e-4)


def test_shampoo_direction_is_the_kronecker_structure():
  """Equal up to the constant (mn)^(1/4) from the 1/m, 1/n normalisation of R, L."""
  g = _one_sample()
  got = _first_update(fo.shampoo(-1.0, eps=1e-12, interval=1), g[0])  # -lr = +1
  want = fim.shampoo(g).direction(g[0]) / (M * N) ** 0.25
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)


def test_whitening_and_normalization_directions_are_the_operators():
  g = _one_sample()
  x = g[0]
  w, v = np.linalg.eigh(x @ x.T)
  whiten = (v / np.sqrt(w)) @ v.T @ x
  np.testing.assert_allclose(fim.whitening(g).direction(x), np.sqrt(N) * whiten, rtol=1e-8)
  normal = x / np.linalg.norm(x, axis=0)
  np.testing.assert_allclose(fim.normalization(g).direction(x), np.sqrt(M) * normal, rtol=1e-8)


def test_compensation_block_uses_the_optimal_s():
  """With b1 = 0 (one-sample expectation) ``fo.compensate`` computes U_c U_c^T G diag(S*)."""
  g = np.random.default_rng(9).standard_normal((1, 6, 8))
  tx = optax.chain(fo.low_rank_track(rank=2), fo.on_coefficients(optax.identity(), rank=2),
                   fo.compensate(alpha_c=1.0, b1=0.0, limiter=None))
  p = {"w": jnp.zeros((6, 8))}
  out, st = tx.update({"w": jnp.asarray(g[0], jnp.float32)}, tx.init(p), p)
  u = np.asarray(st[0].basis["w"], np.float64)
  comp = np.asarray(out["w"], np.float64) - u @ u.T @ g[0]
  s = fim.compensation_optimum(g, u)
  np.testing.assert_allclose(comp, (np.eye(6) - u @ u.T) @ g[0] * s[None, :], rtol=2e-4,
                             atol=1e-6)
