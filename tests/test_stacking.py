"""``stack_matrices=True``: the same per-matrix updates with the matrices of every layer
stacked into one state array per parameter (fisher_optax.stacking)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fisher_optax as fo
from fisher_optax import stacking
from tests.util import NAMED_KW, grads_at

# three "layers" of a query kernel, an attention output kernel (heads, head_dim, out) of
# the same matrix size (another group), a bfloat16 kernel; a stack (2, 8, 5) routed as
# two matrices; a vector (fallback)
LAYERS = 3


def _params():
  layers = {i: {"q": jnp.zeros((6, 10)), "o": jnp.zeros((2, 3, 10)),
                "up": jnp.zeros((10, 7), jnp.bfloat16)} for i in range(LAYERS)}
  return {"layers": layers, "stack": jnp.zeros((2, 8, 5)), "b": jnp.zeros((6,))}


def _dims(params):
  def one(path, x):
    if x.ndim < 2:
      return None  # a vector: a MatrixDims here would raise
    if jax.tree_util.keystr(path).endswith("['o']"):
      return fo.MatrixDims(rows=(0, 1), cols=2)
    return fo.MatrixDims()
  return jax.tree_util.tree_map_with_path(one, params)


# methods without random draws; Alice-type methods draw complement directions only when
# leading < rank, so leading = rank makes them deterministic
DETERMINISTIC = {name: kw for name, kw in NAMED_KW.items()
                 if name not in ("apollo", "apollo_mini")}
for _name in ("alice", "alice0", "alice_soap"):
  DETERMINISTIC[_name] = dict(DETERMINISTIC[_name], leading=DETERMINISTIC[_name]["rank"])


def _build(name, kw, stack, params, **extra):
  kw = dict(kw, dims=_dims(params), weight_decay=0.1, stack_matrices=stack, **extra)
  return getattr(fo, name)(0.01, **kw)


def _run(tx, params, steps=5):
  state = tx.init(params)
  step = jax.jit(tx.update)
  outs = []
  for t in range(steps):
    u, state = step(grads_at(params, t), state, params)
    params = optax.apply_updates(params, u)
    outs.append(u)
  return outs, state


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_stacked_updates_equal_per_leaf_updates(name):
  """5 steps (refreshes at 1, 3, 5), weight decay on, mixed float32/bfloat16 leaves."""
  params = _params()
  per_leaf, _ = _run(_build(name, DETERMINISTIC[name], False, params), params)
  stacked, _ = _run(_build(name, DETERMINISTIC[name], True, params), params)
  for t, (a, b) in enumerate(zip(per_leaf, stacked)):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
      assert x.dtype == y.dtype and x.shape == y.shape
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      tol = 1e-2 if "up" in jax.tree_util.keystr(path) else 1e-4  # bfloat16 rounding
      assert np.linalg.norm(x - y) <= tol * np.linalg.norm(x) + 1e-12, (name, t, path)


def test_state_is_one_array_per_parameter_of_a_layer():
  params = _params()
  tx = _build("racs", {}, True, params)
  state = tx.init(params)
  inner = state.inner_states["structured"].inner_state
  assert isinstance(inner, stacking.StackMatricesState)
  s = inner.inner[0].s  # the two-sided scaling's column scales, per group
  assert sorted(s) == ["layers/*/o 6x10", "layers/*/q 6x10", "layers/*/up 10x7",
                       "stack 8x5"]
  assert s["layers/*/q 6x10"].shape == (LAYERS, 10)
  assert s["stack 8x5"].shape == (2, 5)


@pytest.mark.parametrize("name", ["apollo", "apollo_mini", "alice"])
def test_methods_with_random_draws_run_stacked(name):
  """Their draws differ from the per-leaf run's (keys follow the stacked layout): the
  updates are finite, in each leaf's shape and dtype, and as large as the per-leaf
  ones to within the spread of the draws."""
  params = _params()
  kw = NAMED_KW[name]
  per_leaf, _ = _run(_build(name, kw, False, params), params, steps=3)
  stacked, _ = _run(_build(name, kw, True, params), params, steps=3)
  for a, b in zip(jax.tree.leaves(per_leaf[-1]), jax.tree.leaves(stacked[-1])):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bool(jnp.all(jnp.isfinite(b.astype(jnp.float32))))
    na, nb = (float(jnp.linalg.norm(x.astype(jnp.float32))) for x in (a, b))
    assert 0.2 * na <= nb <= 5 * na


def test_grouping_by_parameter_and_size():
  """Digits in the path (``layers/0``, ``block_1``) are one wildcard; the size is part of
  the name, so a parameter whose size changes across layers makes two groups."""
  params = {"block_0": {"w": jnp.zeros((4, 6))}, "block_1": {"w": jnp.zeros((4, 6))},
            "block_2": {"w": jnp.zeros((5, 6))}}
  plan = stacking.plan(params, None)
  assert {k: len(v) for k, v in plan.groups.items()} == {"block_*/w 4x6": 2,
                                                         "block_*/w 5x6": 1}
  x = {"block_0": {"w": jnp.ones((4, 6))}, "block_1": {"w": 2 * jnp.ones((4, 6))},
       "block_2": {"w": 3 * jnp.ones((5, 6))}}
  back = stacking.unstack(plan, stacking.stack(plan, x))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, x))


def test_split_offsets_are_state_read_at_run_time_and_checked():
  """The offsets where ``unstack`` cuts a leaf out of its stack are int32 scalars of the
  state (one kernel per shape instead of one per offset on XLA:CPU); the jitted update
  equals the one cut with static slices, and a state whose offsets were changed by hand
  gives NaN for the cut leaves instead of another layer's update."""
  params = _params()
  tx = _build("racs", {}, True, params)
  state = tx.init(params)
  inner = state.inner_states["structured"].inner_state
  assert [int(x) for x in inner.starts] == list(range(LAYERS))  # "stack" is never cut
  assert all(x.shape == () and x.dtype == jnp.int32 for x in inner.starts)
  g = grads_at(params, 0)
  got, _ = jax.jit(tx.update)(g, state, params)

  static = stacking.unstack  # the static-slice split, as before the offsets were state
  try:
    stacking.unstack = lambda p, stacked, starts=None: static(p, stacked)
    want, _ = tx.update(g, state, params)
  finally:
    stacking.unstack = static
  chex_equal = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want)
  assert jax.tree.all(chex_equal)

  def zero_starts(path, x):
    return jnp.zeros_like(x) if ".starts" in jax.tree_util.keystr(path) else x

  bad, _ = jax.jit(tx.update)(g, jax.tree_util.tree_map_with_path(zero_starts, state), params)
  for i in range(LAYERS):
    for leaf in ("q", "o", "up"):
      assert bool(jnp.all(jnp.isnan(bad["layers"][i][leaf].astype(jnp.float32)))), (i, leaf)
  assert bool(jnp.array_equal(bad["stack"], got["stack"]))  # a whole stack: not cut
  assert bool(jnp.array_equal(bad["b"], got["b"]))  # fallback


def test_a_state_for_another_tree_is_refused():
  params = {"layers": {i: {"q": jnp.zeros((6, 10))} for i in range(3)}}
  tx = stacking.stack_matrices(optax.identity())
  state = tx.init({"layers": {i: params["layers"][i] for i in range(2)}})
  with pytest.raises(ValueError, match="split offsets"):
    tx.update(params, state)


def test_describe_counts_the_same_state():
  params = _params()
  for name in ("racs", "alice", "soap"):
    a = fo.describe(_build(name, NAMED_KW[name], False, params), params)
    b = fo.describe(_build(name, NAMED_KW[name], True, params), params)
    assert [r.state_numbers for r in a.rows] == [r.state_numbers for r in b.rows], name


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
@pytest.mark.parametrize("name", ["racs", "alice"])
def test_stacked_state_shards_like_the_layers_and_runs_sharded(name):
  """Each group's state takes its members' matrix-axis specs (stack axis replicated; for
  a tall ``d`` too, whose low-rank state runs along its columns), and a sharded run on a
  2 x 4 mesh equals the single-device run."""
  params = {"layers": {i: {"q": jnp.zeros((8, 16)), "k": jnp.zeros((8, 16)),
                           "d": jnp.zeros((16, 8))} for i in range(2)}, "b": jnp.zeros((16,))}
  specs = {"layers": {i: {"q": P("fsdp", "tensor"), "k": P("fsdp", "tensor"),
                          "d": P("fsdp", "tensor")} for i in range(2)}, "b": P()}
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  tx = getattr(fo, name)(0.01, **dict(NAMED_KW[name], stack_matrices=True))
  ref = getattr(fo, name)(0.01, **NAMED_KW[name])
  got = fo.state_partition_specs(tx, params, specs, mesh=mesh)
  want = fo.state_partition_specs(ref, params, specs, mesh=mesh)
  for leaf in ("q", "d"):
    stacked = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        got, is_leaf=lambda x: isinstance(x, P)) if f"layers/*/{leaf}" in jax.tree_util.keystr(k)}
    per_leaf = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        want, is_leaf=lambda x: isinstance(x, P)) if f"[0]['{leaf}']" in jax.tree_util.keystr(k)}
    assert len(stacked) == len(per_leaf) > 0
    for (ks, s), (kp, p) in zip(sorted(stacked.items()), sorted(per_leaf.items())):
      assert tuple(s) == ((None,) + tuple(p) if tuple(p) else ()), (ks, s, kp, p)
    assert any(tuple(s) for s in stacked.values())  # something is actually sharded

  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  state_sh = fo.state_shardings(tx, params, specs, mesh)
  grads = [grads_at(params, t) for t in range(3)]

  def run(p, state, sharded):
    step = jax.jit(tx.update, **(dict(in_shardings=(shardings, state_sh, shardings),
                                      out_shardings=(shardings, state_sh)) if sharded else {}))
    for g in grads:
      u, state = step(g, state, p)
      p = optax.apply_updates(p, u)
    return p

  single = run(params, tx.init(params), False)
  p_sh = jax.device_put(params, shardings)
  multi = run(p_sh, jax.jit(tx.init, out_shardings=state_sh)(p_sh), True)
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(multi)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["racs", "alice", "soap"])
def test_a_nan_gradient_stays_in_its_own_matrix_of_the_stack(name):
  """As per leaf: a NaN in layer 0's gradient poisons layer 0 only, not the layers
  stacked with it."""
  params = {"layers": {i: {"q": jax.random.normal(jax.random.PRNGKey(i), (6, 10))}
                       for i in range(3)}}
  tx = getattr(fo, name)(0.01, **dict(NAMED_KW[name], stack_matrices=True))
  state, p = tx.init(params), params
  for t in range(4):
    g = grads_at(params, t)
    if t == 2:
      g["layers"][0]["q"] = g["layers"][0]["q"].at[0, 0].set(jnp.nan)
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
  finite = [bool(jnp.all(jnp.isfinite(p["layers"][i]["q"]))) for i in range(3)]
  assert finite == [False, True, True], (name, finite)


@pytest.mark.parametrize("value", [0.0, 1e-30, 1e30])
def test_zero_tiny_and_huge_gradients_match_the_per_leaf_run(value):
  """Constant gradients at the edges of float32: finite updates, equal to per-leaf."""
  params = {"layers": {i: {"q": jnp.ones((6, 10))} for i in range(3)}}
  grads = jax.tree.map(lambda x: jnp.full_like(x, value), params)
  for name in ("racs", "galore", "soap", "alice"):
    outs = []
    for stack in (False, True):
      tx = getattr(fo, name)(0.01, **dict(DETERMINISTIC[name], stack_matrices=stack))
      state, update = tx.init(params), jax.jit(tx.update)
      for _ in range(3):
        u, state = update(grads, state, params)
      outs.append(u)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
      assert bool(jnp.all(jnp.isfinite(b))), (name, value)
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-12,
                                 err_msg=f"{name} {value}")
