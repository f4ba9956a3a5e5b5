"""APOLLO / APOLLO-mini (paper App. Alg. "Apollo") against a dense float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from fisher_optax.blocks import random_projection as rp
from tests import reference
from tests.conftest import structured_grads
from tests.util import LR, SHAPES, run_library


def _bases(shape, rank, interval, seed=0):
  """The library's seeded Gaussian projections per step and slice (shared randomness)."""
  *batch, m, n = shape
  ms, nb = min(m, n), int(np.prod(batch)) if batch else 1
  seeds = np.asarray(jax.random.bits(jax.random.fold_in(jax.random.PRNGKey(seed), 0),
                                     tuple(batch), jnp.uint32)).reshape(nb)
  per_step = {}

  def basis(b):
    def f(t):
      if t not in per_step:
        s = per_step[t - 1] if t > 1 else seeds
        if t > 1 and (t - 1) % interval == 0:
          s = np.asarray([rp.next_seed(jnp.uint32(x)) for x in s])
        per_step[t] = s
      return rp.random_basis(jnp.uint32(per_step[t][b]), ms, min(rank, ms))
    return f

  return basis


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
  basis = _bases(shape, rank, interval)
  refs = [reference._Transposing(reference.ApolloRef, m, n, lr=LR, rank=rank, kind=kind,
                                 scale=scale, basis=basis(b)) for b in range(nb)]
  for t, (g, a) in enumerate(zip(grads, lib), start=1):
    g = np.asarray(g, np.float32).astype(np.float64).reshape(nb, m, n)
    b = np.stack([ref.step(g[i]) for i, ref in enumerate(refs)]).reshape(shape)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 1e-4, f"{name} step {t}: {err:.2e}"


def test_apollo_mini_state_is_2n_plus_2_per_matrix():
  for shape in [(16, 40), (40, 16)]:
    state = jax.eval_shape(fo.apollo_mini(LR).init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
    sub = state.inner_states["structured"].inner_state
    is_proj = lambda x: isinstance(x, rp.RandomProjectState)  # noqa: E731
    offsets = [x.starts for x in jax.tree.leaves(sub, is_leaf=is_proj) if is_proj(x)]
    assert [len(o) for o in offsets] == [1]  # the draw's split offset, one per leaf
    sub = jax.tree.map(lambda x: x._replace(starts=()) if is_proj(x) else x, sub,
                       is_leaf=is_proj)
    counters = [x for x in jax.tree.leaves(sub) if x.dtype == jnp.int32 and x.shape == ()]
    assert len(counters) == 2  # projection and bias-correction step counters, shared
    per_matrix = fo.state_numbers(sub) - len(counters)
    assert per_matrix == 2 * 40 + 2


def test_seed_renewed_at_refresh_only():
  tx = fo.random_project(rank=2, interval=2)
  p = {"w": jnp.zeros((4, 6))}
  s = tx.init(p)
  seeds = []
  for _ in range(5):
    _, s = tx.update({"w": jnp.ones((4, 6))}, s)
    seeds.append(int(s.seed["w"]))
  # steps 1,2 share a seed; 3,4 share a new one; 5 gets another
  assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and len({seeds[0], seeds[2], seeds[4]}) == 3


def test_invalid_kind():
  with pytest.raises(ValueError, match="kind"):
    fo.scale_by_subspace_ratio("rows")


def test_draw_split_offsets_live_in_the_state_and_are_checked():
  """``random_project`` splits its grouped draws at offsets the state holds (int32
  scalars, one per leaf): updates as with the static split; edited offsets give NaN
  projections (not another leaf's); a state from another tree is a ValueError."""
  from fisher_optax import matrices
  params = {"a": jnp.zeros((6, 9)), "b": jnp.zeros((2, 6, 11)), "c": jnp.zeros((9, 6))}
  tx = fo.random_project(rank=3, interval=2, dims=fo.MatrixDims())
  s = tx.init(params)
  assert [int(x) for x in s.starts] == [0, 1, 3]  # (6, 3) draws: a 1, b 2, c 1
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32),
                        params) for _ in range(3)]
  step = tx.update  # eager: Subspace nodes carry the basis as metadata

  def run(st):
    outs = []
    for g in grads:
      out, st = step(g, st)
      outs.append(out)
    return outs

  outs = run(s)
  static = matrices.vmap_grouped
  try:  # the static split
    matrices.vmap_grouped = lambda fn, args, groups, starts=None: static(fn, args, groups)
    outs2 = run(s)
  finally:
    matrices.vmap_grouped = static
  for o, o2 in zip(outs, outs2):
    for k in params:
      np.testing.assert_array_equal(np.asarray(o[k].coeffs), np.asarray(o2[k].coeffs))
      np.testing.assert_array_equal(np.asarray(o[k].basis), np.asarray(o2[k].basis))
  out, _ = step(grads[0], s._replace(starts=(s.starts[0], s.starts[2], s.starts[1])))
  assert all(bool(jnp.all(jnp.isnan(out[k].basis))) for k in params)
  with pytest.raises(ValueError, match="split offsets"):
    tx.update({"a": grads[0]["a"]}, tx.init({"a": params["a"]})._replace(starts=s.starts))


def test_rank_one_projection_equals_the_matrix_product():
  """APOLLO-mini's ``r = 1`` projection is written as multiply-reduce (compile time):
  the same ``U^T G`` as the matrix product, to float32 rounding."""
  rng = np.random.default_rng(1)
  u = jnp.asarray(rng.standard_normal((2, 7, 1)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 7, 5)), jnp.float32)
  got = rp._project(u, g)
  assert got.shape == (2, 1, 5)
  np.testing.assert_allclose(got, jnp.swapaxes(u, -1, -2) @ g, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(rp._project(u[..., :1], g), got)
