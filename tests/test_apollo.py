"""APOLLO / APOLLO-mini (paper App. Alg. "Apollo") against a dense float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from tests import reference
from tests.registry import LR
from tests.util import SHAPES, apollo_bases, run_library, structured_grads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["apollo", "apollo_mini"])
def test_matches_dense_float64_reference(name, shape):
  interval = 3
  rank = 3 if name == "apollo" else 1
  kind = "channel" if name == "apollo" else "tensor"
  scale = 1.0 if name == "apollo" else 128.0
  kw = dict(interval=interval) | (dict(rank=rank) if name == "apollo" else {})
  grads = structured_grads(shape, 7, seed=8)
  lib = run_library(name, shape, grads, **kw)
  *batch, m, n = shape
  nb = int(np.prod(batch)) if batch else 1
  basis = apollo_bases(shape, rank, interval)
  refs = [reference._Transposing(reference.ApolloRef, m, n, lr=LR, rank=rank, kind=kind,
                                 scale=scale, basis=basis(b)) for b in range(nb)]
  for t, (g, a) in enumerate(zip(grads, lib), start=1):
    g = np.asarray(g, np.float32).astype(np.float64).reshape(nb, m, n)
    b = np.stack([ref.step(g[i]) for i, ref in enumerate(refs)]).reshape(shape)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 1e-4, f"{name} step {t}: {err:.2e}"


def test_apollo_mini_state_is_2n_plus_1_per_matrix():
  for shape in [(16, 40), (40, 16)]:
    state = jax.eval_shape(fo.apollo_mini(LR).init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
    sub = state.inner_states["structured"].inner_state
    counters = [x for x in jax.tree.leaves(sub) if x.dtype == jnp.int32 and x.shape == ()]
    assert len(counters) == 2  # projection and bias-correction step counters, shared
    per_matrix = fo.state_numbers(sub) - len(counters)
    assert per_matrix == 2 * 40 + 1  # moments and the limiter norm; no stored seed


def test_projection_renewed_at_refresh_only_and_stateless():
  tx = fo.random_project(rank=2, interval=2)
  p = {"w": jnp.zeros((4, 6))}
  s = tx.init(p)
  assert jax.tree.leaves(s) == [s.count]  # nothing random is stored
  bases = []
  for _ in range(5):
    out, s = tx.update({"w": jnp.ones((4, 6))}, s)
    bases.append(np.asarray(out["w"].basis))
  # steps 1,2 share a projection; 3,4 share a new one; 5 gets another
  np.testing.assert_array_equal(bases[0], bases[1])
  np.testing.assert_array_equal(bases[2], bases[3])
  assert not np.allclose(bases[0], bases[2]) and not np.allclose(bases[2], bases[4])
  again, _ = tx.update({"w": jnp.ones((4, 6))}, s._replace(count=jnp.int32(2)))
  np.testing.assert_array_equal(np.asarray(again["w"].basis), bases[2])


def test_invalid_kind():
  with pytest.raises(ValueError, match="kind"):
    fo.scale_by_subspace_ratio("rows")


def test_grouped_draws_equal_each_matrixs_own_draw():
  """``random_project`` draws matrix ``i``'s projection from
  ``fold_in(fold_in(PRNGKey(seed), renewal), i)``, the draws of same-shape matrices in one
  grouped call: each basis equals ``random_basis`` of that key alone."""
  from fisher_optax.blocks import random_projection as rpj
  params = {"a": jnp.zeros((6, 9)), "b": jnp.zeros((2, 6, 11)), "c": jnp.zeros((9, 6))}
  tx = fo.random_project(rank=3, interval=2, seed=5, dims=fo.MatrixDims())
  rng = np.random.default_rng(0)
  g = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
  out, _ = tx.update(g, tx.init(params)._replace(count=jnp.int32(4)))  # renewal 2
  index = 0
  for k in ("a", "b", "c"):
    basis = np.asarray(out[k].basis).reshape((-1, 6, 3))
    for i in range(basis.shape[0]):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(5), 2), index)
      np.testing.assert_allclose(basis[i], rpj.random_basis(key, 6, 3), rtol=1e-6)
      index += 1


def test_projections_have_the_papers_variance_and_are_independent():
  """Entries of every projection ``U`` are N(0, 1/r) (APOLLO: ``U_ij ~ N(0, 1/r)``), and the
  projections of different matrices and of successive renewals are uncorrelated."""
  r, m, nb = 4, 64, 50
  tx = fo.random_project(rank=r, interval=1, seed=3, dims=fo.MatrixDims())
  g = {"w": jnp.ones((nb, m, 80))}
  s = tx.init(g)
  draws = []
  for _ in range(2):  # interval 1: a new projection every step
    out, s = tx.update(g, s)
    draws.append(np.asarray(out["w"].basis, np.float64))
  x = np.stack(draws)  # (2, nb, m, r)
  assert abs(x.mean()) < 4 * np.sqrt(1.0 / r / x.size)
  np.testing.assert_allclose(x.var(), 1.0 / r, rtol=0.05)  # 25,600 samples: ~1% sd
  flat = x.reshape(2 * nb, -1)
  corr = np.corrcoef(flat)[np.triu_indices(2 * nb, 1)]
  assert np.abs(corr).max() < 6 / np.sqrt(flat.shape[1])  # 256 entries per projection
