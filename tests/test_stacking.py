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
from tests import registry
from tests.util import grads_at

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


@pytest.mark.parametrize("name", registry.params(
    [n for n in registry.NAMES if n not in registry.RANDOM],
    default=["galore"]))
def test_stacked_updates_equal_per_leaf_updates(name):
  """5 steps (refreshes at 1, 3, 5), weight decay on, mixed float32/bfloat16 leaves; the
  optimizers without random draws (or with their draws switched off)."""
  params = _params()
  kw = registry.kwargs(name, draw_free=True)
  per_leaf, _ = _run(_build(name, kw, False, params), params)
  stacked, _ = _run(_build(name, kw, True, params), params)
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


@pytest.mark.parametrize("name", registry.params(
    [n for n in registry.NAMES if registry.CASES[n].draws],
    default=["apollo"]))
def test_methods_with_random_draws_run_stacked(name):
  """Their draws differ from the per-leaf run's (keys follow the stacked layout): the
  updates are finite, in each leaf's shape and dtype, and as large as the per-leaf
  ones to within the spread of the draws."""
  params = _params()
  kw = registry.kwargs(name)
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


def test_stacked_state_holds_statistics_only():
  """Under ``stack_matrices`` the state is the inner rule's statistics per stack: no
  layout arrays (every array is float32 or a step counter)."""
  params = _params()
  state = _build("racs", {}, True, params).init(params)
  inner = state.inner_states["structured"].inner_state
  assert isinstance(inner, stacking.StackMatricesState)
  for x in jax.tree.leaves(inner):
    assert x.dtype == jnp.float32 or (x.dtype == jnp.int32 and x.shape == ()), x


# ------------------------------------------------------------ stack_matrices="auto"


def test_auto_layout_follows_the_backend():
  """``"auto"`` (the default) stacks on GPU/TPU and not on CPU; True/False are kept."""
  import os
  from fisher_optax import stacking
  forced = os.environ.get("FISHER_OPTAX_TEST_AUTO_LAYOUT")  # tests/conftest.py
  auto = forced == "stacked" if forced else jax.default_backend() != "cpu"
  assert stacking.resolve("auto") == auto
  assert stacking.resolve(True) is True and stacking.resolve(False) is False
  assert stacking.is_stacked(fo.racs(1e-2)) == auto
  assert stacking.is_stacked(fo.alice(1e-2, rank=2, stack_matrices=True))
  with pytest.raises(ValueError, match="True, False or 'auto'"):
    fo.racs(1e-2, stack_matrices="yes")


@pytest.mark.parametrize("saved", [True, False])
def test_a_state_of_the_other_layout_names_the_setting_that_continues_it(saved):
  params = {"layers_0": {"w": jnp.ones((4, 6))}, "layers_1": {"w": jnp.ones((4, 6))}}
  grads = jax.tree.map(lambda p: 0.1 * p, params)
  state = fo.racs(1e-2, stack_matrices=saved).init(params)
  other = fo.racs(1e-2, stack_matrices=not saved)
  with pytest.raises(ValueError, match=f"build it with stack_matrices={saved}"):
    other.update(grads, state, params)
  # the layout it names continues the state
  fo.racs(1e-2, stack_matrices=saved).update(grads, state, params)


# ------------------------------------------------------------ converting a checkpoint


def _same(a, b):
  return jax.tree.all(jax.tree.map(
      lambda x, y: x.dtype == y.dtype and x.shape == y.shape and bool(jnp.array_equal(x, y)),
      a, b))


def _close_updates(a, b, name, t):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    tol = 1e-2 if "up" in jax.tree_util.keystr(path) else 1e-4  # bfloat16 rounding
    assert np.linalg.norm(x - y) <= tol * np.linalg.norm(x) + 1e-12, (name, t, path)


@pytest.mark.parametrize("saved", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize("name", registry.params(
    [n for n in registry.NAMES if n not in registry.RANDOM], default=["racs"]))
def test_a_converted_state_continues_as_in_the_layout_it_was_saved_in(name, saved):
  """3 steps in one layout, the state converted, 3 more in the other: the updates of the
  last 3 are those of 6 steps in the first layout (refreshes at 1, 3, 5 cross it)."""
  params = _params()
  kw = registry.kwargs(name, draw_free=True)
  source, target = _build(name, kw, saved, params), _build(name, kw, not saved, params)
  reference, _ = _run(source, params, steps=6)
  state, step = source.init(params), jax.jit(source.update)
  p = params
  for t in range(3):
    u, state = step(grads_at(p, t), state, p)
    p = optax.apply_updates(p, u)
  state = fo.convert_state_layout(state, target, params)
  assert jax.tree.structure(state) == jax.tree.structure(target.init(params))
  step = jax.jit(target.update)
  for t in range(3, 6):
    u, state = step(grads_at(p, t), state, p)
    p = optax.apply_updates(p, u)
    _close_updates(reference[t], u, name, t)


@pytest.mark.parametrize("name", registry.params(
    registry.NAMES, default=["apollo"]))
def test_converting_there_and_back_returns_the_state(name):
  """Every named optimizer, random draws included: per-leaf -> stacked -> per-leaf and
  stacked -> per-leaf -> stacked give back the very arrays; a state already in the
  target's layout is returned as it is."""
  params = _params()
  kw = registry.kwargs(name)
  per_leaf, stacked = _build(name, kw, False, params), _build(name, kw, True, params)
  for tx, other in ((per_leaf, stacked), (stacked, per_leaf)):
    _, state = _run(tx, params, steps=2)
    moved = fo.convert_state_layout(state, other, params)
    assert jax.tree.structure(moved) == jax.tree.structure(other.init(params))
    assert _same(fo.convert_state_layout(moved, tx, params), state)
    assert _same(fo.convert_state_layout(state, tx, params), state)


def test_a_group_holds_its_members_in_plan_order():
  """The stacked array of a group is its members' per-leaf arrays, one row per matrix:
  ``layers/*/q`` holds layer 0, 1, 2; the routed ``(2, 8, 5)`` stack gives two rows."""
  params = _params()
  per_leaf, stacked = _build("racs", {}, False, params), _build("racs", {}, True, params)
  _, state = _run(per_leaf, params, steps=2)
  moved = fo.convert_state_layout(state, stacked, params)
  s_leaf = state.inner_states["structured"].inner_state[0].s
  s_stack = moved.inner_states["structured"].inner_state.inner[0].s
  for i in range(LAYERS):
    np.testing.assert_array_equal(s_stack["layers/*/q 6x10"][i], s_leaf["layers"][i]["q"])
  np.testing.assert_array_equal(s_stack["stack 8x5"], s_leaf["stack"])


def test_conversion_sees_through_wrappers():
  """Inside ``inject_hyperparams``, ``MultiSteps`` and a chain, as ``describe`` does."""
  params = _params()
  dims = _dims(params)

  def build(stack):
    inner = fo.inject_hyperparams(fo.racs)(learning_rate=0.01, dims=dims,
                                           stack_matrices=stack)
    return optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), inner), 2)

  source, target = build(True), build(False)
  state = source.init(params)
  state, _ = jax.jit(source.update)(grads_at(params, 0), state, params)[::-1]
  moved = fo.convert_state_layout(state, target, params)
  assert jax.tree.structure(moved) == jax.tree.structure(target.init(params))
  jax.jit(target.update)(grads_at(params, 1), moved, params)
  assert _same(fo.convert_state_layout(moved, source, params), state)


def test_conversion_of_a_state_boxed_in_nnx_variables():
  """Parameters in ``nnx.Variable`` s (an NNX model's ``nnx.state``), the state boxed as
  ``tx.init`` names it for them or not boxed (as a checkpoint may hold it): the state
  converts, boxed as the target's ``init`` boxes it, with the values of the unboxed
  conversion."""
  from flax import nnx

  params = _params()
  boxed = jax.tree.map(nnx.Param, params)
  per_leaf, stacked = _build("racs", {}, False, params), _build("racs", {}, True, params)
  _, state = _run(per_leaf, params, steps=2)
  want = fo.convert_state_layout(state, stacked, params)
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  for given in (state, fo.parallel.variables.rewrap_like(per_leaf.init(boxed), state)):
    moved = fo.convert_state_layout(given, stacked, boxed)
    assert (jax.tree.structure(moved, is_leaf=is_var)
            == jax.tree.structure(stacked.init(boxed), is_leaf=is_var))
    assert any(is_var(x) for x in jax.tree.leaves(moved, is_leaf=is_var))
    assert _same(fo.parallel.variables.unwrap(moved), want)


def test_conversion_errors_name_the_problem():
  params = _params()
  state = _build("racs", {}, True, params).init(params)
  with pytest.raises(ValueError, match="holds no fisher_optax named optimizer"):
    fo.convert_state_layout(state, optax.adam(1e-3), params)
  other = {"layers": {i: {"q": jnp.zeros((6, 10))} for i in range(LAYERS)}}
  with pytest.raises(ValueError, match=r"convert_state_layout: .* not one of this optimizer"):
    fo.convert_state_layout(state, _build("alice", {"rank": 2}, False, params), params)
  with pytest.raises(ValueError, match="convert_state_layout"):
    fo.convert_state_layout(state, fo.racs(0.01, stack_matrices=False), other)
  # a stacked state whose stacks are not the target's: other matrix axes for "o"
  dims = jax.tree_util.tree_map_with_path(
      lambda path, d: fo.MatrixDims(rows=0, cols=(1, 2)) if "'o'" in
      jax.tree_util.keystr(path) else d, _dims(params),
      is_leaf=lambda d: isinstance(d, fo.MatrixDims))
  other_axes = fo.racs(0.01, stack_matrices=False, dims=dims, weight_decay=0.1)
  with pytest.raises(ValueError, match=r"dict with keys \['layers/\*/o 6x10'"):
    fo.convert_state_layout(state, other_axes, params)


def test_a_checkpoint_saved_stacked_restores_per_leaf(tmp_path):
  """The documented way across backends: orbax restores with the saved layout's
  abstract state, then the state is converted and training goes on."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = _params()
  saved_tx, tx = _build("racs", {}, True, params), _build("racs", {}, False, params)
  _, state = _run(saved_tx, params, steps=2)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state", jax.eval_shape(saved_tx.init, params))
  moved = fo.convert_state_layout(restored, tx, params)
  u, _ = jax.jit(tx.update)(grads_at(params, 2), moved, params)
  assert jax.tree.all(jax.tree.map(lambda x: bool(jnp.all(jnp.isfinite(x))), u))


@pytest.mark.slow
def test_a_stack_of_one_matrix_runs_unbatched_with_the_same_updates():
  """A parameter no other layer shares (an output layer) is a stack of one matrix in the
  stacked layout; it is run on the matrix itself, not ``vmap``-ed over an axis of one
  (``grouping.vmap_batch``), with the per-leaf layout's updates."""
  from fisher_optax import grouping
  jaxpr = jax.make_jaxpr(grouping.vmap_batch(lambda x: jnp.sum(x * x, axis=0), 1))(
      jnp.ones((1, 6, 20)))
  reduce_in = [e.invars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "reduce_sum"]
  assert reduce_in == [(6, 20)]
  jaxpr2 = jax.make_jaxpr(grouping.vmap_batch(lambda x: jnp.sum(x * x, axis=0), 1))(
      jnp.ones((2, 6, 20)))
  assert [e.invars[0].aval.shape for e in jaxpr2.eqns
          if e.primitive.name == "reduce_sum"] == [(2, 6, 20)]
  # square matrices: from the first step SOAP's statistics on both sides have full rank,
  # so its update is a continuous function of the gradients. With a 6 x 20 head the
  # 20 x 20 statistics were rank-deficient for three steps; in their null space any basis
  # is an eigenbasis, Adam's per-coordinate scaling makes the update depend on which one
  # float32 rounding picked, and the two layouts' updates differed by 1e-3 when XLA:CPU
  # compiled at its own settings (optimization level 3, fusion emitters) instead of this
  # suite's: other rounding of the same computation
  params = {"head": jnp.zeros((6, 6)),
            "layers": {i: {"q": jnp.zeros((10, 10))} for i in range(2)}}
  for name in ("racs", "alice", "soap"):
    kw = dict(registry.kwargs(name, draw_free=True), stack_matrices=False)
    per_leaf, _ = _run(getattr(fo, name)(0.01, **kw), params)
    stacked, _ = _run(getattr(fo, name)(0.01, **dict(kw, stack_matrices=True)), params)
    for t, (a, b) in enumerate(zip(per_leaf, stacked)):
      _close_updates(a, b, name, t)
