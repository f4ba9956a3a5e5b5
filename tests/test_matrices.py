"""The per-matrix lifting layer (fisher_optax/matrices.py): views, lifting, grouping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fisher_optax import grouping, lifting, matrices

TREE = {"wide": jnp.arange(12.0).reshape(3, 4), "tall": jnp.arange(20.0).reshape(5, 4),
        "stack": jnp.arange(24.0).reshape(2, 3, 4), "half": jnp.ones((4, 6), jnp.bfloat16)}


@pytest.mark.parametrize("side", [None, "smaller", "larger"])
def test_lift_round_trip_and_canonical_layout(side):
  lifted = lifting.Lifted(TREE, matrices.MatrixDims(), side=side, what="test", canonical=True)
  for g, v, x in zip(lifted.canonical_grads, lifted.views, lifted.leaves):
    assert g.dtype == jnp.float32 and g.shape == v.batch_shape + (v.m, v.n)
    if side == "smaller":
      assert v.m <= v.n
    if side == "larger":
      assert v.m >= v.n
  back = lifted.to_leaves(lifted.canonical_grads)
  for k in TREE:
    assert back[k].dtype == TREE[k].dtype
    np.testing.assert_array_equal(np.asarray(back[k], np.float32),
                                  np.asarray(TREE[k], np.float32))


def test_per_matrix_maps_one_matrix_at_a_time_over_stacks():
  lifted = lifting.Lifted(TREE, matrices.MatrixDims(), what="test", canonical=True)
  traces = lifted.per_matrix(lambda g: jnp.trace(g @ g.T), lifted.canonical_grads)
  for t, x in zip(traces, lifted.leaves):
    x = np.asarray(x, np.float64)
    want = np.sum(x * x, axis=(-2, -1))
    np.testing.assert_allclose(np.asarray(t), want, rtol=1e-5)
  state = lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (v.n,)))
  assert state["stack"].shape == (2, 4) and state["tall"].shape == (4,)


def test_merged_axes_and_vectors():
  w = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5)  # (heads, head_dim, out)
  lifted = lifting.Lifted({"o": w, "b": jnp.ones(5)}, {"o": matrices.MatrixDims(rows=(0, 1),
                                                                                cols=2), "b": None},
                       what="test", vectors=True)
  assert lifted.views[0] is None  # "b" (sorted first) is a vector
  assert (lifted.views[1].m, lifted.views[1].n) == (6, 5)
  with pytest.raises(ValueError, match="matrices"):
    lifting.Lifted({"b": jnp.ones(5)}, None, what="test")


def test_map_grouped_serves_each_shape_once_and_splits_back():
  calls = []

  def fn(a, b):
    calls.append(a.shape)
    return a + (0 if b is None else b.sum())

  items = [(jnp.ones((2, 3, 3)), None), (2 * jnp.ones((1, 3, 3)), None),
           (jnp.ones((4, 2, 2)), None)]
  out = grouping.map_grouped(fn, items)
  assert [o.shape for o in out] == [(2, 3, 3), (1, 3, 3), (4, 2, 2)]
  np.testing.assert_array_equal(np.asarray(out[1]), 2 * np.ones((1, 3, 3)))
  assert len(calls) == 2  # one trace per shape (lax.map on CPU / vmap elsewhere)


def test_map_grouped_equals_each_item_alone():
  """Items grouped by shape give what ``fn`` gives on each item alone; ``group_starts``
  are the items' offsets in their group."""
  rng = np.random.default_rng(0)
  items = [(jnp.asarray(rng.normal(size=(b, 3, 4)), jnp.float32),
            jnp.asarray(rng.normal(size=(b, 3)), jnp.float32)) for b in (2, 1, 3)]
  items.insert(1, (jnp.ones((2, 5, 4)), jnp.ones((2, 5))))  # a group of its own
  fn = lambda a, b: (a * 2.0, a @ a.T + b[:, None])  # noqa: E731
  assert grouping.group_starts(items) == [0, 0, 2, 3]
  assert grouping.group_starts(jax.eval_shape(lambda: items)) == [0, 0, 2, 3]
  got = jax.jit(lambda its: grouping.map_grouped(fn, its))(items)
  for item, g in zip(items, got):
    for a, b in zip(grouping.map_matrices(fn, *item), g):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint32, bool])
def test_split_equals_static_slices(dtype):
  """``grouping.split`` hands back exactly ``x[s:s + z]`` per member, eager and jitted, for
  any dtype and for members covering the whole array; on CPU the members are cut by
  ``dynamic-slice`` at run-time offsets, not by one static slice per offset."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=(9, 3, 2)) * 4).astype(dtype)
  starts, sizes = [0, 2, 3, 7], [2, 1, 4, 2]
  want = [np.asarray(x)[s:s + z] for s, z in zip(starts, sizes)]
  for got in (grouping.split(x, starts, sizes),
              jax.jit(lambda y: grouping.split(y, starts, sizes))(x)):
    assert [g.dtype for g in got] == [x.dtype] * 4
    for w, g in zip(want, got):
      np.testing.assert_array_equal(w, np.asarray(g))
  assert grouping.split(x, [0], [9])[0] is x
  assert [g.shape for g in grouping.split(jnp.zeros((3, 0)), [0, 1], [1, 2])] == [(1, 0), (2, 0)]
  if jax.default_backend() == "cpu":
    hlo = jax.jit(lambda y: grouping.split(y, starts, sizes)).lower(x).compile().as_text()
    assert hlo.count("dynamic-slice(") >= 4
    assert not any(f"slice={{[{s}:{s + z}]" in hlo for s, z in zip(starts, sizes))


def test_map_stateless_casts_saturating():
  big = {"w": jnp.ones((2, 3), jnp.float16)}
  out = lifting.map_stateless(lambda g, v: g * 1e6, big, None, what="test")
  assert out["w"].dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(out["w"])))


def test_vmap_grouped_equals_per_leaf_draws_with_one_call_per_group():
  """Random draws grouped by output shape are bitwise the per-leaf draws (threefry is a
  function of each key alone), and the jitted program holds one hash kernel per group."""
  from fisher_optax.blocks import random_projection as rp
  seeds = [jnp.uint32(3), jnp.arange(6, dtype=jnp.uint32).reshape(2, 3), jnp.uint32(9)]
  shapes = [(4, 2), (4, 2), (5, 1)]

  def draw(s, m, r):
    return rp.random_basis(jax.random.PRNGKey(s), m, r)

  got = grouping.vmap_grouped(lambda mr: lambda s: draw(s, *mr), seeds, shapes)
  for s, (m, r), x in zip(seeds, shapes, got):
    want = grouping.vmap_batch(lambda t: draw(t, m, r), jnp.ndim(s))(s)
    assert x.shape == jnp.shape(s) + (m, r)
    np.testing.assert_allclose(x, want, rtol=1e-6)
  calls = []
  def counted(group):
    calls.append(group)
    return lambda s: draw(s, *group)
  jax.jit(lambda *a: grouping.vmap_grouped(counted, a, shapes)).lower(*seeds)
  assert sorted(calls) == [(4, 2), (5, 1)]


def test_vmap_grouped_starts_are_offsets_within_each_group():
  from fisher_optax.blocks import random_projection as rp
  seeds = [jnp.uint32(3), jnp.arange(6, dtype=jnp.uint32).reshape(2, 3), jnp.uint32(9),
           jnp.uint32(11)]
  shapes = [(4, 2), (4, 2), (5, 1), (4, 2)]
  assert grouping.vmap_grouped_starts([jnp.shape(s) for s in seeds], shapes) == [0, 1, 0, 7]
  got = jax.jit(lambda *a: grouping.vmap_grouped(
      lambda mr: lambda s: rp.random_basis(jax.random.PRNGKey(s), *mr), a, shapes))(*seeds)
  np.testing.assert_allclose(got[3], rp.random_basis(jax.random.PRNGKey(11), 4, 2), rtol=1e-6)


def test_per_matrix_traces_fn_once_per_shape_and_equals_the_per_leaf_call():
  """``Lifted.per_matrix`` runs ``fn`` under ``grouping.shared``: traced once per argument
  shape however many leaves share it (vmap over a stack reuses the trace), same values as
  calling ``fn`` leaf by leaf."""
  traced = []

  def fn(g, s):
    traced.append((g.shape, s.shape))
    return g * jnp.sum(g * g) + s[None, :]

  tree = [jnp.full((3, 4), float(i)) for i in range(6)] + [jnp.ones((2, 3, 4)), jnp.ones((4, 5))]

  def run(tree):
    lifted = lifting.Lifted(tree, matrices.MatrixDims(), what="test", canonical=True)
    ss = [jnp.ones(v.batch_shape + (v.n,)) for v in lifted.views]
    return lifted.per_matrix(fn, lifted.canonical_grads, ss)

  out = jax.jit(run)(tree)
  assert sorted(set(traced)) == [((3, 4), (4,)), ((4, 5), (5,))] and len(traced) == 2
  for x, o in zip(tree, out):
    ref = (jax.vmap(lambda g: fn(g, jnp.ones(4)))(x) if x.ndim == 3
           else fn(x, jnp.ones(x.shape[-1])))
    np.testing.assert_allclose(o, ref, rtol=1e-6)


def test_shared_closes_over_traced_hyperparameters():
  """A shared per-leaf function may close over values traced by an outer transformation
  (``optax.inject_hyperparams`` passes its hyperparameters that way)."""

  def update(beta, tree):
    one = grouping.shared(lambda x: beta * x)
    return [one(x) for x in tree]

  tree = [jnp.ones((2, 2)), 2 * jnp.ones((2, 2))]
  out = jax.jit(update)(jnp.float32(3.0), tree)
  np.testing.assert_allclose(out[1], 6.0)
  out = jax.jit(update)(jnp.float32(0.5), tree)
  np.testing.assert_allclose(out[0], 0.5)
