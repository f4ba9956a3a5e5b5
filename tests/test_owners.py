"""The owner layout (``owner_layout=``): whole-matrix work on the matrices' owner devices
gives the single-device updates, sends less, and changes nothing without a mesh that
shards the matrices."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fisher_optax as fo
from benchmarks import collectives
from fisher_optax import linalg
from fisher_optax.parallel import owners, packed
from tests import reference, registry, util

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

# same-shape matrices: 8 + 1 of 16 x 32 (9: not a multiple of the 8 devices, padded),
# 4 of 32 x 16, one square; every matrix split over both mesh axes
PARAMS = {"stack": (8, 16, 32), "w": (16, 32), "t": (4, 32, 16), "sq": (16, 16), "b": (16,)}
SPECS = {"stack": P(None, "fsdp", "tensor"), "w": P("fsdp", "tensor"),
         "t": P(None, "tensor", "fsdp"), "sq": P("tensor", "fsdp"), "b": P("tensor")}
DIMS = {"stack": fo.MatrixDims(), "w": fo.MatrixDims(), "t": fo.MatrixDims(),
        "sq": fo.MatrixDims(), "b": None}
ON_BY_DEFAULT = ["muon", "normuon", "swan", "galore", "fira", "alice", "alice0", "apollo",
                 "eigen_adam"]


def _params():
  return util.random_tree(PARAMS, 0, 0.1)


def _grads(t):
  return util.random_tree(PARAMS, 100 + 7 * t)


def _tx(name, **kw):
  return getattr(fo, name)(0.01, dims=DIMS, **{**registry.kwargs(name, dims=None), **kw})


def _mesh(explicit=False, data=False):
  """4 x 2 (fsdp, tensor), or with ``data`` 2 x 2 x 2 (data, fsdp, tensor): a matrix
  axis then goes to its owners over two mesh axes."""
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  if data:
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)
  return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(kind, kind))


def _run(tx, steps, mesh=None, params=None, state=None, start=0, donate=False):
  return util.run_sharded(tx, _params() if params is None else params, _grads, SPECS, steps,
                          mesh, state, start, donate)


def _close(got, want, what, tol=1e-3):
  util.assert_close_change(got, want, _params(), what, tol)


@pytest.mark.parametrize("name", registry.params(ON_BY_DEFAULT, default=["galore"]))
@pytest.mark.parametrize("explicit,data", [(False, False),
                                           pytest.param(True, False, marks=pytest.mark.slow),
                                           pytest.param(False, True, marks=pytest.mark.slow)],
                         ids=["auto_axes", "explicit_axes", "data_fsdp_tensor"])
def test_owner_layout_gives_the_single_device_updates(name, explicit, data):
  """4 steps (refreshes at 1 and 3 where the optimizer has them: interval 2) under ``jax.set_mesh``,
  the owner layout on by default: the updates of one device; the parameters keep their
  shardings."""
  tx = _tx(name)
  single, _ = _run(tx, 4)
  mesh = _mesh(explicit, data)
  with jax.set_mesh(mesh):
    sharded, _ = _run(tx, 4, mesh)
  _close(sharded, single, name)
  spec = (jax.typeof(sharded["w"]).sharding.spec if explicit else sharded["w"].sharding.spec)
  assert spec == SPECS["w"]


@pytest.mark.parametrize("name", registry.params(ON_BY_DEFAULT, default=["galore"]))
def test_donated_state_under_the_owner_layout_gives_the_single_device_updates(name):
  """The step donating the parameters and the state, as a training step does (XLA writes
  the new state into the old one's buffers, through the refresh's conditional): 4 steps
  (refreshes at 1 and 3 where the optimizer has them) under ``jax.set_mesh`` give the
  updates of one device, and XLA could use every donated buffer (JAX warns of any it
  could not)."""
  import warnings
  tx = _tx(name)
  single, _ = _run(tx, 4)
  mesh = _mesh()
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*donated buffers were not usable")
    sharded, _ = _run(tx, 4, mesh, donate=True)
  _close(sharded, single, name)


@pytest.mark.slow
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_alice_soap_on_owners_gives_the_single_device_updates(explicit):
  """Alice-SOAP on the owners: its two tracked bases refresh there with the updates of
  one device (on ``Explicit`` axes each from its parameter's split, the coefficients
  laid out from it, the larger side's basis pinned where the state keeps it)."""
  tx = _tx("alice_soap", owner_layout=True)
  single, _ = _run(tx, 4)
  mesh = _mesh(explicit)
  with jax.set_mesh(mesh):
    sharded, _ = _run(tx, 4, mesh)
  _close(sharded, single, "alice_soap")


@pytest.mark.slow
def test_alice_soap_takes_the_owner_layout_where_the_split_is_known():
  """Alice-SOAP's default: the owner layout where each matrix's split is known
  (``Explicit`` axes, given specs) or right to guess (a mesh of one axis, FSDP), off
  where it would be guessed on a mesh of several axes (a wrong guess moves its bases at
  every step): the lowered programs are those of ``True`` and ``False``."""
  lowered = lambda tx, mesh, **kw: _compiled(tx, mesh, compile=False, **kw)  # noqa: E731
  default, on, off = (_tx("alice_soap"), _tx("alice_soap", owner_layout=True),
                      _tx("alice_soap", owner_layout=False))
  mesh = _mesh()
  assert lowered(default, mesh) == lowered(off, mesh) != lowered(on, mesh)
  emesh = _mesh(explicit=True)
  assert lowered(default, emesh) == lowered(on, emesh) != lowered(off, emesh)
  given = _tx("alice_soap", owner_layout=fo.OwnerLayout(param_specs=SPECS, guessed=False))
  assert lowered(given, mesh) != lowered(off, mesh)
  fsdp = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  one_axis = {"stack": P(None, None, "fsdp"), "w": P(None, "fsdp"), "t": P(None, "fsdp"),
              "sq": P("fsdp"), "b": P()}
  assert (lowered(default, fsdp, specs=one_axis) == lowered(on, fsdp, specs=one_axis)
          != lowered(off, fsdp, specs=one_axis))


def test_coefficients_are_laid_out_from_their_gradient_split():
  """``sigma = U^T G`` keeps its gradient's column split (``r`` whole), which the blocks
  on the coefficients then read (``leaf_specs``): known, guessed where nothing is known
  of the gradient on a mesh of one axis; on every device where the columns are
  whole."""
  shapes = {"w": (16, 32), "sq": (16, 16), "rows": (16, 32)}
  specs = {"w": P("fsdp", "tensor"), "sq": P("tensor", "fsdp"), "rows": P("fsdp")}
  views = [fo.matrices.matrix_view(shapes[k], fo.MatrixDims()) for k in sorted(shapes)]
  coeffs = {k: jnp.zeros((4, shapes[k][1])) for k in shapes}
  mesh = _mesh()
  known = {k: (tuple(shapes[k[2:-2]]), sp) for k, sp in owners.path_specs(specs).items()}
  found = {}

  def derive(c, table):
    with owners.using(mesh, None, table):
      out, found["derived"] = owners.coefficient_layout(c, views)
      with owners.deriving(found["derived"]):
        found["read"] = owners.leaf_specs(c)
    return out

  with jax.set_mesh(mesh):
    jax.jit(lambda c: derive(c, known)).lower(coeffs)
    # rows, sq, w: summed over split rows, whole columns leave sigma on every device
    assert found["read"] == [P(None, None), P(None, "fsdp"), P(None, "tensor")]
    jax.jit(lambda c: derive(c, None)).lower(coeffs)
    assert found["read"] == [None] * 3  # not guessed on a mesh of several axes
  fsdp = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  mesh = fsdp
  with jax.set_mesh(fsdp):
    jax.jit(lambda c: derive(c, None)).lower(coeffs)
    # guessed on a mesh of one axis: FSDP's split, the larger side
    assert found["read"] == [P(None, "fsdp"), P(None, None), P(None, "fsdp")]


def _compiled(tx, mesh, specs=SPECS, context=True, compile=True):
  params = _params()
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  s_sh = fo.state_shardings(tx, params, specs, mesh)
  state = jax.eval_shape(tx.init, params)
  shaped = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t, sh)
  step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
  args = (shaped(params, p_sh), shaped(state, s_sh), shaped(params, p_sh))
  text = lambda lowered: (lowered.compile() if compile else lowered).as_text()  # noqa: E731
  if context:
    with jax.set_mesh(mesh):
      return text(step.lower(*args))
  return text(step.lower(*args))


@pytest.mark.parametrize("name", ["muon", "galore"])
def test_owner_layout_sends_less_than_the_parameter_layout(name):
  """Read from the compiled update (8 devices): each device sends fewer bytes on a refresh
  step, in less than half as many collectives (Newton--Schulz and the refresh run with
  none inside their loops). The LLaMA shapes' figures are in the docs' table."""
  mesh = _mesh()
  on, off = _compiled(_tx(name), mesh), _compiled(_tx(name, owner_layout=False), mesh)
  sent_on = collectives.traffic(on, 8, refresh=True)[0]
  sent_off = collectives.traffic(off, 8, refresh=True)[0]
  assert sent_on.total < sent_off.total, (sent_on.total, sent_off.total)
  assert sent_on.collectives < 0.5 * sent_off.collectives


def test_view_split_reads_each_leaf_split_onto_its_canonical_matrices():
  """A leaf's ``PartitionSpec`` on its canonical ``[matrices, m, n]`` stack: its matrix
  axes' mesh axes (swapped where the view transposes), mesh axes it is replicated over
  added where they divide, ``[]`` for a replicated leaf, ``None`` (guess) where a batch
  axis is split or nothing is known."""
  from fisher_optax import matrices
  mesh = _mesh()
  view = lambda shape, **kw: matrices.matrix_view(shape, fo.MatrixDims(), **kw)  # noqa: E731
  with owners.using(mesh):
    assert owners.view_split(view((16, 32)), P("fsdp", "tensor")) == [(1, "fsdp"),
                                                                       (2, "tensor")]
    assert owners.view_split(view((4, 32, 16)), P(None, "tensor", "fsdp")) == [
        (1, "tensor"), (2, "fsdp")]
    t = view((32, 16), smaller_first=True)
    assert t.transpose and owners.view_split(t, P("fsdp", "tensor")) == [(1, "tensor"),
                                                                        (2, "fsdp")]
    assert owners.view_split(view((16, 32)), P("fsdp")) == [(1, "fsdp"), (1, "tensor")]
    assert owners.view_split(view((16, 32)), P()) == []
    assert owners.view_split(view((4, 32, 16)), P("fsdp", None, "tensor")) is None
    assert owners.view_split(view((16, 32)), None) is None
  # guessed from the shape: column-parallel where it divides, else row-parallel
  assert owners._matrix_split((1, 16, 32), mesh) == [(1, "fsdp"), (2, "tensor")]
  assert owners._matrix_split((1, 6, 8), mesh) == [(1, "tensor"), (2, "fsdp")]
  assert owners._matrix_split((1, 6, 6), mesh) is None
  with owners.using(_mesh(data=True)):
    assert owners.view_split(view((16, 32)), P("fsdp", "tensor")) == [
        (1, "fsdp"), (1, "data"), (2, "tensor")]
  # a mesh axis of size one splits nothing, a layer axis named by it included (MaxText)
  with owners.using(jax.make_mesh((4, 2, 1), ("fsdp", "tensor", "stage"),
                                  axis_types=(jax.sharding.AxisType.Auto,) * 3)):
    assert owners.view_split(view((3, 16, 32)), P("stage", "fsdp", "tensor")) == [
        (1, "fsdp"), (1, "stage"), (2, "tensor")]
    assert owners.view_split(view((16, 32)), P("elsewhere")) is None


# row- and column-parallel matrices of one shape (tensor parallelism's layouts)
SPLIT_SPECS = {"a": P("fsdp", "tensor"), "b": P("tensor", "fsdp"),
               "c": P(None, "tensor", "fsdp"), "d": P("fsdp", "tensor")}
SPLIT_SHAPES = {"a": (16, 32), "b": (16, 32), "c": (3, 16, 32), "d": (16, 32)}


def _split_muon(**kw):
  return fo.muon(0.01, dims={k: fo.MatrixDims() for k in SPLIT_SHAPES}, stack_matrices=False,
                 **kw)


def _shaped(tree, shardings):
  """``tree`` as ``jax.ShapeDtypeStruct`` s placed by ``shardings``."""
  return jax.tree.map(lambda x, z: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=z), tree,
                      shardings)


def test_row_and_column_parallel_matrices_travel_from_their_own_split():
  """Same-shape matrices split differently (tensor parallelism's column- and row-parallel
  layouts): on ``Explicit`` axes the owner layout reads each gradient's split from its
  type, and on ``Auto`` axes from ``OwnerLayout(param_specs=...)``; Muon's update is
  then the two packed exchanges and nothing else. Guessed from the shapes, XLA moves
  the row-parallel ones once more on the way."""
  specs, params = SPLIT_SPECS, util.random_tree(SPLIT_SHAPES, 0, 0.1)

  def sent(tx, mesh):
    p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    with jax.set_mesh(mesh):
      text = step.lower(_shaped(params, p_sh), _shaped(jax.eval_shape(tx.init, params), s_sh),
                        _shaped(params, p_sh)).compile().as_text()
    return collectives.traffic(text, 8, refresh=False)[0]

  muon = _split_muon
  read = sent(muon(), _mesh(explicit=True))
  given = sent(muon(owner_layout=fo.OwnerLayout(param_specs=specs)), _mesh())
  guessed = sent(muon(), _mesh())
  assert read.collectives == given.collectives == 2, (read.sent, given.sent)
  assert read.total == given.total < guessed.total, (read.total, given.total, guessed.total)


def test_the_split_the_boxes_given_to_init_name_is_read():
  """The Flax recipes give ``init`` the parameters in boxes named by mesh axes: on
  ``Auto`` axes the owner layout then reads each matrix's split from those names, and
  Muon's update of row- and column-parallel matrices of one shape is the two packed
  exchanges, as with the specs given. Boxes named by logical axes are read through the
  logical axis rules in force at an ``init`` (kept when the same names are initialised
  again outside them, as MaxText does); with none in force the split is guessed, and XLA
  moves the row-parallel ones once more."""
  from benchmarks import collectives as bench
  specs, params, muon, shaped = (SPLIT_SPECS, util.random_tree(SPLIT_SHAPES, 0, 0.1),
                                 _split_muon, _shaped)
  logical = {"a": ("embed", "mlp"), "b": ("mlp", "embed"), "c": (None, "mlp", "embed"),
             "d": ("embed", "mlp")}
  mesh = _mesh()
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}

  def sent(tx, names=None):
    if names is None:  # the state laid out by the names its own boxes carry
      state, s_sh = bench._boxed_init(tx, params, specs, mesh)
    else:
      with jax.set_mesh(mesh):
        tx.init(collectives.boxed(params, names))
      state, s_sh = jax.eval_shape(tx.init, params), fo.state_shardings(tx, params, specs, mesh)
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    with jax.set_mesh(mesh):
      text = step.lower(shaped(params, p_sh), shaped(state, s_sh),
                        shaped(params, p_sh)).compile().as_text()
    return collectives.traffic(text, 8, refresh=False)[0]

  boxed = sent(muon())
  given = sent(muon(owner_layout=fo.OwnerLayout(param_specs=specs)), names=specs)
  guessed = sent(muon(), names=logical)
  assert boxed.collectives == given.collectives == 2, (boxed.sent, given.sent)
  assert boxed.total == given.total < guessed.total, (boxed.total, given.total, guessed.total)
  # logical names with their rules in force at an init (MaxText initialises under them,
  # and again outside them): read through the rules
  import flax.linen as nn
  tx = muon()
  with nn.logical_axis_rules((("embed", "fsdp"), ("mlp", "tensor"))):
    tx.init(collectives.boxed(params, logical))
  assert sent(tx, names=logical).total == given.total


@pytest.mark.slow
def test_the_split_of_arrays_placed_on_the_mesh_is_read_at_init():
  """Parameters placed by ``NamedSharding`` s (``jax.device_put``) and initialised as they
  are, on ``Auto`` axes: the owner layout reads each matrix's split from them, and Muon's
  update of row- and column-parallel matrices of one shape is the two packed exchanges,
  as with the specs given (guessed, XLA moves the row-parallel ones once more). Placed
  whole on every device (data parallelism), Muon sends less than guessed, and SOAP, its
  state on the owners, what the guess sends. An abstract ``init`` reads nothing."""
  specs, shapes, muon, shaped = SPLIT_SPECS, SPLIT_SHAPES, _split_muon, _shaped
  params = util.random_tree(shapes, 0, 0.1)
  mesh = _mesh()
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}

  def program(tx, placed=None, sh=p_sh):
    if placed is not None:
      tx.init(jax.device_put(params, placed))
    s_sh = fo.state_shardings(tx, params, {k: sh[k].spec for k in sh}, mesh)
    step = jax.jit(tx.update, in_shardings=(sh, s_sh, sh), out_shardings=(sh, s_sh))
    with jax.set_mesh(mesh):
      return step.lower(shaped(params, sh), shaped(jax.eval_shape(tx.init, params), s_sh),
                        shaped(params, sh)).compile().as_text()

  sent = lambda text: collectives.traffic(text, 8, refresh=False)[0]  # noqa: E731
  read = sent(program(muon(), p_sh))
  given = sent(program(muon(owner_layout=fo.OwnerLayout(param_specs=specs))))
  guessed = sent(program(muon()))
  assert read.collectives == given.collectives == 2, (read.sent, given.sent)
  assert read.total == given.total < guessed.total, (read.total, given.total, guessed.total)
  abstract = muon()
  jax.eval_shape(abstract.init, shaped(params, p_sh))
  assert sent(program(abstract)).total == guessed.total
  # placed whole on every device (data parallelism): known to be replicated, Muon's
  # matrices are taken where they are and only the results travel; SOAP's, whose state
  # is on the owners, travel as the guess sends them
  whole = {k: NamedSharding(mesh, P()) for k in shapes}
  assert sent(program(muon(), whole, whole)).total < sent(program(muon(), sh=whole)).total
  soap = lambda: fo.soap(0.01, dims={k: fo.MatrixDims() for k in shapes},  # noqa: E731
                         stack_matrices=False, precondition_frequency=2)
  with jax.set_mesh(mesh):
    placed, guessed = soap(), soap()
  assert (sent(program(placed, whole, whole)).total
          == sent(program(guessed, sh=whole)).total), "SOAP, data parallel"


def test_boxes_named_on_the_mesh_say_where_the_state_is():
  """Boxes named by mesh axes under the mesh ``init`` runs on: the state's own boxes then
  carry ``fo.state_shardings``' names, and the update relies on them as
  ``OwnerLayout(param_specs=..., state_placed=True)`` does -- GaLore moves a row-split
  gradient to its columns: the same program, sending less than without that statement.
  Named without a mesh, the state's layout is not relied on."""
  from benchmarks import collectives as bench
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  params = util.random_tree(RELAY_PARAMS, 0, 0.1)
  state, s_sh = bench._boxed_init(_relay_tx("galore"), params, RELAY_SPECS, auto)
  want = fo.state_shardings(_relay_tx("galore"), params, RELAY_SPECS, auto)
  assert all(jax.tree.leaves(jax.tree.map(lambda x, a, b: a.is_equivalent_to(b, x.ndim),
                                          state, s_sh, want)))

  def program(tx, boxes_mesh):
    with jax.set_mesh(boxes_mesh) if boxes_mesh is not None else contextlib.nullcontext():
      tx.init(collectives.boxed(params, RELAY_SPECS))
    return _relay_program(tx, auto)

  placed = lambda: _relay_tx("galore")  # noqa: E731
  said = _relay_program(fo.galore(0.01, rank=16, interval=2, stack_matrices=False,
                                  dims={k: fo.MatrixDims() for k in RELAY_PARAMS},
                                  owner_layout=fo.OwnerLayout(param_specs=RELAY_SPECS,
                                                              state_placed=True)), auto)
  on_mesh = program(placed(), auto)
  no_mesh = program(placed(), None)
  moved, unsaid = (collectives.traffic(t, 8, refresh=False)[0] for t in (on_mesh, no_mesh))
  assert moved.total == collectives.traffic(said, 8, refresh=False)[0].total
  assert moved.count["all-to-all"] > unsaid.count["all-to-all"], (moved.sent, unsaid.sent)
  assert moved.total < unsaid.total, (moved.total, unsaid.total)


@pytest.mark.slow
def test_given_param_specs_give_the_single_device_updates():
  """GaLore (refreshes at 1 and 3) on ``Auto`` axes with the parameters' specs given to
  the owner layout: each matrix and basis travels from its own split, with the updates
  of one device."""
  tx = _tx("galore", owner_layout=fo.OwnerLayout(param_specs=SPECS))
  single, _ = _run(_tx("galore"), 4)
  with jax.set_mesh(_mesh()):
    sharded, _ = _run(tx, 4, _mesh())
  _close(sharded, single, "galore")


def test_a_mesh_given_to_the_optimizer_needs_no_context_mesh():
  mesh = _mesh()
  on = _compiled(_tx("muon", owner_layout=mesh), mesh, context=False)
  off = _compiled(_tx("muon", owner_layout=False), mesh, context=False)
  assert (collectives.traffic(on, 8, refresh=False)[0].total
          < 0.5 * collectives.traffic(off, 8, refresh=False)[0].total)


def test_nothing_changes_without_a_mesh_that_shards_the_matrices():
  """No context mesh, and an ``Explicit`` mesh with replicated parameters (data
  parallelism): the compiled update is the one with the owner layout off."""
  mesh = _mesh()
  assert _compiled(_tx("muon"), mesh, context=False, compile=False) == \
      _compiled(_tx("muon", owner_layout=False), mesh, context=False, compile=False)
  replicated = {k: P() for k in SPECS}
  emesh = _mesh(explicit=True)
  assert _compiled(_tx("muon"), emesh, replicated, compile=False) == \
      _compiled(_tx("muon", owner_layout=False), emesh, replicated, compile=False)
  params = _params()
  one = jax.jit(_tx("muon").update).lower(params, _tx("muon").init(params), params)
  off = jax.jit(_tx("muon", owner_layout=False).update).lower(
      params, _tx("muon").init(params), params)
  assert one.as_text() == off.as_text()


def test_the_state_is_the_same_with_and_without_the_owner_layout():
  params = _params()
  on, off = _tx("galore").init(params), _tx("galore", owner_layout=False).init(params)
  assert jax.tree.structure(on) == jax.tree.structure(off)
  assert jax.tree.map(jnp.shape, on) == jax.tree.map(jnp.shape, off)


def test_a_wrong_setting_is_an_error_that_names_the_values():
  with pytest.raises(ValueError, match="True, False, .auto., a jax.sharding.Mesh or a"):
    _tx("muon", owner_layout="on")


def test_map_whole_pads_and_cuts_a_stack_that_the_devices_do_not_divide():
  """5 matrices on 8 devices: padded with copies of the last, each computed by its owner,
  cut back to 5; the same values as one device."""
  mesh = _mesh()
  x = jax.random.normal(jax.random.PRNGKey(0), (5, 8, 16))
  fn = lambda a: a @ a.T  # noqa: E731
  local = lambda f, a: jax.vmap(f)(a)  # noqa: E731
  want = local(fn, x)
  sharded = jax.device_put(x, NamedSharding(mesh, P(None, "fsdp", "tensor")))

  @jax.jit
  def run(a):
    with owners.using(mesh):
      return owners.map_whole(fn, [a], local)

  got = run(sharded)
  assert got.shape == (5, 8, 8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_known_split_in_another_order_than_the_mesh_keeps_each_matrix_s_results_together():
  """``map_whole`` given a split whose mesh axes are not in the mesh's order (the axis the
  stack is held on first, the others added, as the rotation's per-leaf refresh passes
  it): each matrix's results, of its own shape and per matrix (eigenvalues), come back
  to that matrix. Paired in the mesh's order, a result per matrix went to another."""
  mesh = _mesh(data=True)
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 16, 16))
  fn = lambda a: (a @ a.T, jnp.sum(a, axis=1))  # noqa: E731
  local = lambda f, a: jax.vmap(f)(a)  # noqa: E731
  want = local(fn, x)
  split = [(1, "tensor"), (1, "data"), (1, "fsdp")]
  sharded = jax.device_put(x, NamedSharding(mesh, P(None, "tensor")))

  @jax.jit
  def run(a):
    with owners.using(mesh):
      return owners.map_whole(fn, [a], local, split=split)

  for g, w in zip(run(sharded), want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_arguments_guessed_in_different_orders_keep_their_matrices_paired():
  """``map_whole`` of two stacks whose guessed splits exchange the mesh axes in different
  orders (8 x 16: rows over ``fsdp``, columns over ``tensor``; 6 x 8, whose rows ``fsdp``
  does not divide: rows over ``tensor``, columns over ``fsdp``): each owner gets the
  same matrices of both, and the results are one device's."""
  mesh = _mesh()
  a = jax.random.normal(jax.random.PRNGKey(0), (8, 8, 16))
  b = jax.random.normal(jax.random.PRNGKey(1), (8, 6, 8))
  assert owners._matrix_split(a.shape, mesh) == [(1, "fsdp"), (2, "tensor")]
  assert owners._matrix_split(b.shape, mesh) == [(1, "tensor"), (2, "fsdp")]
  fn = lambda x, y: (x * jnp.sum(y), y * jnp.sum(x))  # noqa: E731
  local = lambda f, *xs: jax.vmap(f)(*xs)  # noqa: E731

  @jax.jit
  def run(x, y):
    with owners.using(mesh):
      return owners.map_whole(fn, [x, y], local)

  got = run(jax.device_put(a, NamedSharding(mesh, P(None, "fsdp", "tensor"))),
            jax.device_put(b, NamedSharding(mesh, P(None, "tensor", "fsdp"))))
  for g, w in zip(got, local(fn, a, b)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-4)


def test_stacks_move_packed_and_no_padding_slot_travels():
  """One call over two stacks, one of fewer matrices than devices (2 of 64 x 128, as an
  embedding and an output layer, and 9 of 64 x 64): the values of one device, results
  that are state (``replicate``, gathered to every device) too. Each exchange's rows
  are as long as the largest matrix's block (the 2 + 9 matrices fill 8 owners evenly),
  half of what each stack padded to the device count sends (``map_whole``: 8 + 16
  slots)."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = [jax.random.normal(jax.random.PRNGKey(i), s)
        for i, s in enumerate([(2, 64, 128), (9, 64, 64)])]
  fn = lambda a: jnp.tanh(a) + 1.0  # noqa: E731
  local = lambda f, a: jax.vmap(f)(a)  # noqa: E731
  # FSDP's layout: the larger side split, the rows of a square matrix
  sharded = [jax.device_put(x, NamedSharding(mesh, spec))
             for x, spec in zip(xs, [P(None, None, "fsdp"), P(None, "fsdp", None)])]

  def program(how, replicate):
    def run(*args):
      with owners.using(mesh):
        if how == "packed":
          return packed.map_packed(fn, [[a] for a in args], [[i] for i in range(len(args))],
                                   local, replicate=replicate)
        return [owners.map_whole(fn, [a], local, replicate=replicate) for a in args]
    return jax.jit(run)

  for replicate in (False, True):
    got = program("packed", replicate)(*sharded)
    for x, out in zip(xs, got):
      np.testing.assert_allclose(np.asarray(out), np.asarray(local(fn, x)), rtol=1e-6,
                                 atol=1e-6)
  with jax.set_mesh(mesh):
    sent = {how: collectives.traffic(program(how, False).lower(*sharded).compile()
                                     .as_text(), 8, refresh=True)[0].total
            for how in ("packed", "whole")}
  block = 64 * 128 // 8 * 4  # bytes of the largest matrix's block on one device
  assert sent["packed"] <= 2 * 8 * block * 7 / 8 * 1.01, sent  # in and out, one row each
  assert sent["packed"] <= 0.51 * sent["whole"], sent


def test_orbax_resume_onto_another_mesh_continues_the_owner_layout(tmp_path):
  """GaLore (refreshes at steps 1 and 5) stopped mid-interval on the 4 x 2 mesh, saved
  with orbax, restored onto a 2 x 2 mesh and onto one device: both continuations give
  the uninterrupted single-device run, the refresh at step 5 in the owner layout of the
  new mesh."""
  tx = _tx("galore", interval=4)
  want, _ = _run(tx, 6)
  got, got1 = util.resume_elsewhere(tmp_path / "ck", tx, _run, SPECS, _mesh(), 2, 4)
  _close(got, want, "4x2 -> 2x2")
  _close(got1, want, "4x2 -> 1")


# bfloat16 bases (GaLore's refresh results) leave the reference far behind: a bound of 1
@pytest.mark.parametrize("name,bound", [("galore", 1.0), ("normuon", 1e-2)])
def test_bfloat16_transport_against_the_float64_reference(name, bound):
  """16 matrices 8 x 24 (two per device), 7 steps, refreshes at 1, 4 and 7: the largest
  relative error of an update against the dense float64 reference, with the matrices
  sent to and from their owners in float32 (the default) and in bfloat16. Printed with
  ``-s``; the docs quote it."""
  shape = (16, 8, 24)
  grads = util.structured_grads(shape, 7, seed=1)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  mesh = _mesh()
  errors = {}
  for label, dtype in (("float32", None), ("bfloat16", jnp.bfloat16)):
    tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw,
                           owner_layout=fo.OwnerLayout(transport_dtype=dtype))
    got = util.updates_on_mesh(tx, shape, grads, mesh, P(None, "fsdp", "tensor"))
    errors[label] = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  print(f"\n{name}: largest relative error against float64, transport float32 "
        f"{errors['float32']:.1e}, bfloat16 {errors['bfloat16']:.1e}")
  assert errors["float32"] < 1e-4, errors
  assert errors["float32"] < errors["bfloat16"] < bound, errors


@pytest.mark.parametrize("name", registry.params(["alice", "alice0", "alice_soap"],
                                                 default=["alice"]))
def test_low_rank_tracking_on_owners_against_the_float64_reference(name):
  """16 matrices 8 x 24 (two per device), 7 steps, refreshes at 1, 4 and 7, the owner
  layout on (packed exchange, bases pinned to the state's layout): every update equals
  the dense float64 re-derivation of the paper's tracking, switching and compensation
  (``tests/reference.py``) to float32 rounding."""
  shape = (16, 8, 24)
  grads = util.structured_grads(shape, 7, seed=1)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw, owner_layout=True)
  got = util.updates_on_mesh(tx, shape, grads, _mesh(), P(None, "fsdp", "tensor"))
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.parametrize("name,explicit", [
    ("alice", False), ("galore", True),
    pytest.param("alice", True, marks=pytest.mark.slow),
    pytest.param("alice_soap", False, marks=pytest.mark.slow)])
def test_a_wide_matrix_sums_its_gram_in_place_against_the_float64_reference(
    name, explicit, monkeypatch):
  """2 matrices 8 x 64, each larger than a device's share of the refreshes' work, rows
  split over ``fsdp`` and columns over ``tensor``: their Gram is summed where their
  columns are (``owners.gram_in_place``) and every device refreshes its basis, with the
  dense float64 re-derivation's updates over 7 steps (refreshes at 1, 4 and 7)."""
  shape = (2, 8, 64)
  calls = []
  summed = owners.summed_in_place
  monkeypatch.setattr(owners, "summed_in_place",
                      lambda g, *a: calls.append(g.shape) or summed(g, *a))
  grads = util.structured_grads(shape, 7, seed=2)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  spec = P(None, "fsdp", "tensor")
  # the split known: read from the types, or given on Auto axes
  layout = True if explicit else fo.OwnerLayout(param_specs={"w": spec})
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw, owner_layout=layout)
  got = util.updates_on_mesh(tx, shape, grads, _mesh(explicit), spec)
  assert calls and all(c[-2:] == (8, 64) for c in calls), calls
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.slow
@pytest.mark.parametrize("leaf", ["wide", "w"])
def test_zero_and_nan_gradients_of_a_wide_matrix_summed_in_place(leaf, monkeypatch):
  """A zero or NaN gradient in the wide matrix whose Gram is summed in place, or in a
  matrix beside it on the owners: the update of one device, the degenerate leaf alone
  affected (``Explicit`` axes: the split read from the types)."""
  calls = []
  summed = owners.summed_in_place
  monkeypatch.setattr(owners, "summed_in_place",
                      lambda g, *a: calls.append(g.shape) or summed(g, *a))
  shapes = {"wide": (8, 64), "w": (16, 32), "stack": (4, 16, 32)}
  specs = {"wide": P("fsdp", "tensor"), "w": P("fsdp", "tensor"),
           "stack": P(None, "fsdp", "tensor")}
  dims = {k: fo.MatrixDims() for k in shapes}
  tx = fo.galore(0.01, dims=dims, **registry.kwargs("galore", dims=None))
  util.assert_zero_and_nan_stay_in_their_leaf(
      tx, shapes, lambda: util.random_tree(shapes, 0, 0.1),
      lambda t: util.random_tree(shapes, 100 + 7 * t), specs, _mesh(explicit=True),
      leaf=leaf, other="stack")
  assert (8, 64) in [c[-2:] for c in calls], calls


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1e-30, 1e18])
def test_tiny_and_huge_gradients_of_a_wide_matrix_summed_in_place(scale):
  """Gradients near ``1e-30`` and ``1e18`` through the in-place Gram (GaLore, whose
  refresh reads ``G / max|G|``): finite updates, those of one device."""
  shapes = {"wide": (8, 64), "w": (16, 32), "stack": (4, 16, 32)}
  specs = {"wide": P("fsdp", "tensor"), "w": P("fsdp", "tensor"),
           "stack": P(None, "fsdp", "tensor")}
  tx = fo.galore(0.01, dims={k: fo.MatrixDims() for k in shapes},
                 **registry.kwargs("galore", dims=None))
  params = lambda: util.random_tree(shapes, 0, 0.1)  # noqa: E731
  grads = lambda t: jax.tree.map(lambda g: g * scale,  # noqa: E731
                                 util.random_tree(shapes, 100 + 7 * t))
  single, _ = util.run_sharded(tx, params(), grads, specs, 4)
  mesh = _mesh(explicit=True)
  with jax.set_mesh(mesh):
    sharded, _ = util.run_sharded(tx, params(), grads, specs, 4, mesh)
  for k in shapes:
    a, b = np.asarray(sharded[k]), np.asarray(single[k])
    assert np.isfinite(a).all(), k
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=k)


def test_only_a_dominant_wide_matrix_sums_its_gram_in_place():
  """``gram_in_place``: a wide matrix larger than a device's share, or whose Gram is
  small next to it; not a square one, a tall one, or one whose columns the devices do
  not divide; where its split is known or the mesh has one axis (FSDP's split, which
  the guess gets right); nothing without the owner layout."""
  shapes = [(1, 128, 2048), (8, 128, 128), (4, 128, 344), (1, 2048, 32), (1, 128, 2044),
            (1, 16, 4096)]
  want = [True, False, False, False, False, True]
  known = [[(1, "fsdp"), (2, "tensor")]] * 6
  assert owners.gram_in_place(shapes, known) == [False] * 6
  with owners.using(_mesh()):
    assert owners.gram_in_place(shapes, known) == want
    assert owners.gram_in_place(shapes) == [False] * 6  # guessed on two axes
  fsdp = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  with owners.using(fsdp):
    assert owners.gram_in_place(shapes) == want


@pytest.mark.parametrize("name,explicit", [
    ("muon", False),
    pytest.param("galore", False, marks=pytest.mark.slow),
    pytest.param("alice", False, marks=pytest.mark.slow),
    pytest.param("galore", True, marks=pytest.mark.slow),
    pytest.param("muon", True, marks=pytest.mark.slow),
    pytest.param("alice", True, marks=pytest.mark.slow)])
def test_zero_and_nan_gradients_in_the_owner_layout_as_on_one_device(name, explicit):
  """A zero gradient gives a zero update and a NaN gradient a NaN update, in its own
  leaf only, on the mesh as on one device (padding copies a real matrix, so no padded
  slot meets a degenerate case of its own); on ``Explicit`` axes each matrix travels
  from the split read from its type."""
  util.assert_zero_and_nan_stay_in_their_leaf(_tx(name), PARAMS, _params, _grads, SPECS,
                                              _mesh(explicit))


# a square matrix split on its rows only (FSDP), a stack of two, and a wide one split on
# its columns, on a mesh of one axis
RELAY_PARAMS = {"sq": (64, 64), "stack": (2, 64, 64), "wide": (32, 128)}
RELAY_SPECS = {"sq": P("fsdp", None), "stack": P(None, "fsdp", None), "wide": P(None, "fsdp")}


def _relay_tx(name, rank=16):
  kw = dict(rank=rank, dims={k: fo.MatrixDims() for k in RELAY_PARAMS}, stack_matrices=False)
  kw.update(interval=2) if name != "alice_soap" else kw.update(interval=2, right_rank=rank)
  if name == "alice":
    kw.update(leading=4)
  return getattr(fo, name)(0.01, **kw)


def _relay_program(tx, mesh, state_specs=None, shapes=RELAY_PARAMS, specs=RELAY_SPECS):
  params = util.random_tree(shapes, 0, 0.1)
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  s_sh = fo.state_shardings(tx, params, specs, mesh)
  if state_specs is not None:
    s_sh = state_specs(s_sh)
  state = jax.eval_shape(tx.init, params)
  shaped = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t, sh)
  step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
  with jax.set_mesh(mesh):
    return step.lower(shaped(params, p_sh), shaped(state, s_sh),
                      shaped(params, p_sh)).compile().as_text()


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("alice_soap", marks=pytest.mark.slow)])
def test_a_row_split_gradient_moves_to_its_columns_where_the_state_is_split_so(name):
  """On Explicit mesh axes, where the update sees the coefficients' state split over the
  rows' mesh axes (as ``fo.state_shardings`` lays it out), a gradient split on its rows
  only moves to its columns for ``U^T G`` and its update comes back: an ordinary step
  sends less than the same program on ``Auto`` axes with the specs given (the sum over
  the rows, and the coefficients gathered). Held whole on every device, the state would
  be gathered back at every step: there the gradient is not moved. The updates are one
  device's either way, over 5 steps with refreshes every 2."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  given = getattr(fo, name)
  tx = _relay_tx(name)
  moved = collectives.traffic(_relay_program(tx, mesh), 8, refresh=False)[0]
  # the same optimizer on Auto axes, the split given
  spec_tx = given(0.01, **{**dict(rank=16, dims={k: fo.MatrixDims() for k in RELAY_PARAMS},
                                  stack_matrices=False, interval=2,
                                  owner_layout=fo.OwnerLayout(param_specs=RELAY_SPECS)),
                           **(dict(leading=4) if name == "alice" else {}),
                           **(dict(right_rank=16) if name == "alice_soap" else {})})
  summed = collectives.traffic(_relay_program(spec_tx, auto), 8, refresh=False)[0]
  assert moved.count["all-to-all"] > 0, moved.sent
  assert moved.total < summed.total, (moved.total, summed.total)
  if name != "alice_soap":  # its coefficients' state is k x r: nothing held whole
    whole = lambda sh: jax.tree.map(  # noqa: E731
        lambda s: NamedSharding(mesh, P()), sh, is_leaf=lambda x: isinstance(x, NamedSharding))
    kept = collectives.traffic(_relay_program(tx, mesh, whole), 8, refresh=False)[0]
    assert kept.count["all-to-all"] == 0, kept.sent
  params = util.random_tree(RELAY_PARAMS, 0, 0.1)
  grads = lambda t: util.random_tree(RELAY_PARAMS, 100 + 7 * t)  # noqa: E731
  want, _ = util.run_sharded(tx, params, grads, RELAY_SPECS, 5)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(_relay_tx(name), params, grads, RELAY_SPECS, 5, mesh)
  util.assert_close_change(got, want, params, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore", "alice_soap"])
def test_on_auto_axes_a_gradient_moves_to_its_columns_where_the_state_is_said_placed(name):
  """On ``Auto`` axes the state's layout is not in its type: with the specs given, a
  row-split gradient moves to its columns only where ``OwnerLayout(state_placed=True)``
  says the state is placed as ``fo.state_shardings`` places it; the step then sends less
  than without that statement, and the updates are one device's over 5 steps."""
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

  def tx(placed):
    kw = dict(rank=16, dims={k: fo.MatrixDims() for k in RELAY_PARAMS}, stack_matrices=False,
              interval=2, owner_layout=fo.OwnerLayout(param_specs=RELAY_SPECS,
                                                      state_placed=placed))
    return getattr(fo, name)(0.01, **kw, **(dict(right_rank=16) if name == "alice_soap"
                                             else {}))

  moved = collectives.traffic(_relay_program(tx(True), auto), 8, refresh=False)[0]
  summed = collectives.traffic(_relay_program(tx(False), auto), 8, refresh=False)[0]
  assert moved.count["all-to-all"] > summed.count["all-to-all"], (moved.sent, summed.sent)
  assert moved.total < summed.total, (moved.total, summed.total)
  _placed_as_unplaced(tx, RELAY_PARAMS, RELAY_SPECS, auto, name)


def _placed_as_unplaced(tx, shapes, specs, mesh, what, steps=5, scale=1.0):
  """``tx(True)`` (the state said placed) on ``mesh`` against ``tx(False)`` on one device,
  ``steps`` steps of random gradients of ``shapes`` (times ``scale``) laid out as
  ``specs``: the same finite updates."""
  params = util.random_tree(shapes, 0, 0.1)
  grads = lambda t: jax.tree.map(lambda g: g * scale,  # noqa: E731
                                 util.random_tree(shapes, 100 + 7 * t))
  want, _ = util.run_sharded(tx(False), params, grads, specs, steps)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(tx(True), params, grads, specs, steps, mesh)
  for k in shapes:
    assert np.isfinite(np.asarray(got[k])).all(), k
  util.assert_close_change(got, want, params, what)


def _recorded(monkeypatch, name: str) -> list:
  """What ``owners.<name>`` returns at each call, in a list (the function kept)."""
  seen, fn = [], getattr(owners, name)
  monkeypatch.setattr(owners, name,
                      lambda *a, **kw: (lambda r: seen.append(r) or r)(fn(*a, **kw)))
  return seen


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("alice_soap", marks=pytest.mark.slow)])
def test_a_row_split_gradient_moved_to_its_columns_against_the_float64_reference(
    name, monkeypatch):
  """8 matrices 16 x 64 split on their rows over the 8 devices of an Explicit mesh, the
  coefficients' state split as ``fo.state_shardings`` lays it out: each gradient moves to
  its columns for ``U^T G`` (``owners.relay_split``), and every update of 7 steps
  (refreshes at 1, 4 and 7) equals the dense float64 re-derivation to float32 rounding."""
  shape = (8, 16, 64)
  moved = _recorded(monkeypatch, "relay_split")
  grads = util.structured_grads(shape, 7, seed=3)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw)
  got = util.updates_on_mesh(tx, shape, grads, mesh, P(None, "fsdp", None))
  assert moved and moved[0] == [(2, "fsdp")], moved
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.slow
def test_a_random_projection_of_a_row_split_gradient_is_summed_and_scattered_where_its_state_is():
  """APOLLO on ``Auto`` axes with the specs given: where ``OwnerLayout(state_placed=True)``
  says the coefficients' state is split over the rows' mesh axis, ``sigma = U^T G`` of a
  row-split matrix is one reduce-scatter (``owners.scatter_rows``) instead of an
  all-reduce, the step sends less than without that statement, and 5 steps with a new
  projection every 2 give one device's updates."""
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

  def tx(placed):
    return fo.apollo(0.01, rank=16, interval=2, stack_matrices=False,
                     dims={k: fo.MatrixDims() for k in RELAY_PARAMS},
                     owner_layout=fo.OwnerLayout(param_specs=RELAY_SPECS, state_placed=placed))

  scattered = collectives.traffic(_relay_program(tx(True), auto), 8, refresh=False)[0]
  summed = collectives.traffic(_relay_program(tx(False), auto), 8, refresh=False)[0]
  assert scattered.count.get("reduce-scatter", 0) >= 2, scattered.sent
  assert summed.count.get("reduce-scatter", 0) == 0, summed.sent
  assert scattered.total < 0.7 * summed.total, (scattered.total, summed.total)
  _placed_as_unplaced(tx, RELAY_PARAMS, RELAY_SPECS, auto, "apollo")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore", "alice"])
def test_where_the_move_does_not_pay_the_coefficients_are_summed_and_scattered(
    name, monkeypatch):
  """A 64 x 64 matrix split on its rows over the 2 devices of one axis of a 2 x 4 mesh
  (rank 16): moving it to its columns would send more than the sum over its rows
  (``owners.relay_split`` declines), so ``sigma = U^T G`` is summed and scattered where
  the state is said placed (``owners.scatter_rows``). The step sends less than the same
  program with the scatter turned off (GaLore 0.75 of it, Alice 0.87: its compensation
  gathers what it gathers either way), and 5 steps with refreshes every 2 give one
  device's updates."""
  shapes = {"sq": (64, 64), "wide": (32, 128)}
  specs = {"sq": P("a", None), "wide": P(None, ("a", "b"))}
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def tx():
    return getattr(fo, name)(0.01, rank=16, interval=2, stack_matrices=False,
                             dims={k: fo.MatrixDims() for k in shapes},
                             owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True),
                             **(dict(leading=4) if name == "alice" else {}))

  taken, scattered, summed = _scattered_and_summed(tx, mesh, shapes, specs, name,
                                                   monkeypatch)
  assert ("a",) in taken, taken
  assert scattered.count["reduce-scatter"] > summed.count["reduce-scatter"], scattered.sent
  assert scattered.total < 0.9 * summed.total, (scattered.total, summed.total)


def _scattered_and_summed(tx, mesh, shapes, specs, name, monkeypatch) -> tuple:
  """For the optimizer ``tx()`` on ``mesh`` (leaves ``shapes`` split as ``specs``): what
  ``owners.scatter_rows`` returned while its update was compiled for the mesh, the
  traffic of an ordinary step, and that traffic with the scatter turned off; checks on
  the way that 5 steps (refreshes every 2) give one device's updates."""
  seen = _recorded(monkeypatch, "scatter_rows")
  scattered = collectives.traffic(_relay_program(tx(), mesh, shapes=shapes, specs=specs), 8,
                                  refresh=False)[0]
  taken = list(seen)  # while the mesh's program was traced
  params = util.random_tree(shapes, 0, 0.1)
  grads = lambda t: util.random_tree(shapes, 100 + 7 * t)  # noqa: E731
  want, _ = util.run_sharded(tx(), params, grads, specs, 5)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(tx(), params, grads, specs, 5, mesh)
  util.assert_close_change(got, want, params, name)
  monkeypatch.setattr(owners, "scatter_rows", lambda *a: ())
  summed = collectives.traffic(_relay_program(tx(), mesh, shapes=shapes, specs=specs), 8,
                               refresh=False)[0]
  return taken, scattered, summed


@pytest.mark.slow
def test_a_random_projection_scattered_over_two_mesh_axes(monkeypatch):
  """Rows split over two mesh axes (``("a", "b")`` of a 2 x 4 ``Auto`` mesh) and a wide
  matrix's columns over them in the other order: the square one is summed and scattered
  over both axes, and 5 steps give one device's updates."""
  params_shapes = {"sq": (64, 64), "wide": (32, 128)}
  specs = {"sq": P(("a", "b"), None), "wide": P(None, ("b", "a"))}
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  taken = _recorded(monkeypatch, "scatter_rows")

  def tx(placed):
    return fo.apollo(0.01, rank=16, interval=2, stack_matrices=False,
                     dims={k: fo.MatrixDims() for k in params_shapes},
                     owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=placed))

  _placed_as_unplaced(tx, params_shapes, specs, mesh, "apollo")
  assert ("a", "b") in taken, taken


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow)])
def test_summed_and_scattered_coefficients_against_the_float64_reference(name, monkeypatch):
  """8 matrices 64 x 64 split on their rows over 2 devices (axis ``a`` of a 2 x 4
  Explicit mesh), the coefficients' state split as ``fo.state_shardings`` lays it out:
  moving the gradients to their columns would send more, so ``sigma = U^T G`` is summed
  and scattered (``owners.scatter_rows``), and every update of 7 steps (refreshes at 1,
  4 and 7) equals the dense float64 re-derivation to float32 rounding."""
  shape = (8, 64, 64)
  taken = _recorded(monkeypatch, "scatter_rows")
  grads = util.structured_grads(shape, 7, seed=3)
  kw = registry.WITH_REFERENCE[name]
  want = util.run_reference(name, shape, grads, **kw)
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw)
  got = util.updates_on_mesh(tx, shape, grads, mesh, P(None, "a", None))
  assert ("a",) in taken, taken
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("fira", marks=pytest.mark.slow)])
@pytest.mark.parametrize("shape,spec", [((8, 16, 18), P(None, "a", None)),
                                        ((8, 18, 16), P(None, None, "a"))],
                         ids=["wide", "tall"])
def test_coefficients_summed_and_scattered_on_their_rank_against_the_float64_reference(
    name, shape, spec, monkeypatch):
  """8 matrices split on their smaller side (16) over the 4 devices of axis ``a`` of a
  4 x 2 Explicit mesh, their larger side 18 (4 does not divide it) and rank 4:
  ``fo.state_shardings`` splits the coefficients' state on its ``r`` axis, ``sigma = U^T G``
  is summed and scattered on that axis (``owners.scatter_rows``), and every update of 7
  steps (refreshes at 1, 4 and 7) equals the dense float64 re-derivation to float32
  rounding."""
  taken = _recorded(monkeypatch, "scatter_rows")
  grads = util.structured_grads(shape, 7, seed=3)
  kw = {**registry.WITH_REFERENCE[name], "rank": 4}
  want = util.run_reference(name, shape, grads, **kw)
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw)
  specs = fo.state_partition_specs(tx, {"w": jnp.zeros(shape)}, {"w": spec}, mesh=mesh)
  mu = util.coefficient_moments(specs)
  assert mu == {"w": P(None, "a")}, mu
  got = util.updates_on_mesh(tx, shape, grads, mesh, spec)
  assert ("a",) in taken, taken
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.slow
def test_coefficients_scattered_on_their_rank_send_no_more_than_summed(monkeypatch):
  """GaLore on ``Auto`` axes with the specs given and the state said placed, a 64 x 68
  matrix split on its rows over 8 devices (which do not divide 68; rank 8, so moving it
  to its columns would send more): the coefficients' state is split on ``r``, and
  ``sigma = U^T G`` summed and scattered on ``r`` makes an ordinary step send less than
  leaving the sum to XLA with the state split so (an all-reduce, then the coefficients
  gathered), and no more than with the state held whole (the all-reduce alone); 5 steps
  give one device's updates."""
  shapes, specs = {"w": (64, 68)}, {"w": P("fsdp", None)}
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  moved = _recorded(monkeypatch, "relay_split")

  def tx(placed):
    return fo.galore(0.01, rank=8, interval=2, stack_matrices=False,
                     dims={"w": fo.MatrixDims()},
                     owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=placed))

  def sent(t, state_specs=None):
    return collectives.traffic(_relay_program(t, auto, state_specs, shapes, specs), 8,
                               refresh=False)[0]

  whole = lambda sh: jax.tree.map(  # noqa: E731
      lambda s: NamedSharding(auto, P()), sh, is_leaf=lambda x: isinstance(x, NamedSharding))
  scattered, summed, held = sent(tx(True)), sent(tx(False)), sent(tx(False), whole)
  assert moved and not any(moved), moved
  assert scattered.count.get("reduce-scatter", 0) >= 1, scattered.sent
  assert scattered.total < 0.9 * summed.total, (scattered.total, summed.total)
  assert scattered.total <= 1.01 * held.total, (scattered.total, held.total)
  _placed_as_unplaced(tx, shapes, specs, auto, "galore")


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("fira", marks=pytest.mark.slow)])
def test_a_gradient_moves_to_columns_the_devices_do_not_divide(name, monkeypatch):
  """A 16 x 68 matrix split on its rows over 8 ``Auto`` devices (which do not divide 68;
  rank 8), the specs given and the state said placed: its coefficients' state is split
  on ``r``, and moving the gradient to its columns, split unevenly, with the
  coefficients crossing to their state and back, sends less than summing and
  scattering ``sigma = U^T G`` on ``r`` (``owners.relay_split`` turned off); 5 steps
  give one device's updates."""
  shapes, specs = {"w": (16, 68)}, {"w": P("fsdp", None)}
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  moved = _recorded(monkeypatch, "relay_split")

  def tx(placed):
    return getattr(fo, name)(0.01, rank=8, interval=2, stack_matrices=False,
                             dims={"w": fo.MatrixDims()},
                             owner_layout=fo.OwnerLayout(param_specs=specs,
                                                         state_placed=placed),
                             **(dict(leading=4) if name == "alice" else {}))

  mu = util.coefficient_moments(fo.state_partition_specs(
      tx(True), {"w": jnp.zeros(shapes["w"])}, specs, mesh=auto))
  assert mu == {"w": P("fsdp")}, mu
  program = lambda: _relay_program(tx(True), auto, None, shapes, specs)  # noqa: E731
  relayed = collectives.traffic(program(), 8, refresh=False)[0]
  assert moved and moved[0] == [(2, "fsdp")], moved
  assert relayed.count.get("all-to-all", 0) >= 2, relayed.sent
  monkeypatch.setattr(owners, "relay_split", lambda *a, **kw: None)
  scattered = collectives.traffic(program(), 8, refresh=False)[0]
  assert scattered.count.get("reduce-scatter", 0) >= 1, scattered.sent
  assert relayed.total < 0.8 * scattered.total, (relayed.total, scattered.total)
  monkeypatch.undo()
  _placed_as_unplaced(tx, shapes, specs, auto, name)


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("fira", marks=pytest.mark.slow)])
def test_moved_to_columns_the_devices_do_not_divide_against_the_float64_reference(
    name, monkeypatch):
  """8 matrices 16 x 66 split on their rows over the 8 devices of an Explicit mesh (8
  does not divide 66; rank 8), the coefficients' state split on ``r`` as
  ``fo.state_shardings`` lays it out: each gradient moves to its columns, split
  unevenly (``owners.relay_split``), and every update of 7 steps (refreshes at 1, 4 and
  7) equals the dense float64 re-derivation to float32 rounding."""
  shape = (8, 16, 66)
  moved = _recorded(monkeypatch, "relay_split")
  grads = util.structured_grads(shape, 7, seed=3)
  kw = {**registry.WITH_REFERENCE[name], "rank": 8}
  want = util.run_reference(name, shape, grads, **kw)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw)
  specs = fo.state_partition_specs(tx, {"w": jnp.zeros(shape)}, {"w": P(None, "fsdp", None)},
                                   mesh=mesh)
  assert util.coefficient_moments(specs) == {"w": P(None, "fsdp")}, specs
  got = util.updates_on_mesh(tx, shape, grads, mesh, P(None, "fsdp", None))
  assert moved and moved[0] == [(2, "fsdp")], moved
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore", "alice", "galore_moved", "apollo_moved"])
@pytest.mark.parametrize("scale", [1e-30, 1e15], ids=["tiny", "huge"])
def test_tiny_and_huge_gradients_summed_and_scattered_on_their_rank(name, scale, monkeypatch):
  """Gradients near 1e-30 and near 1e15 of a 64 x 65 matrix split on its rows over the 2
  devices of axis ``a`` of a 2 x 4 mesh (they do not divide 65: ``U^T G`` summed and
  scattered on ``r``, the state said placed), or of a 16 x 68 one split over all 8
  (rank 8: moved to its columns split unevenly, ``owners.relay_split``): 4 steps with
  refreshes every 2 give one device's finite updates."""
  moved = name.endswith("moved")
  shapes = {"sq": (16, 68) if moved else (64, 65)}
  specs = {"sq": P(("a", "b") if moved else "a", None)}
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def tx(placed):
    return getattr(fo, name.split("_")[0])(
        0.01, rank=8 if moved else 16, interval=2, stack_matrices=False,
        dims={"sq": fo.MatrixDims()},
        owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=placed),
        **(dict(leading=4) if name == "alice" else {}))

  taken = _recorded(monkeypatch, "relay_split" if moved else "scatter_rows")
  _placed_as_unplaced(tx, shapes, specs, mesh, name, steps=4, scale=scale)
  assert ([(2, "a"), (2, "b")] if moved else ("a",)) in taken, taken


@pytest.mark.slow
@pytest.mark.parametrize("name", ["apollo", "apollo_drawn", "galore", "galore_rank",
                                  "alice_rank", "galore_moved", "alice_moved",
                                  "apollo_moved"])
def test_zero_and_nan_gradients_of_a_scattered_projection(name, monkeypatch):
  """A zero or NaN gradient in a row-split matrix whose ``U^T G`` is summed and
  scattered (APOLLO on 8 devices; GaLore where the move declines, 2 devices on the rows
  of a 2 x 4 mesh; GaLore and Alice on ``r`` where those 2 do not divide the 65
  columns), or projected where its columns are with bases drawn on every device
  (APOLLO at rank 32, ``owners.drawn_projections``), or a 16 x 68 one split on its rows
  over all 8 devices, which do not divide 68, moved to its columns split unevenly
  (rank 8, ``owners.relay_split``): the update of one device, the degenerate leaf alone
  affected."""
  if name in ("apollo", "apollo_drawn"):
    shapes, specs = RELAY_PARAMS, RELAY_SPECS
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  else:
    sq = {"rank": (64, 65), "moved": (16, 68)}.get(name.split("_")[-1], (64, 64))
    shapes = {"sq": sq, "stack": (2, 64, 64)}
    specs = {"sq": P(("a", "b") if name.endswith("moved") else "a", None),
             "stack": P(None, None, ("a", "b"))}
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rank = {"apollo_drawn": 32}.get(name, 8 if name.endswith("moved") else 16)
  tx = getattr(fo, name.split("_")[0])(
      0.01, rank=rank, interval=2, stack_matrices=False,
      dims={k: fo.MatrixDims() for k in shapes},
      owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True),
      **(dict(leading=4) if name.startswith("alice") else {}))
  params = lambda: util.random_tree(shapes, 0, 0.1)  # noqa: E731
  grads = lambda t: util.random_tree(shapes, 100 + 7 * t)  # noqa: E731
  taken = (_drawn_shapes(monkeypatch) if name == "apollo_drawn"
           else _recorded(monkeypatch, "relay_split" if name.endswith("moved")
                          else "scatter_rows"))
  util.assert_zero_and_nan_stay_in_their_leaf(tx, shapes, params, grads, specs, mesh,
                                              leaf="sq", other="stack")
  assert ([(2, "a"), (2, "b")] in taken) if name.endswith("moved") else any(taken), taken


@pytest.mark.slow
@pytest.mark.parametrize("name", ["apollo", "galore", "galore_rank", "galore_moved",
                                  "apollo_moved"])
def test_bfloat16_parameters_on_the_scattered_path(name, monkeypatch):
  """bfloat16 parameters and gradients of a 64 x 64 matrix split on its rows over 2
  devices of a 2 x 4 mesh, ``U^T G`` summed and scattered (on ``r`` for a 64 x 65 one:
  the 2 do not divide its columns; a 16 x 68 one split over all 8, rank 8, moved to
  its columns split unevenly), and of a wide matrix split on its columns (APOLLO: its
  bases drawn where its columns are): 4 steps give one device's bfloat16 updates."""
  moved = name.endswith("moved")
  sq = {"rank": (64, 65), "moved": (16, 68)}.get(name.split("_")[-1], (64, 64))
  shapes = {"sq": sq, "wide": (32, 128)}
  specs = {"sq": P(("a", "b") if moved else "a", None), "wide": P(None, ("a", "b"))}
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # noqa: E731

  def tx():
    return getattr(fo, name.split("_")[0])(
        0.01, rank=8 if moved else 16, interval=2, stack_matrices=False,
        dims={k: fo.MatrixDims() for k in shapes},
        owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True))

  taken = _recorded(monkeypatch, "relay_split" if moved else "scatter_rows")
  params = bf16(util.random_tree(shapes, 0, 0.1))
  grads = lambda t: bf16(util.random_tree(shapes, 100 + 7 * t))  # noqa: E731
  want, _ = util.run_sharded(tx(), params, grads, specs, 4)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(tx(), params, grads, specs, 4, mesh)
  assert ([(2, "a"), (2, "b")] if moved else ("a",)) in taken, taken
  for leaf in shapes:  # APOLLO's wide one: its bases drawn where its columns are
    assert got[leaf].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[leaf], np.float32),
                               np.asarray(want[leaf], np.float32), rtol=0,
                               atol=6e-4)  # one bfloat16 step near 0.1; measured: equal


def _apollo_error_on_explicit_axes(rank: int, spec: P, n: int = 64, mesh=None) -> float:
  """8 APOLLO matrices 16 x ``n`` laid out as ``spec`` over the 8 devices of an Explicit
  mesh (``mesh``; default one axis ``fsdp``), the state as ``fo.state_shardings`` lays it
  out: the largest relative error of 5 updates (new projections at 1, 3 and 5) against
  the dense float64 re-derivation."""
  shape = (8, 16, n)
  grads = util.structured_grads(shape, 5, seed=3)
  bases = util.apollo_bases(shape, rank, 2)
  refs = [reference._Transposing(reference.ApolloRef, 16, n, lr=util.LR, rank=rank,
                                 kind="channel", scale=1.0, basis=bases(b)) for b in range(8)]
  want = [np.stack([ref.step(np.asarray(g, np.float64)[i]) for i, ref in enumerate(refs)])
          for g in grads]
  if mesh is None:
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  tx = fo.apollo(util.LR, rank=rank, interval=2, dims=util.STACK)
  got = util.updates_on_mesh(tx, shape, grads, mesh, spec)
  return max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))


_FSDP_TP = ((4, 2), ("fsdp", "tp"))


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("fira", marks=pytest.mark.slow),
                                  pytest.param("alice0", marks=pytest.mark.slow)])
@pytest.mark.parametrize("shape,spec,moments", [
    ((8, 16, 24), P(None, "fsdp", "tp"), P(None, None, ("tp", "fsdp"))),
    ((8, 24, 16), P(None, "tp", "fsdp"), P(None, None, ("tp", "fsdp"))),
    ((8, 16, 20), P(None, "fsdp", "tp"), P(None, "fsdp", "tp"))],
    ids=["wide", "tall", "on_r"])
def test_coefficients_of_matrices_split_on_both_sides_against_the_float64_reference(
    name, shape, spec, moments, monkeypatch):
  """FSDP x tensor parallelism: 8 matrices split on both sides over a 4 x 2 Explicit
  mesh (their smaller side over ``fsdp``, their larger over ``tp``), rank 4:
  ``fo.state_shardings`` splits the coefficients' state on ``n`` over ``tp`` then
  ``fsdp`` (or, where 8 does not divide ``n``, on ``n`` over ``tp`` and ``r`` over
  ``fsdp``), moving the gradients to their columns would send more, so
  ``sigma = U^T G`` is summed and scattered where the state is
  (``owners.scatter_rows``), and every update of 7 steps (refreshes at 1, 4 and 7)
  equals the dense float64 re-derivation to float32 rounding."""
  taken = _recorded(monkeypatch, "scatter_rows")
  grads = util.structured_grads(shape, 7, seed=3)
  kw = {**registry.WITH_REFERENCE[name], "rank": 4}
  want = util.run_reference(name, shape, grads, **kw)
  mesh = jax.make_mesh(*_FSDP_TP, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw)
  specs = fo.state_partition_specs(tx, {"w": jnp.zeros(shape)}, {"w": spec}, mesh=mesh)
  assert util.coefficient_moments(specs) == {"w": moments}
  got = util.updates_on_mesh(tx, shape, grads, mesh, spec)
  assert ("fsdp",) in taken, taken
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


@pytest.mark.parametrize("name", ["galore", pytest.param("alice", marks=pytest.mark.slow),
                                  pytest.param("fira", marks=pytest.mark.slow)])
def test_matrices_split_on_both_sides_moved_to_their_columns_against_float64(
    name, monkeypatch):
  """FSDP x tensor parallelism: 8 matrices 16 x 64 split on both sides over a 4 x 2
  Explicit mesh, rank 8, where moving each gradient within its ``tp`` block to a split
  of its columns over ``tp`` and ``fsdp`` sends less than the sum over ``fsdp``
  (``owners.relay_split``): the coefficients' state is split so, and every update of 7
  steps (refreshes at 1, 4 and 7) equals the dense float64 re-derivation to float32
  rounding."""
  moved = _recorded(monkeypatch, "relay_split")
  shape, spec = (8, 16, 64), P(None, "fsdp", "tp")
  grads = util.structured_grads(shape, 7, seed=3)
  kw = {**registry.WITH_REFERENCE[name], "rank": 8}
  want = util.run_reference(name, shape, grads, **kw)
  mesh = jax.make_mesh(*_FSDP_TP, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = getattr(fo, name)(util.LR, dims=util.STACK, **kw)
  got = util.updates_on_mesh(tx, shape, grads, mesh, spec)
  assert [(2, "tp"), (2, "fsdp")] in moved, moved
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err


_BOTH_SIDES = {"moved": (16, 64), "on_n": (16, 24), "on_r": (16, 20)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore", "alice", "apollo"])
@pytest.mark.parametrize("kind", ["zero_nan", "tiny", "huge", "bfloat16"])
def test_degenerate_gradients_of_matrices_split_on_both_sides(name, kind, monkeypatch):
  """FSDP x tensor parallelism on a 4 x 2 Explicit mesh, rank 8: a matrix whose gradient
  moves to its columns (16 x 64), one whose coefficients are scattered on ``n`` (16 x 24)
  and one on ``r`` (16 x 20). Zero or NaN gradients in the moved one: one device's
  updates, that leaf alone affected; gradients near 1e-30 or 1e15, or bfloat16
  parameters and gradients, throughout: one device's finite updates (bfloat16 ones)
  over 4 steps with refreshes every 2."""
  specs = {k: P("fsdp", "tp") for k in _BOTH_SIDES}
  mesh = jax.make_mesh(*_FSDP_TP, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = getattr(fo, name)(0.01, rank=8, interval=2, stack_matrices=False,
                         dims={k: fo.MatrixDims() for k in _BOTH_SIDES},
                         **(dict(leading=2) if name == "alice" else {}))
  params = lambda: util.random_tree(_BOTH_SIDES, 0, 0.1)  # noqa: E731
  if kind == "zero_nan":
    grads = lambda t: util.random_tree(_BOTH_SIDES, 100 + 7 * t)  # noqa: E731
    util.assert_zero_and_nan_stay_in_their_leaf(tx, _BOTH_SIDES, params, grads, specs,
                                                mesh, leaf="moved", other="on_r")
    return
  scale = {"tiny": 1e-30, "huge": 1e15}.get(kind, 1.0)
  dtype = jnp.bfloat16 if kind == "bfloat16" else jnp.float32
  cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)  # noqa: E731
  grads = lambda t: cast(jax.tree.map(lambda g: g * scale,  # noqa: E731
                                      util.random_tree(_BOTH_SIDES, 100 + 7 * t)))
  params = lambda: cast(util.random_tree(_BOTH_SIDES, 0, 0.1))  # noqa: E731
  single, _ = util.run_sharded(tx, params(), grads, specs, 4)
  moved = _recorded(monkeypatch, "relay_split")
  scattered = _recorded(monkeypatch, "scatter_rows")
  with jax.set_mesh(mesh):
    sharded, _ = util.run_sharded(tx, params(), grads, specs, 4, mesh)
  assert ("fsdp",) in scattered, scattered
  if name != "apollo":  # APOLLO's drawn bases: staying sends no more there
    assert [(2, "tp"), (2, "fsdp")] in moved, moved
  for k in _BOTH_SIDES:
    assert sharded[k].dtype == dtype, k
    a, b = np.asarray(sharded[k], np.float32), np.asarray(single[k], np.float32)
    assert np.isfinite(a).all(), k
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=6e-4 if kind == "bfloat16" else 1e-6,
                               err_msg=k)  # bfloat16: one step near 0.1


def test_a_random_projection_of_matrices_split_on_both_sides_against_float64(monkeypatch):
  """APOLLO under FSDP x tensor parallelism (8 matrices 16 x 64, rows over ``fsdp`` and
  columns over ``tp`` of a 4 x 2 Explicit mesh, rank 4): ``sigma = U^T G`` is summed and
  scattered on ``r`` over ``fsdp`` (``owners.scatter_rows``), and every update of 5
  steps equals the float64 re-derivation to float32 rounding."""
  taken = _recorded(monkeypatch, "scatter_rows")
  mesh = jax.make_mesh(*_FSDP_TP, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  err = _apollo_error_on_explicit_axes(4, P(None, "fsdp", "tp"), mesh=mesh)
  assert taken and taken[0] == ("fsdp",), taken
  assert err < 1e-4, err


@pytest.mark.parametrize("name", ["galore", pytest.param("apollo", marks=pytest.mark.slow)])
def test_coefficients_split_on_both_sides_send_no_more_than_summed(name, monkeypatch):
  """FSDP x tensor parallelism on ``Auto`` axes with the specs given and the state said
  placed: an ordinary step that sums and scatters ``sigma = U^T G`` on ``r``
  (``owners.scatter_rows``) sends no more than the same program with the scatter turned
  off (XLA sums ``sigma`` whole and slices it for its state; APOLLO, whose update needs
  ``sigma`` only where its state is, sends less), and 5 steps give one device's
  updates."""
  shapes = {"wide": (32, 64), "tall": (64, 32)}
  specs = {"wide": P("fsdp", "tp"), "tall": P("tp", "fsdp")}
  mesh = jax.make_mesh(*_FSDP_TP, axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def tx():
    return getattr(fo, name)(0.01, rank=8, interval=2, stack_matrices=False,
                             dims={k: fo.MatrixDims() for k in shapes},
                             owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True))

  taken, scattered, summed = _scattered_and_summed(tx, mesh, shapes, specs, name,
                                                   monkeypatch)
  assert taken and all(t == ("fsdp",) for t in taken), taken
  assert scattered.count["reduce-scatter"] > summed.count.get("reduce-scatter", 0), (
      scattered.sent, summed.sent)
  assert scattered.total <= summed.total * (0.8 if name == "apollo" else 1.0), (
      scattered.total, summed.total)


def test_a_scattered_random_projection_against_the_float64_reference(monkeypatch):
  """8 matrices 16 x 64 split on their rows over 8 devices, rank 3 (moving them to
  their columns would send more): APOLLO sums and scatters ``sigma = U^T G`` over the
  rows' axis, and every update of 5 steps equals the float64 re-derivation to float32
  rounding."""
  taken = _recorded(monkeypatch, "scatter_rows")
  err = _apollo_error_on_explicit_axes(3, P(None, "fsdp", None))
  assert taken and taken[0] == ("fsdp",), taken
  assert err < 1e-4, err


def _drawn_shapes(monkeypatch) -> list:
  """Per call of ``owners.drawn_projections``, its leaves' canonical gradient shapes."""
  seen, fn = [], owners.drawn_projections

  def record(draw, key, leaves):
    seen.append([tuple(g.shape) for _, g, _, _ in leaves])
    return fn(draw, key, leaves)

  monkeypatch.setattr(owners, "drawn_projections", record)
  return seen


def test_a_random_projection_draws_its_bases_where_the_columns_are(monkeypatch):
  """APOLLO on ``Auto`` axes with the specs given, rank 32 over 8 devices: the square
  matrices split on their rows move to their columns (sending ``2 m n / 8`` instead of
  summing ``r n``), and there, as for the matrix split on its columns, every device
  draws each basis whole and projects its columns (``owners.drawn_projections``): no
  basis is gathered, the step sends less than half of what it sends with those paths
  turned off, and 5 steps with a new projection every 2 give one device's updates."""
  auto = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

  def tx():
    return fo.apollo(0.01, rank=32, interval=2, stack_matrices=False,
                     dims={k: fo.MatrixDims() for k in RELAY_PARAMS},
                     owner_layout=fo.OwnerLayout(param_specs=RELAY_SPECS, state_placed=True))

  drawn = _drawn_shapes(monkeypatch)
  local = collectives.traffic(_relay_program(tx(), auto), 8, refresh=False)[0]
  assert drawn and drawn[0] == [(1, 64, 64), (2, 64, 64), (1, 32, 128)], drawn
  assert local.count.get("all-gather", 0) == 0, local.sent
  params = util.random_tree(RELAY_PARAMS, 0, 0.1)
  grads = lambda t: util.random_tree(RELAY_PARAMS, 100 + 7 * t)  # noqa: E731
  want, _ = util.run_sharded(tx(), params, grads, RELAY_SPECS, 5)
  with jax.set_mesh(auto):
    got, _ = util.run_sharded(tx(), params, grads, RELAY_SPECS, 5, auto)
  util.assert_close_change(got, want, params, "apollo")
  monkeypatch.setattr(owners, "relay_split", lambda *a, **kw: None)
  monkeypatch.setattr(owners, "columns_only", lambda *a: ())
  summed = collectives.traffic(_relay_program(tx(), auto), 8, refresh=False)[0]
  assert local.total < 0.5 * summed.total, (local.total, summed.total)


@pytest.mark.parametrize("split", ["rows", "columns"])
def test_random_projections_drawn_where_the_columns_are_against_the_float64_reference(
    split, monkeypatch):
  """8 matrices 16 x 64 split over 8 devices, rank 8: on their rows they move to their
  columns (``owners.relay_split``), on their columns they stay; either way each device
  draws every basis whole and projects its columns in one loop over the stack
  (``owners.drawn_projections``), and every update of 5 steps equals the float64
  re-derivation to float32 rounding."""
  drawn = _drawn_shapes(monkeypatch)
  err = _apollo_error_on_explicit_axes(
      8, P(None, "fsdp", None) if split == "rows" else P(None, None, "fsdp"))
  assert drawn and drawn[0] == [(8, 16, 64)], drawn
  assert err < 1e-4, err


def test_random_projections_moved_to_columns_the_devices_do_not_divide_against_float64(
    monkeypatch):
  """8 matrices 16 x 66 split on their rows over 8 devices (which do not divide 66),
  rank 8: they move to their columns (``owners.relay_split``), padded to 72 for the
  bases drawn where the columns are (``owners.drawn_projections``), and every update
  of 5 steps equals the float64 re-derivation to float32 rounding."""
  moved = _recorded(monkeypatch, "relay_split")
  drawn = _drawn_shapes(monkeypatch)
  err = _apollo_error_on_explicit_axes(8, P(None, "fsdp", None), n=66)
  assert moved and moved[0] == [(2, "fsdp")], moved
  assert drawn and drawn[0] == [(8, 16, 66)], drawn
  assert err < 1e-4, err


@pytest.mark.slow
def test_zero_and_nan_gradients_of_a_gradient_moved_to_its_columns():
  """A zero or NaN gradient in a row-split matrix that moves to its columns (Explicit
  axes, the coefficients' state split): the update of one device, the degenerate leaf
  alone affected."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = lambda: util.random_tree(RELAY_PARAMS, 0, 0.1)  # noqa: E731
  grads = lambda t: util.random_tree(RELAY_PARAMS, 100 + 7 * t)  # noqa: E731
  util.assert_zero_and_nan_stay_in_their_leaf(_relay_tx("galore"), RELAY_PARAMS, params,
                                              grads, RELAY_SPECS, mesh, leaf="sq",
                                              other="stack")


@pytest.mark.parametrize("explicit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_tall_coefficient_matrix_refreshes_its_basis_where_its_rows_are(explicit,
                                                                         monkeypatch):
  """Alice-SOAP's right basis of 2 matrices 8 x 64: each one's coefficients ``sigma^T``
  (64 rows) is larger than a device's share of the refresh, so its basis is refreshed
  where its rows are (``owners.rows_in_place``, ``owners.on_rows``), the first refresh
  by a tall-skinny QR of its blocks of rows (``linalg.split_left_singular``: 8 rows a
  device, 3 columns); every update of 7 steps (refreshes at 1, 4 and 7) equals the dense
  float64 re-derivation."""
  shape = (2, 8, 64)
  calls, split = [], []
  on_rows, split_svd = owners.on_rows, linalg.split_left_singular
  monkeypatch.setattr(owners, "on_rows",
                      lambda body, items, *a: calls.append([i[0].shape for i in items])
                      or on_rows(body, items, *a))
  monkeypatch.setattr(linalg, "split_left_singular",
                      lambda a, axes: split.append(a.shape) or split_svd(a, axes))
  grads = util.structured_grads(shape, 7, seed=4)
  kw = registry.WITH_REFERENCE["alice_soap"]
  want = util.run_reference("alice_soap", shape, grads, **kw)
  spec = P(None, None, ("fsdp", "tensor"))
  layout = True if explicit else fo.OwnerLayout(param_specs={"w": spec})
  tx = fo.alice_soap(util.LR, dims=util.STACK, **kw, owner_layout=layout)
  got = util.updates_on_mesh(tx, shape, grads, _mesh(explicit), spec)
  assert calls and calls[0] == [(2, 64, 3)], calls
  assert split and split[0] == (8, 3), split
  err = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(got, want))
  assert err < 1e-4, err
