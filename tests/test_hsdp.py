"""Data-parallel replicas of FSDP (a ``data`` x ``fsdp`` mesh, every matrix split over
``fsdp`` and replicated over ``data``) under the owner layout: the split given on
``Auto`` axes sends what the split read from the types of ``Explicit`` axes sends, with
no gather of the state between the replicas; an update's whole-matrix work sends nothing
between them unless asked to spread over them; and the sharded updates are one
device's.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fisher_optax as fo
from benchmarks import collectives
from tests import registry, util

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

SHAPES = {"up": (64, 128), "down": (128, 64), "q": (64, 64), "k": (64, 64)}
# FSDP over "fsdp" on each matrix's larger axis (the rows of a square one)
SPECS = {"up": P(None, "fsdp"), "down": P("fsdp", None), "q": P("fsdp", None),
         "k": P("fsdp", None)}
AXES = {"data": 2, "fsdp": 4}


def _mesh(kind):
  return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))


def _tx(name, owner_layout="auto"):
  extra = dict(rank=4, interval=2) if name == "galore" else {}
  return getattr(fo, name)(0.01, stack_matrices=False, owner_layout=owner_layout,
                           dims={k: fo.MatrixDims() for k in SHAPES}, **extra)


def _given():
  """The split given on ``Auto`` axes, the state placed as ``fo.state_shardings`` says
  (as the Flax recipes and ``util.run_sharded`` place it)."""
  return fo.OwnerLayout(param_specs=SPECS, state_placed=True)


def _sent(name, explicit, layout=None):
  """The ordinary and refresh steps' traffic of the update compiled on the mesh: on
  ``Explicit`` axes with ``init`` of typed shapes (the split read from the types), else
  on ``Auto`` axes with the split given (:func:`_given`); ``layout``: that owner layout
  instead."""
  mesh = _mesh(AxisType.Explicit if explicit else AxisType.Auto)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  p_sh = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  typed = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t, sh)
  with jax.set_mesh(mesh):
    tx = (_tx(name, layout) if layout is not None else _tx(name) if explicit
          else _tx(name, _given()))
    state = jax.eval_shape(tx.init, typed(params, p_sh) if explicit else params)
    s_sh = fo.state_shardings(tx, params, SPECS, mesh)
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    text = step.lower(typed(params, p_sh), typed(state, s_sh),
                      typed(params, p_sh)).compile().as_text()
  return [collectives.traffic(text, 8, refresh=r, mesh_shape=AXES)[0] for r in (False, True)]


@pytest.mark.parametrize("name", ["muon", "galore"])
def test_the_split_given_on_auto_axes_sends_what_the_types_give(name):
  """Given or read, the same bytes within 1%, and over ``data`` alone no more: the
  updates each replica's owners computed, gathered by the other replica. Unpinned, XLA
  computed Muon's momentum on the exchange's slices and gathered the new state over
  ``data``, and a basis the owners returned split over ``data`` went back to the
  state's layout at every step."""
  for given, read in zip(_sent(name, False), _sent(name, True)):
    assert given.total <= 1.01 * read.total, (given.by_axes, read.by_axes)
    assert given.by_axes.get("data", 0) <= 1.01 * read.by_axes.get("data", 0), (
        given.by_axes, read.by_axes)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", ["muon", "galore"])
def test_updates_on_data_replicas_of_fsdp_are_one_devices(name, explicit):
  """5 steps (GaLore refreshing every 2) on the 2 x 4 mesh, the split given on ``Auto``
  axes or read from the types on ``Explicit`` ones, give one device's parameters. The
  gradients have a separated spectrum at the rank: on i.i.d. Gaussian ones, whose spectrum is flat there, a few subspace-iteration
  steps amplify float32 rounding (any change in the order of the sums, a replicated
  tree under the owner layout included) to 0.3 to 0.5% of a 128 x 64 matrix's change."""
  params = util.random_tree(SHAPES, 0, 0.1)
  series = {k: util.structured_grads(s, 5, seed=i, noise=0.01)
            for i, (k, s) in enumerate(SHAPES.items())}
  grads = lambda t: {k: jnp.asarray(g[t], jnp.float32) for k, g in series.items()}  # noqa: E731
  want, _ = util.run_sharded(_tx(name), params, grads, SPECS, 5)
  mesh = _mesh(AxisType.Explicit if explicit else AxisType.Auto)
  with jax.set_mesh(mesh):  # on Explicit axes the split is read from the types
    got, _ = util.run_sharded(_tx(name) if explicit else _tx(name, _given()), params,
                              grads, SPECS, 5, mesh)
  util.assert_close_change(got, want, params, name)


@pytest.mark.parametrize("name", ["muon", "galore"])
def test_bfloat16_parameters_on_data_replicas_of_fsdp(name):
  """bfloat16 parameters and gradients, 3 steps on the 2 x 4 mesh with the split given
  (the owners each replica's devices): the parameters stay bfloat16 and finite, and
  equal one device's bfloat16 run to within one bfloat16 rounding of parameters of 0.1
  (the owners compute in float32 either way)."""
  bf = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # noqa: E731
  params = bf(util.random_tree(SHAPES, 0, 0.1))
  grads = lambda t: bf(util.random_tree(SHAPES, 100 + 7 * t))  # noqa: E731
  want, _ = util.run_sharded(_tx(name), params, grads, SPECS, 3)
  with jax.set_mesh(_mesh(AxisType.Auto)):
    got, _ = util.run_sharded(_tx(name, _given()), params, grads, SPECS, 3,
                              _mesh(AxisType.Auto))
  for k in SHAPES:
    assert got[k].dtype == jnp.bfloat16, k
    a, b = np.asarray(got[k], np.float32), np.asarray(want[k], np.float32)
    assert np.isfinite(a).all(), k
    np.testing.assert_allclose(a, b, rtol=0, atol=2 ** -9, err_msg=k)


def test_the_owners_span_the_axes_the_parameters_are_split_over():
  """Which axes one update's exchange spans: those that split some parameter (and any
  of size one), where that leaves an axis of several devices out; else every axis."""
  hsdp = _mesh(AxisType.Auto)
  known = {k: (SHAPES[k], s) for k, s in SPECS.items()}
  assert fo.parallel.owners.exchange_axes(known, hsdp) == ("fsdp",)
  assert fo.parallel.owners.exchange_axes(None, hsdp) is None
  assert fo.parallel.owners.exchange_axes({"w": ((8, 8), P())}, hsdp) is None
  both = {"w": ((64, 64), P("data", "fsdp"))}
  assert fo.parallel.owners.exchange_axes(both, hsdp) is None
  three = jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"),
                        axis_types=(AxisType.Auto,) * 3)
  assert fo.parallel.owners.exchange_axes(known, three) == ("fsdp", "tensor")


@pytest.mark.parametrize("name", ["muon", pytest.param("soap", marks=pytest.mark.slow)])
def test_axes_of_one_device_beside_the_replicas(name):
  """MaxText names a dozen mesh axes, most of one device: on ``data`` 2 x ``stage`` 1 x
  ``fsdp`` 4 x ``tensor`` 1, the specs naming the axes of one device too, the owners
  are the ``fsdp`` devices (with those axes) and 3 steps give one device's updates."""
  mesh = jax.make_mesh((2, 1, 4, 1), ("data", "stage", "fsdp", "tensor"),
                       axis_types=(AxisType.Auto,) * 4)
  specs = {"up": P("tensor", "fsdp"), "down": P("fsdp", "tensor"), "q": P("fsdp", None),
           "k": P("fsdp", "stage")}
  known = {k: (SHAPES[k], s) for k, s in specs.items()}
  assert fo.parallel.owners.exchange_axes(known, mesh) == ("stage", "fsdp", "tensor")
  params = util.random_tree(SHAPES, 0, 0.1)
  grads = lambda t: util.random_tree(SHAPES, 100 + 7 * t)  # noqa: E731
  want, _ = util.run_sharded(_tx(name), params, grads, specs, 3)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(_tx(name, fo.OwnerLayout(param_specs=specs, state_placed=True)),
                              params, grads, specs, 3, mesh)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6,
                               err_msg=k)


def _by_replicas(traffic):
  """What a device sends in groups that reach the other replica (any group over
  ``data``)."""
  return sum(v for k, v in traffic.by_axes.items() if "data" in k.split("+"))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_whole_matrix_work_sends_nothing_between_the_replicas(name, explicit):
  """By default the owners of one update are each replica's own devices: Muon's and
  NorMuon's update sends nothing in a group that reaches the other replica, and all of
  it within ``fsdp``. ``OwnerLayout(across_replicas=True)`` spreads the work over both
  axes, and then part of the exchange crosses."""
  for t in _sent(name, explicit):
    assert t.total > 0 and _by_replicas(t) == 0, t.by_axes
  across = fo.OwnerLayout(across_replicas=True) if explicit else fo.OwnerLayout(
      param_specs=SPECS, state_placed=True, across_replicas=True)
  for t in _sent(name, explicit, across):
    assert _by_replicas(t) > 0, t.by_axes


def test_state_on_the_owners_within_each_replica():
  """``OwnerLayout(state_axes=("fsdp",))``: SOAP's state kept on the owners is padded for
  the 4 devices of a replica and split over ``fsdp`` alone (``fo.state_shardings`` says
  so), and its update sends nothing in a group that reaches the other replica, on
  ``Auto`` axes with the split given and on ``Explicit`` ones; with the state over every
  device (the default) part of it does."""
  mesh = _mesh(AxisType.Auto)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  layout = fo.OwnerLayout(param_specs=SPECS, state_placed=True, state_axes=("fsdp",))
  with jax.set_mesh(mesh):
    tx = _tx("soap", layout)
    shapes = jax.eval_shape(tx.init, params)
  specs = fo.state_partition_specs(tx, params, SPECS, mesh=mesh)
  owned = [(jax.tree_util.keystr(p), x.shape, sp) for (p, x), sp in zip(
      jax.tree_util.tree_leaves_with_path(shapes),
      jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))) if "owned" in
      jax.tree_util.keystr(p) and x.ndim == 3]
  assert owned
  for path, shape, sp in owned:
    assert shape[0] % 4 == 0 and shape[0] % 8 and tuple(sp) == ("fsdp",), (path, shape, sp)
  # the split given on Auto axes, or read from the types of Explicit ones
  for explicit, within in ((False, layout), (True, fo.OwnerLayout(state_axes=("fsdp",)))):
    for t in _sent("soap", explicit, within):
      assert t.total > 0 and _by_replicas(t) == 0, (explicit, t.by_axes)
    for t in _sent("soap", explicit):
      assert _by_replicas(t) > 0, (explicit, t.by_axes)


@pytest.mark.parametrize("name", ["soap", "galore"])
def test_a_state_over_every_device_converts_to_one_within_each_replica(name):
  """``fo.convert_state_layout`` takes a state kept on the owners over all 8 devices
  (after a step) to the layout of the same optimizer with ``state_axes=("fsdp",)``
  (SOAP's stacks padded for 4), and the next update is the same."""
  mesh = _mesh(AxisType.Auto)
  placed = lambda t: {k: jax.device_put(x, NamedSharding(mesh, SPECS[k]))  # noqa: E731
                      for k, x in t.items()}
  params, grads = placed(util.random_tree(SHAPES, 0, 0.1)), placed(util.random_tree(SHAPES, 5))
  extra = dict(state_on_owners=True) if name == "galore" else {}
  with jax.set_mesh(mesh):
    every = _tx(name, fo.OwnerLayout(param_specs=SPECS, state_placed=True, **extra))
    within = _tx(name, fo.OwnerLayout(param_specs=SPECS, state_placed=True,
                                      state_axes=("fsdp",), **extra))
    _, state = jax.jit(every.update)(grads, jax.jit(every.init)(params), params)
    moved = fo.convert_state_layout(state, within, params)
    want = jax.eval_shape(within.init, params)
    assert jax.tree.structure(moved) == jax.tree.structure(want)
    assert [x.shape for x in jax.tree.leaves(moved)] == [x.shape for x in jax.tree.leaves(want)]
    if name == "soap":  # its stacks padded for 4 devices, not 8 (GaLore's keep the
      # leaves' shapes: the device count only places them)
      assert ([x.shape for x in jax.tree.leaves(moved)]
              != [x.shape for x in jax.tree.leaves(state)])
    a, _ = jax.jit(every.update)(grads, state, params)
    b, _ = jax.jit(within.update)(grads, moved, params)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), rtol=1e-5, atol=1e-7,
                               err_msg=k)


def test_state_axes_name_axes_of_the_mesh():
  """An axis the mesh lacks is an error that names the mesh's axes, given with the mesh
  or found when the optimizer is built under one."""
  mesh = _mesh(AxisType.Auto)
  with pytest.raises(ValueError, match=r"no axis 'model'.*\('data', 'fsdp'\)"):
    fo.OwnerLayout(mesh=mesh, state_axes=("model",))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"no axis 'model'"):
    _tx("soap", fo.OwnerLayout(state_axes="model"))
  with pytest.raises(ValueError, match="mesh axis names"):
    fo.OwnerLayout(state_axes=(1,))


def _traced(tx, mesh):
  """Traces ``tx``'s update of the test tree under ``mesh`` (the context mesh), the
  parameters laid out by the module's specs."""
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  p_sh = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  with jax.set_mesh(mesh):
    state = jax.eval_shape(tx.init, params)
    jax.jit(tx.update, in_shardings=(p_sh, None, p_sh)).lower(params, state, params)


def test_a_split_guessed_on_a_mesh_of_several_axes_is_warned():
  """On ``Auto`` axes with nothing naming the split, the update guesses Megatron's
  layout, wrong for data-parallel replicas of FSDP: a ``GuessedSplitWarning`` names the
  fixes. Not with the split given, nor with ``guessed=True``, nor with the layout off,
  nor on a mesh of one axis (FSDP's split)."""
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    guessed = _tx("muon")
  with pytest.warns(fo.GuessedSplitWarning, match=r"param_specs.*Explicit axes.*boxes"):
    _traced(guessed, mesh)
  one = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(one):
    on_one = _tx("muon")
  for tx, m in [(_tx("muon", _given()), mesh), (_tx("muon", fo.OwnerLayout(guessed=True)), mesh),
                (_tx("muon", False), mesh), (on_one, one)]:
    with warnings.catch_warnings():
      warnings.simplefilter("error", fo.GuessedSplitWarning)
      _traced(tx, m)


_REFERENCE = [pytest.param(n, marks=() if n in ("galore", "normuon") else pytest.mark.slow)
              for n in ("galore", "alice", "alice_soap", "normuon", "soap")]


_SETTINGS = {"replica": {}, "across": dict(across_replicas=True),
             # the state on each replica's devices; the low-rank family's asked for there
             "state": dict(state_axes=("fsdp",))}


@pytest.mark.parametrize("setting", list(_SETTINGS))
@pytest.mark.parametrize("name", _REFERENCE)
def test_updates_on_data_replicas_of_fsdp_match_the_dense_float64_reference(name, setting):
  """16 matrices 8 x 24 (SOAP: 16 x 16) split on their rows over ``fsdp`` and replicated
  over ``data`` (the owners each replica's devices; with ``across_replicas`` spread over
  both axes; with ``state_axes=("fsdp",)`` the state on the owners within each replica
  too), the split given on ``Auto`` axes, 7
  steps with refreshes where the method has them: every update equals the dense float64
  re-derivation of the paper's equations (``tests/reference.py``) within 2e-4, as the
  owners' other reference tests hold them."""
  # SOAP on square matrices: the larger side's statistic of an 8 x 24 matrix is singular
  # after one gradient, and any basis of its null space is an eigenbasis
  shape, spec = (16, 16, 16) if name == "soap" else (16, 8, 24), P(None, "fsdp", None)
  grads = util.structured_grads(shape, 7, seed=1)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    extra = dict(_SETTINGS[setting])
    if setting == "state" and name in ("galore", "alice", "alice_soap"):
      extra["state_on_owners"] = True
    tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw, owner_layout=fo.OwnerLayout(
        param_specs={"w": spec}, state_placed=True, **extra))
    got = util.updates_on_mesh(tx, shape, grads, mesh, spec)
  for t, (a, b) in enumerate(zip(got, want), start=1):  # SOAP's first update is zero
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
    assert err < 2e-4, f"{name} step {t}: relative error {err:.2e}"


def test_zero_and_nan_gradients_stay_in_their_leaf_on_data_replicas_of_fsdp():
  """Muon and GaLore on the 2 x 4 mesh, the split given: a zero gradient leaves its leaf
  unchanged, a NaN one makes all of its leaf NaN and no other, as on one device."""
  shapes = {"w": (64, 64), "stack": (64, 128)}
  specs = {"w": P("fsdp", None), "stack": P(None, "fsdp")}
  params = lambda: util.random_tree(shapes, 0, 0.1)  # noqa: E731
  grads = lambda t: util.random_tree(shapes, 100 + 7 * t)  # noqa: E731
  for name in ("muon", "galore"):
    tx = getattr(fo, name)(0.01, stack_matrices=False,
                           dims={k: fo.MatrixDims() for k in shapes},
                           owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True))
    # GaLore's refresh sums a Gram over the devices in another order than one device:
    # its float32 updates of parameters of 0.1 differ by up to 2e-5 with finite
    # gradients too (Adam on coefficients near zero), whichever devices own
    util.assert_zero_and_nan_stay_in_their_leaf(tx, shapes, params, grads, specs,
                                                _mesh(AxisType.Auto),
                                                atol=5e-5 if name == "galore" else 1e-6)
