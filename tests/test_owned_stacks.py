"""The low-rank family's state on the matrices' owners across steps
(``fo.OwnerLayout(state_on_owners=True)``, ``fisher_optax/owned_stacks.py``)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fisher_optax as fo
from benchmarks import collectives
from tests import registry, util
from tests.test_owner_state import _mesh  # the 4 x 2 (fsdp, tensor) mesh
from tests.test_sharding import _free_port

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

# 8 + 1 matrices of 16 x 32 and 4 of 32 x 16 (split on their 16 side: they move, the
# 32 x 16 ones held transposed beside the others, 13 in a stack of 16 slots), one square
# (a stack of 8 slots, one of them real), a 128 x 16 matrix split on its larger side
# (it stays where its shards are), a vector on the fallback
PARAMS = {"stack": (8, 16, 32), "w": (16, 32), "t": (4, 32, 16), "sq": (16, 16),
          "tall": (128, 16), "b": (16,)}
SPECS = {"stack": P(None, "fsdp", "tensor"), "w": P("fsdp", "tensor"),
         "t": P(None, "tensor", "fsdp"), "sq": P("tensor", "fsdp"),
         "tall": P(("fsdp", "tensor")), "b": P("tensor")}
DIMS = {k: (None if len(s) < 2 else fo.MatrixDims()) for k, s in PARAMS.items()}
LOW_RANK = ["galore", "fira", "alice", "alice0", "alice_soap"]


def _params():
  return util.random_tree(PARAMS, 0, 0.1)


def _grads(t):
  return util.random_tree(PARAMS, 100 + 7 * t)


def _layout(**kw):
  return fo.OwnerLayout(state_on_owners=True, **kw)


def _tx(name, owner, **kw):
  """``name`` on the test tree at rank 8 (refreshes at steps 1, 3 and 5), per leaf on one
  device with ``owner`` ``False``. At rank 8 of 16 the model of what each way sends
  moves the 16-sided matrices (``owned_stacks._moving_sizes``); at the registry's rank 3
  they would stay where their shards are."""
  return getattr(fo, name)(0.01, dims=DIMS, owner_layout=owner,
                           **{**registry.kwargs(name, dims=None, rank=8), "interval": 2,
                              "stack_matrices": False, **kw})


def _run(tx, steps, mesh=None, params=None, state=None, start=0, donate=False):
  return util.run_sharded(tx, _params() if params is None else params, _grads, SPECS, steps,
                          mesh, state, start, donate)


def _close(got, want, what, tol=1e-3):
  util.assert_close_change(got, want, _params(), what, tol)


def _owned_state(state):
  return state.inner_states["structured"].inner_state


_EQUAL = [pytest.param(name, how, marks=() if (name, how) in {
    ("galore", "given"), ("alice", "explicit"), ("fira", "default")} else pytest.mark.slow)
          for name in LOW_RANK for how in ("given", "explicit", "default")]


@pytest.mark.parametrize("name,how", _EQUAL)
def test_state_on_owners_gives_the_single_device_updates(name, how):
  """5 steps (refreshes at 1, 3, 5) on the 4 x 2 mesh, the split given on ``Auto`` axes
  or read from ``Explicit`` ones (asked for, or by default: ``init`` reads the split
  from the parameters' types), the state on its owners: the updates of one device with
  the state per leaf, random draws included (Alice's and Alice-0's switching); the
  parameters keep their shardings; the moved matrices' stacks are split over the mesh on
  their slots; and on one device the same state gives those updates too."""
  explicit = how != "given"
  mesh = _mesh(explicit)
  want, _ = _run(_tx(name, False), 5)
  with jax.set_mesh(mesh):
    tx = (_tx(name, "auto") if how == "default" else
          _tx(name, _layout(param_specs=None if explicit else SPECS, state_placed=True)))
  alone, _ = _run(tx, 5)
  _close(alone, want, f"{name}, owned state on one device")
  with jax.set_mesh(mesh):
    got, state = _run(tx, 5, mesh)
  _close(got, want, f"{name}, owned state on the mesh")
  spec = jax.typeof(got["w"]).sharding.spec if explicit else got["w"].sharding.spec
  assert spec == SPECS["w"]
  owned = _owned_state(state)
  assert isinstance(owned, fo.OwnedStacksState)
  assert sorted(owned.owned) == ["16x16", "16x32"]  # "tall" stays where its shards are
  stacks = [x for x in jax.tree.leaves(owned.owned) if x.ndim >= 3]
  assert stacks and {x.shape[0] for x in stacks} == {8, 16}
  for x in stacks:
    assert x.sharding.spec == P(("fsdp", "tensor")), x.sharding


_REFERENCE = [pytest.param(name, how, marks=() if (name, how) in {
    ("alice", "asked"), ("alice", "default")} else pytest.mark.slow)
              for name in ["galore", "alice", "alice0", "alice_soap"]
              for how in ("asked", "default")]


@pytest.mark.parametrize("name,how", _REFERENCE)
def test_state_on_owners_matches_the_dense_float64_reference(name, how):
  """16 matrices 8 x 24 (two per device), 7 steps, refreshes at 1, 4 and 7, the state on
  the owners (asked for on the ``Auto`` 4 x 2 mesh, or by default on the ``Explicit``
  one, ``init`` reading the split from the types): every update equals the dense float64
  re-derivation of the paper's tracking, switching and compensation
  (``tests/reference.py``) to float32 rounding."""
  shape = (16, 8, 24)
  grads = util.structured_grads(shape, 7, seed=1)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  explicit = how == "default"
  mesh = _mesh(explicit)
  spec = P(None, "fsdp", "tensor")
  with jax.set_mesh(mesh):
    tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw,
                           owner_layout="auto" if explicit else _layout())
  w = jax.ShapeDtypeStruct(shape, jnp.float32,
                           sharding=NamedSharding(mesh, spec) if explicit else None)
  state = jax.eval_shape(tx.init, {"w": w})
  assert list(_owned_state(state).owned) == ["8x24"]  # the 16 matrices move
  with jax.set_mesh(mesh):
    got = util.updates_on_mesh(tx, shape, grads, mesh, spec)
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


def _compiled_text(tx, mesh, lowered=False):
  """The update's program after SPMD partitioning (``lowered``: as JAX lowered it)."""
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in PARAMS.items()}
  p_sh = {k: NamedSharding(mesh, v) for k, v in SPECS.items()}
  s_sh = fo.state_shardings(tx, params, SPECS, mesh)
  state = jax.eval_shape(tx.init, params)
  typed = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t, sh)
  with jax.set_mesh(mesh):
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    low = step.lower(typed(params, p_sh), typed(state, s_sh), typed(params, p_sh))
    return low.as_text() if lowered else low.compile().as_text()


@pytest.mark.parametrize("name", ["galore", "alice"])
def test_an_ordinary_step_moves_the_matrices_by_two_all_to_alls(name):
  """On the 4 x 2 mesh (split given), an ordinary step of the state on the owners sends
  the moved matrices in one all-to-all and their updates back in another, and a few
  hundred bytes besides (Alice's compensation of the matrix that stays sums its
  statistics): less than the state laid out as the parameters sends."""
  mesh = _mesh()
  given = dict(param_specs=SPECS, state_placed=True)
  with jax.set_mesh(mesh):
    owned = _tx(name, _layout(**given))
    per_leaf = _tx(name, fo.OwnerLayout(**given, state_on_owners=False))
  sent = {}
  for what, tx in (("owned", owned), ("per leaf", per_leaf)):
    traffic, _ = collectives.traffic(_compiled_text(tx, mesh), 8, refresh=False)
    sent[what] = traffic
  kinds = sent["owned"].sent
  assert sent["owned"].total - kinds["all-to-all"] <= 512, kinds  # Alice: 455 bytes
  # each row of the exchange holds the most one owner owns (two 16 x 32 matrices), a
  # device's eighth of them from each of the 8 devices
  assert kinds["all-to-all"] <= 2 * 2 * 16 * 32 * 4 * 7 / 8 * 1.01, kinds
  assert sent["owned"].total < sent["per leaf"].total, sent


def test_a_prng_key_stays_whole_on_a_mesh_of_two_devices():
  """Alice's PRNG key (two words) is no stack of slots: on a mesh of 2 devices, which
  divide its length, ``fo.state_shardings`` keeps it whole, and 5 steps give the
  single-device updates."""
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  specs = {"w": P("fsdp"), "t": P(None, None, "fsdp")}
  shapes = {"w": (16, 32), "t": (4, 32, 16)}
  params = lambda: util.random_tree(shapes, 0, 0.1)  # noqa: E731
  grads = lambda t: util.random_tree(shapes, 100 + 7 * t)  # noqa: E731
  kw = {**registry.kwargs("alice", dims=None, rank=8), "interval": 2}
  dims = {k: fo.MatrixDims() for k in shapes}
  want, _ = util.run_sharded(fo.alice(0.01, dims=dims, **kw, owner_layout=False),
                             params(), grads, specs, 5)
  with jax.set_mesh(mesh):
    tx = fo.alice(0.01, dims=dims, **kw, owner_layout=_layout(param_specs=specs))
    got, state = util.run_sharded(tx, params(), grads, specs, 5, mesh)
  util.assert_close_change(got, want, params(), "alice on 2 devices")
  keys = [x for x in jax.tree.leaves(_owned_state(state).owned) if x.dtype == jnp.uint32]
  assert keys and all(x.sharding.spec == P() for x in keys), [x.sharding for x in keys]


def test_the_owned_state_checkpoints_and_resumes_on_one_device_and_a_smaller_mesh(tmp_path):
  """GaLore stopped after 2 steps on the 4 x 2 mesh, saved with orbax, restored onto a
  2 x 2 mesh and onto one device: both continuations (the refreshes at 3 and 5 among
  them) give the uninterrupted single-device run."""
  mesh = _mesh()
  want, _ = _run(_tx("galore", False), 5)
  with jax.set_mesh(mesh):
    tx = _tx("galore", _layout(param_specs=SPECS, state_placed=True))
  got, got1 = util.resume_elsewhere(tmp_path / "ck", tx, _run, SPECS, mesh, 2, 3,
                                    one_device_mesh=True)
  _close(got, want, "4x2 -> 2x2")
  _close(got1, want, "4x2 -> 1")


@pytest.mark.slow
def test_zero_and_nan_gradients_stay_in_their_leaf_with_the_state_on_owners():
  """A zero gradient leaves its parameter unchanged and a NaN gradient makes only its
  own leaf NaN, on the mesh as on one device (the padding slots hold zeros)."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    tx = _tx("alice", _layout(param_specs=SPECS, state_placed=True))
  util.assert_zero_and_nan_stay_in_their_leaf(tx, PARAMS, _params, _grads, SPECS, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name,scale", [("galore", 1e-30), ("alice", 1e-30),
                                        ("galore", 1e18), ("alice", 1e18)])
def test_tiny_and_huge_gradients_with_the_state_on_owners(name, scale):
  """Gradients near 1e-30 and 1e18, 3 steps (a refresh at 1 and 3) on the 4 x 2 mesh
  with the state on the owners: finite parameters, those of one device with the state
  per leaf."""
  mesh = _mesh()
  grads = lambda t: jax.tree.map(lambda g: g * scale, _grads(t))  # noqa: E731
  want, _ = util.run_sharded(_tx(name, False), _params(), grads, SPECS, 3)
  with jax.set_mesh(mesh):
    tx = _tx(name, _layout(param_specs=SPECS, state_placed=True))
    got, state = util.run_sharded(tx, _params(), grads, SPECS, 3, mesh)
  assert sorted(_owned_state(state).owned) == ["16x16", "16x32"]
  for k in PARAMS:
    assert np.isfinite(np.asarray(got[k])).all(), k
  _close(got, want, f"{name}, gradients times {scale}")


def test_describe_counts_the_owned_stacks_with_their_padding():
  """``fo.describe`` gives each moved leaf its share of the stack of its size, padding
  included: the single 16 x 16 matrix carries its stack of 8 slots."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    tx = _tx("galore", _layout(param_specs=SPECS))
  rows = {r.path: r for r in fo.describe(tx, _params()).rows}
  plain = {r.path: r for r in fo.describe(_tx("galore", False), _params()).rows}
  assert rows["sq"].state_numbers == 8 * plain["sq"].state_numbers + 2  # + two counters
  assert rows["tall"].state_numbers == plain["tall"].state_numbers  # where its shards are
  assert rows["b"].state_numbers == plain["b"].state_numbers


def test_built_under_a_mesh_the_state_is_on_owners_where_that_sends_less():
  """By default (``state_on_owners="auto"``): built under the 4 x 2 mesh with the split
  given, GaLore keeps its state on the owners at rank 8, and as the parameters at rank
  3, where the model says the 16-sided matrices send less where their shards are; as
  the parameters too where the split would be guessed on the two-axis mesh, where it is
  built without a mesh, and for parameters replicated over ``Explicit`` axes (a mesh of
  one axis, the split of sharded ones given). Where the state is as the parameters, it is the per-leaf state of
  ``owner_layout=False`` (one checkpoint fits both)."""
  params = _params()
  per_leaf = jax.tree.structure(_tx("galore", False).init(params))
  with jax.set_mesh(_mesh()):
    tx = _tx("galore", fo.OwnerLayout(param_specs=SPECS))
    low = _tx("galore", fo.OwnerLayout(param_specs=SPECS), rank=3)
    guessed = _tx("galore", "auto")
  state = jax.eval_shape(tx.init, params)
  assert sorted(_owned_state(state).owned) == ["16x16", "16x32"]
  assert jax.tree.structure(jax.eval_shape(low.init, params)) == \
      jax.tree.structure(_tx("galore", False, rank=3).init(params))
  assert jax.tree.structure(jax.eval_shape(guessed.init, params)) == per_leaf
  assert jax.tree.structure(_tx("galore", "auto").init(params)) == per_leaf
  fsdp = {"stack": P(None, "fsdp"), "w": P("fsdp"), "t": P(None, None, "fsdp"),
          "sq": P("fsdp"), "tall": P("fsdp"), "b": P()}
  one_axis = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(one_axis):
    tx = _tx("galore", fo.OwnerLayout(param_specs=fsdp))
    sharded = jax.device_put(params, {k: NamedSharding(one_axis, v) for k, v in fsdp.items()})
    assert isinstance(_owned_state(tx.init(sharded)), fo.OwnedStacksState)
    replicated = jax.device_put(params, NamedSharding(one_axis, P()))
    assert jax.tree.structure(tx.init(replicated)) == per_leaf
  # on Explicit axes of several, init reads the split from the parameters' types; an
  # init that cannot see it (untyped shapes outside the mesh) keeps the per-leaf state,
  # and fo.state_shardings traces init with the types its specs give
  two_axes = _mesh(explicit=True)
  with jax.set_mesh(two_axes):
    tx = _tx("galore", "auto")
    sharded = jax.device_put(params, {k: NamedSharding(two_axes, v) for k, v in SPECS.items()})
    state = tx.init(sharded)
    assert sorted(_owned_state(state).owned) == ["16x16", "16x32"]
    assert jax.tree.structure(tx.init(params)) == per_leaf  # replicated
  assert jax.tree.structure(jax.eval_shape(tx.init, params)) == per_leaf
  assert (jax.tree.structure(fo.state_shardings(tx, params, SPECS, two_axes))
          == jax.tree.structure(state))
  # on Auto axes of several the boxes' names are read at init (tests/test_nnx_sharding.py),
  # except where the matrices are stacked: there it is decided when built, stacked
  with jax.set_mesh(_mesh()):
    assert _tx("galore", "auto").info["owned_devices"] == 8
    assert _tx("galore", "auto", stack_matrices=True).info["owned_devices"] is None
  # an abstract init of shapes typed on the mesh, outside its context, reads them too
  typed = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(two_axes, SPECS[k]))
           for k, x in params.items()}
  assert jax.tree.structure(jax.eval_shape(tx.init, typed)) == jax.tree.structure(state)


def test_where_it_cannot_be_done_it_says_so():
  """Asked of an optimizer outside the low-rank family, or with no mesh to pad for, the
  setting raises an error that names the fix; a state of the other layout is refused
  by the update (the named optimizers' check of the state's tree), and one of other
  hyperparameters by ``fo.convert_state_layout``."""
  with pytest.raises(ValueError, match="low-rank family"):
    fo.racs(0.01, owner_layout=_layout())
  with pytest.raises(ValueError, match="jax.set_mesh"):
    fo.galore(0.01, rank=2, owner_layout=_layout())
  with jax.set_mesh(_mesh()):
    tx = _tx("galore", _layout())
  per_leaf = _tx("galore", False)
  params = _params()
  with pytest.raises(ValueError, match="does not fit these updates"):
    tx.update(_grads(0), per_leaf.init(params), params)
  with pytest.raises(ValueError, match="not one of this optimizer's"):
    fo.convert_state_layout(_tx("galore", False, rank=4).init(params), tx, params)


@pytest.mark.parametrize("name", registry.params(LOW_RANK, default=["galore"]))
def test_convert_state_layout_moves_the_state_to_and_from_the_owners(name):
  """``fo.convert_state_layout`` between the state on the owners (4 x 2 mesh, split
  given) and the state laid out as the parameters: a fresh ``init`` converts exactly into
  the other layout's; per leaf -> owners -> per leaf returns the state unchanged; a
  per-leaf state after 3 steps continued on the owners for 2 (the refresh at 5 among
  them), and an owned one continued per leaf in the stacked layout (``stack_matrices``)
  or on the owners of 4 devices, give the uninterrupted per-leaf run's updates (random
  draws included: Alice's and Alice-0's switching)."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    tx = _tx(name, _layout(param_specs=SPECS, state_placed=True))
  four = jax.make_mesh((4, 1), ("fsdp", "tensor"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(four):
    tx4 = _tx(name, _layout(param_specs=SPECS, state_placed=True))
  util.check_state_conversion(name, tx, tx4, _tx(name, False),
                              _tx(name, False, stack_matrices=True), mesh, _run, _close,
                              _params(), _owned_state)


def test_convert_state_layout_on_explicit_mesh_axes():
  """A state on the owners of an ``Explicit`` 4 x 2 mesh (its arrays typed by their
  shardings) converts to the per-leaf state under that mesh and outside it (to the same
  values), and back; continued per leaf on one device it gives the uninterrupted run."""
  mesh = _mesh(explicit=True)
  with jax.set_mesh(mesh):
    tx = _tx("galore", _layout(state_placed=True))
  per_leaf, params = _tx("galore", False), _params()
  want, _ = _run(per_leaf, 5)
  with jax.set_mesh(mesh):
    q3, t3 = _run(tx, 3, mesh)
    inside = fo.convert_state_layout(t3, per_leaf, params)
    assert isinstance(_owned_state(fo.convert_state_layout(inside, tx, params)),
                      fo.OwnedStacksState)
  outside = fo.convert_state_layout(t3, per_leaf, params)
  assert util.same_arrays(jax.device_get(inside), jax.device_get(outside))
  got, _ = _run(per_leaf, 2, params=jax.device_get(q3), state=jax.device_get(outside),
                start=3)
  _close(got, want, "explicit owners -> per leaf")


# bfloat16 and float32 matrices of one size, a leaf of 3 matrices, a leaf of none and a
# vector, split over 8 devices of one axis
MIXED_SHAPES = {"a": (64, 64), "b": (64, 64), "c": (3, 64, 64), "z": (0, 64), "n": (64,)}
MIXED_DTYPES = {"a": jnp.bfloat16, "b": jnp.float32, "c": jnp.bfloat16, "z": jnp.float32,
                "n": jnp.float32}
MIXED_SPECS = {"a": P("fsdp"), "b": P("fsdp"), "c": P(None, "fsdp"), "z": P(None, "fsdp"),
               "n": P()}
MIXED_DIMS = {k: (None if len(s) < 2 else fo.MatrixDims()) for k, s in MIXED_SHAPES.items()}


def _mixed_tree(seed, scale=1.0):
  return {k: x.astype(MIXED_DTYPES[k])
          for k, x in util.random_tree(MIXED_SHAPES, seed, scale).items()}


def _one_axis_mesh():
  return jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore", "alice"])
def test_mixed_dtypes_a_batched_leaf_and_an_empty_leaf_on_the_owners(name):
  """bfloat16 and float32 matrices of one size in one stack, a leaf of 3 matrices and a
  leaf of none, on 8 devices of one axis (split given): over 5 steps (refreshes at 1, 3,
  5) every update is in its leaf's dtype and equals one device's with the per-leaf
  state, to two bfloat16 roundings of its largest entry for the bfloat16 leaves (the
  float32 mathematics summed in another order, then rounded)."""
  mesh = _one_axis_mesh()
  shapes, dtypes, specs, dims = MIXED_SHAPES, MIXED_DTYPES, MIXED_SPECS, MIXED_DIMS
  tree = _mixed_tree

  params, grads = tree(0, 0.1), [tree(100 + t) for t in range(5)]
  kw = dict(rank=32, interval=2, dims=dims)
  ref = getattr(fo, name)(0.01, **kw, owner_layout=False)
  state, want = ref.init(params), []
  for g in grads:
    u, state = ref.update(g, state, params)
    want.append(u)
  with jax.set_mesh(mesh):
    tx = getattr(fo, name)(0.01, **kw, owner_layout=_layout(param_specs=specs))
  sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  s_sh = fo.state_shardings(tx, params, specs, mesh)
  placed = jax.device_put(params, sh)
  state = jax.jit(tx.init, out_shardings=s_sh)(placed)
  assert list(_owned_state(state).owned) == ["64x64"]
  with jax.set_mesh(mesh):
    step = jax.jit(tx.update, in_shardings=(sh, s_sh, sh), out_shardings=(sh, s_sh))
    for g, w in zip(grads, want):
      u, state = step(jax.device_put(g, sh), state, placed)
      for k in shapes:
        assert u[k].dtype == dtypes[k], k
        if not u[k].size:
          continue
        a, b = (np.asarray(x, np.float64) for x in (u[k], w[k]))
        ulp = 2.0 ** -7 if dtypes[k] == jnp.bfloat16 else 1e-5
        assert np.max(np.abs(a - b)) <= 2 * ulp * np.max(np.abs(b)), (k, np.max(np.abs(a - b)))


_UPDATES_ON_A_MESH = r"""
import sys
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
process, processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                             num_processes=processes, process_id=process)
import fisher_optax as fo
mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
shapes = {f"l{i}": {"q": (128, 128), "up": (128, 344), "down": (344, 128)} for i in range(4)}
tup = lambda x: isinstance(x, tuple)
rs = np.random.RandomState(0)
draw = lambda s: rs.standard_normal(s).astype(np.float32)
params = jax.tree.map(lambda s: 0.05 * draw(s), shapes, is_leaf=tup)
grads = [jax.tree.map(draw, shapes, is_leaf=tup) for _ in range(4)]
specs = jax.tree.map(lambda s: P("fsdp", "tensor"), shapes, is_leaf=tup)
p_sh = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs, is_leaf=lambda x: isinstance(x, P))
put = lambda t: jax.tree.map(
    lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i: x[i]), t, p_sh)
saved = {}
for name in ("galore", "alice"):
  with jax.set_mesh(mesh):
    tx = getattr(fo, name)(0.01, rank=32, interval=2,
                           owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True))
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    state = jax.jit(tx.init, out_shardings=s_sh)(put(params))
    assert isinstance(state.inner_states["structured"].inner_state, fo.OwnedStacksState)
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    for t, g in enumerate(grads):
      u, state = step(put(g), state, put(params))
      for path, x in jax.tree_util.tree_flatten_with_path(u)[0]:
        saved[f"{name} {t} {jax.tree_util.keystr(path)}"] = np.asarray(
            multihost_utils.process_allgather(x, tiled=True))
if process == 0:
  np.savez(out, **saved)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name,tol", [("galore", 0.3), ("alice", 0.05)])
def test_bfloat16_transport_with_the_state_on_owners(name, tol):
  """``OwnerLayout(transport_dtype=jnp.bfloat16)`` with the state on the owners: the
  program JAX lowers sends the matrices to and from their owners as bfloat16 (XLA:CPU
  then converts its all-to-alls to float32, so the CPU measurement cannot show the
  halved bytes), and 5 steps stay finite and near one device's float32 run: the
  parameters differ from it by 0.15 (GaLore, whose first steps are nearly the
  coefficients' signs) and 0.024 (Alice) of their change, measured (norms, worst leaf)."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    tx = _tx(name, _layout(param_specs=SPECS, state_placed=True,
                           transport_dtype=jnp.bfloat16))
  text = _compiled_text(tx, mesh, lowered=True)
  moves = [line for line in text.splitlines() if "all_to_all" in line]
  assert len(moves) == 2 and all("xbf16>" in line for line in moves), moves
  want, _ = _run(_tx(name, False), 5)
  with jax.set_mesh(mesh):
    got, _ = _run(tx, 5, mesh)
  for k in PARAMS:
    assert np.isfinite(np.asarray(got[k])).all(), k
  _close(got, want, f"{name}, bfloat16 transport", tol)


@pytest.mark.slow  # three fresh processes (~40 s)
def test_two_processes_give_the_one_process_updates(tmp_path):
  """GaLore and Alice with their state on the owners of a data 2 x FSDP 4 mesh that spans
  2 processes of 4 CPU devices (``jax.distributed``, gloo): 4 updates (refreshes at 0
  and 2, Alice's switching draws) equal those of 1 process of 8 devices. Each matrix is
  moved whole and updated on its owner, so no sum is taken across processes and the two
  agree to float32 rounding (measured: bitwise). A LLaMA run compares less tightly: its
  gradients are summed across processes, and GaLore's first steps, nearly the signs of
  the coefficients, turn that rounding into eval losses 0.003 apart after 2 steps."""
  script = tmp_path / "updates.py"
  script.write_text(_UPDATES_ON_A_MESH)
  def devices(n):
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")

  subprocess.run([sys.executable, str(script), "0", "1", "0", str(tmp_path / "one.npz")],
                 env=devices(8), check=True, capture_output=True, timeout=util.HANG_S)
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, str(script), str(i), "2", port,
                             str(tmp_path / "two.npz")], env=devices(4),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
  for p in procs:
    out, _ = p.communicate(timeout=util.HANG_S)
    assert p.returncode == 0, out.decode()[-3000:]
  one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
  assert sorted(one.files) == sorted(two.files) and len(one.files) == 2 * 4 * 12
  for k in one.files:
    scale = np.abs(one[k]).max()
    assert scale > 0 and np.abs(two[k] - one[k]).max() <= 1e-6 * scale, k


@pytest.mark.slow
def test_convert_state_layout_with_mixed_dtypes_a_batched_leaf_an_empty_leaf_and_nans():
  """bfloat16 and float32 matrices of one size, a leaf of 3 matrices and a leaf of none,
  on the owners of 8 devices: after 3 steps per leaf the state converts onto the owners
  and back unchanged, continues there as one device's run does (within a bfloat16
  rounding of its largest entry, measured: one), the empty leaf stays empty, and a state
  of NaNs converts to NaNs."""
  mesh = _one_axis_mesh()
  dtypes, specs, dims, tree = MIXED_DTYPES, MIXED_SPECS, MIXED_DIMS, _mixed_tree

  def make(owner):
    return fo.galore(0.01, rank=32, interval=2, dims=dims, stack_matrices=False,
                     owner_layout=owner)

  with jax.set_mesh(mesh):
    tx = make(_layout(param_specs=specs))
  per_leaf, params, grads = make(False), tree(0, 0.1), lambda t: tree(100 + t)
  p3, s3 = util.run_sharded(per_leaf, params, grads, specs, 3)
  on_owners = fo.convert_state_layout(s3, tx, params)
  assert isinstance(_owned_state(on_owners), fo.OwnedStacksState)
  assert util.same_arrays(fo.convert_state_layout(on_owners, per_leaf, params), s3)
  want, _ = util.run_sharded(per_leaf, params, grads, specs, 5)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(tx, p3, grads, specs, 2, mesh, state=on_owners, start=3)
  for k in ("a", "b", "c"):
    assert got[k].dtype == dtypes[k]
    diff = jnp.abs(got[k].astype(jnp.float32) - want[k].astype(jnp.float32)).max()
    assert diff <= 2.0 ** -8 * jnp.abs(want[k].astype(jnp.float32)).max(), (k, diff)
  assert got["z"].shape == (0, 64)
  nans = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.ndim >= 2 else x, s3)
  back = fo.convert_state_layout(fo.convert_state_layout(nans, tx, params), per_leaf, params)
  assert all(bool(jnp.isnan(x).all()) for x in jax.tree.leaves(back) if x.ndim >= 2 and x.size)
