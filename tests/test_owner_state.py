"""State kept in the owner layout across steps: the rotation family with
``owner_layout=mesh`` (``rotate(..., owners=P)``, ``parallel/owners.py``'s
``run_owned`` and ``placement``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fisher_optax as fo
from benchmarks import collectives
from fisher_optax.blocks.rotate import rotate
from fisher_optax.parallel import owners
from tests import registry, util

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

# 8 + 1 matrices of 16 x 32 (9: padded), 4 of 32 x 16, one square, one wide 4 x 64
# (Eigen-Adam rotates its 4 side where its shards are), a vector on the fallback
PARAMS = {"stack": (8, 16, 32), "w": (16, 32), "t": (4, 32, 16), "sq": (16, 16),
          "wide": (4, 64), "b": (16,)}
SPECS = {"stack": P(None, "fsdp", "tensor"), "w": P("fsdp", "tensor"),
         "t": P(None, "tensor", "fsdp"), "sq": P("tensor", "fsdp"),
         "wide": P(None, ("fsdp", "tensor")), "b": P("tensor")}
DIMS = {k: (None if len(s) < 2 else fo.MatrixDims()) for k, s in PARAMS.items()}
ROTATION = {"soap": dict(precondition_frequency=2), "eigen_adam": dict(interval=2),
            "shampoo": dict(interval=2)}
# where updates are compared, SOAP rotates the wide matrix's 4 side only: its 64 x 64
# statistic has rank 4 or so after a step, a basis of that null space is arbitrary, and
# runs that batch their decompositions differently differ there (3.3e-3 of the change
# at XLA:CPU's own optimization level, measured; tests/test_rotate.py). So too the 16
# side alone of the 16 x 32 and 32 x 16 matrices: the owned stack holds the 32 x 16
# ones transposed (rotate's `transposable`), which sums their 32 x 32 statistic, singular
# after a step, in another order (0.4 of the change, measured)
EQUAL = {"soap": dict(max_precond_dim=16)}


def _params():
  return util.random_tree(PARAMS, 0, 0.1)


def _grads(t):
  return util.random_tree(PARAMS, 100 + 7 * t)


def _mesh(explicit=False):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(kind, kind))


def _tx(name, owner, equal=False):
  """``name`` with ``owner_layout=owner``; ``equal``: the settings its updates are
  compared with (``EQUAL``)."""
  return getattr(fo, name)(0.01, dims=DIMS, stack_matrices=False, owner_layout=owner,
                           **ROTATION[name], **(EQUAL.get(name, {}) if equal else {}))


def _run(tx, steps, mesh=None, params=None, state=None, start=0, donate=False):
  return util.run_sharded(tx, _params() if params is None else params, _grads, SPECS, steps,
                          mesh, state, start, donate)


def _close(got, want, what, tol=1e-3):
  util.assert_close_change(got, want, _params(), what, tol)


# the default run: Eigen-Adam on Explicit axes (SOAP on Explicit axes took 14 s of the
# default run's 6 minutes; its owned state stays in the default run through its dense
# float64 re-derivation on the mesh); CI's slow step runs the rest
_EQUAL = [pytest.param(name, explicit, id=f"{name}-{'explicit' if explicit else 'auto'}_axes",
                       marks=() if name == "eigen_adam" and explicit else pytest.mark.slow)
          for name in ROTATION for explicit in (False, True)]


@pytest.mark.parametrize("name,explicit", _EQUAL)
def test_state_in_the_owner_layout_gives_the_single_device_updates(name, explicit):
  """5 steps (refreshes every 2) on the 4 x 2 mesh, the state on its owners: the updates
  of one device with the state laid out per leaf; the parameters keep their shardings;
  and on one device the owned state gives those updates too."""
  mesh = _mesh(explicit)
  want, _ = _run(_tx(name, False, equal=True), 5)
  alone, _ = _run(_tx(name, mesh, equal=True), 5)
  _close(alone, want, f"{name}, owned state on one device")
  with jax.set_mesh(mesh):
    got, state = _run(_tx(name, mesh, equal=True), 5, mesh)
  _close(got, want, f"{name}, owned state on the mesh")
  spec = (jax.typeof(got["w"]).sharding.spec if explicit else got["w"].sharding.spec)
  assert spec == SPECS["w"]
  owned = state.inner_states["structured"].inner_state[0].owned
  for leaf in jax.tree.leaves([o.left for o in owned.values()]):
    assert leaf.shape[0] % 8 == 0
    assert leaf.sharding.spec == P(("fsdp", "tensor")), leaf.sharding


@pytest.mark.slow
@pytest.mark.parametrize("name", ["soap", "eigen_adam", "shampoo"])
def test_donated_state_in_the_owner_layout_gives_the_single_device_updates(name,
                                                                           monkeypatch):
  """The step donating the parameters and the state, as a training step does, so that
  XLA writes the new state into the old one's buffers through the owners' conditionals
  (the 16 x 16 matrix has one owner: traced under the conditional, asserted) and the
  refresh's: 5 steps (refreshes every 2) on the 4 x 2 mesh give the updates of one
  device, and XLA could use every donated buffer (JAX warns of any it could not)."""
  import warnings
  under_conditional = []
  on_owner = owners._on_owner

  def spy(body, g, stack, state, holds):
    under_conditional.append(holds is not None)
    return on_owner(body, g, stack, state, holds)

  monkeypatch.setattr(owners, "_on_owner", spy)
  mesh = _mesh()
  want, _ = _run(_tx(name, False, equal=True), 5)
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*donated buffers were not usable")
    got, state = _run(_tx(name, mesh, equal=True), 5, mesh, donate=True)
  _close(got, want, f"{name}, donated state on the mesh")
  assert isinstance(_rotation_state(state), fo.RotateOwnedState)
  assert any(under_conditional), under_conditional


def _rotation_state(state):
  return state.inner_states["structured"].inner_state[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["soap", "shampoo", "eigen_adam"])
def test_built_under_a_mesh_the_state_is_on_owners_by_default(name):
  """No ``owner_layout`` given: built under ``jax.set_mesh`` of the 4 x 2 mesh, the
  optimizer keeps its state on the owners, laid out for 8 devices (every matrix owned
  once); 5 steps give the updates of the same optimizer built without a mesh (state
  per leaf) on one device; an ordinary step and a refresh send what they send with
  ``owner_layout=mesh`` (Shampoo: the two exchanges and nothing else)."""
  build = lambda: getattr(fo, name)(0.01, dims=DIMS, stack_matrices=False,  # noqa: E731
                                    **ROTATION[name], **EQUAL.get(name, {}))
  want, single = _run(build(), 5)
  assert type(_rotation_state(single)).__name__ == "RotateState"
  mesh = _mesh()
  with jax.set_mesh(mesh):
    tx = build()
    got, state = _run(tx, 5, mesh)
  _close(got, want, f"{name}, default layout on the mesh")
  rot = _rotation_state(state)
  assert isinstance(rot, fo.RotateOwnedState) and rot.load.shape == (8,)
  here = {"b"} if name == "shampoo" else {"b", "wide"}  # one-sided wide: in place
  assert int(np.sum(rot.load)) == sum(int(np.prod(s)) for k, s in PARAMS.items()
                                      if k not in here)
  text, given = _compiled(tx, mesh), _compiled(_tx(name, mesh, equal=True), mesh)
  for refresh in (False, True):
    sent = collectives.traffic(text, 8, refresh=refresh)[0]
    assert sent == collectives.traffic(given, 8, refresh=refresh)[0], (refresh, sent)
    if name == "shampoo":  # every matrix to its owner (the others: wide in place)
      assert sent.collectives == 2 and set(k for k, v in sent.sent.items() if v) == {
          "all-to-all"}, (refresh, sent)


@pytest.mark.slow
def test_a_device_that_owns_none_of_a_size_does_no_work_for_it():
  """SOAP's one 16 x 16 matrix has a stack of 8 slots, one per device, 7 of them
  padding: after 3 steps (a refresh at 1) on the mesh, only its owner's slot has a
  basis; the other devices ran the step on no matrix (an eigendecomposition of their
  zero statistics would have given them one), yet advanced the stack's step counter
  with it."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    _, state = _run(_tx("soap", mesh), 3, mesh)
  group = _rotation_state(state).owned["16x16"]
  bases = np.asarray(group.left.basis["16x16"])
  assert bases.shape[0] == 8
  assert [bool(np.abs(b).sum() > 0) for b in bases].count(True) == 1, bases.sum((1, 2))
  assert int(group.count) == 3


@pytest.mark.slow
def test_without_a_mesh_that_shards_the_matrices_the_default_state_is_per_leaf():
  """Built with no context mesh, SOAP's default state is per leaf wherever ``init`` runs
  (its structure is the optimizer's: an abstract state from outside a mesh fits the
  state made inside one) and its update is the one of ``owner_layout=False``, program
  for program. Built under a mesh with ``Explicit`` axes, it keeps the state per leaf
  for parameters replicated over them (data parallelism) and on owners for sharded
  ones."""
  params = _params()
  tx, off = _tx("soap", "auto"), _tx("soap", False)
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(off.init(params))
  lower = lambda t, p: jax.jit(t.update).lower(p, t.init(p), p).as_text()  # noqa: E731
  assert lower(tx, params) == lower(off, params)
  mesh, emesh = _mesh(), _mesh(explicit=True)
  with jax.set_mesh(mesh):
    assert jax.tree.structure(jax.eval_shape(tx.init, params)) == \
        jax.tree.structure(off.init(params))
  replicated = jax.device_put(params, NamedSharding(emesh, P()))
  sharded = jax.device_put(params, {k: NamedSharding(emesh, v) for k, v in SPECS.items()})
  with jax.set_mesh(emesh):
    tx = _tx("soap", "auto")
    assert type(_rotation_state(tx.init(replicated))).__name__ == "RotateState"
    assert lower(tx, replicated) == lower(off, replicated)
    assert isinstance(_rotation_state(tx.init(sharded)), fo.RotateOwnedState)


# every matrix as the owner layout guesses a two-axis mesh lays it out (Megatron's
# column-parallel layout: rows over the first axis, columns over the last)
GUESSED = {**SPECS, "t": P(None, "fsdp", "tensor"), "sq": P("fsdp", "tensor"),
           "wide": P("fsdp", "tensor")}


# SOAP on square matrices: its larger side's statistic is singular after one gradient
# otherwise, and any basis of that null space is an eigenbasis (tests/test_rotate.py)
@pytest.mark.parametrize("name,shape", [
    ("soap", (10, 16, 16)), ("eigen_adam", (10, 16, 24)),
    pytest.param("shampoo", (10, 16, 24), marks=pytest.mark.slow), ("shampoo", (3, 16, 24))])
def test_owned_state_matches_the_dense_float64_reference(name, shape):
  """10 matrices (padded to 16 slots on 8 devices), or 3 (5 devices own none and run
  the step on no matrix), 8 steps with refreshes every 3 (SOAP: power-QR after updates
  3 and 6): every update on the 4 x 2 mesh, state on the owners, within 2e-4 of the
  float64 re-derivation (``tests/reference.py``), as on one device."""
  kw = registry.WITH_REFERENCE[name]
  grads = util.structured_grads(shape, 8, seed=2)
  want = util.run_reference(name, shape, grads, **kw)
  mesh = _mesh()
  tx = getattr(fo, name)(util.LR, dims=util.STACK, stack_matrices=False, owner_layout=mesh,
                         **kw)
  got = util.updates_on_mesh(tx, shape, grads, mesh, P(None, "fsdp", "tensor"))
  for t, (a, b) in enumerate(zip(got, want), start=1):
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
    assert err < 2e-4, f"{name} step {t}: relative error {err:.2e}"


@pytest.mark.parametrize("shapes,stacks", [
    ({"a": (3, 16, 24), "b": (2, 24, 16)}, {"16x24": 8}),
    ({"a": (8, 16, 24), "b": (8, 24, 16)}, {"16x24": 8, "24x16": 8})])
def test_transposed_matrices_share_a_stack_where_that_takes_fewer_slots(shapes, stacks):
  """Shampoo commutes with transposing (both sides rotated, its inner the identity). On
  the 4 x 2 mesh, 3 matrices of 16 x 24 and 2 of 24 x 16 share one stack of 8 slots
  (one per device, the 24 x 16 ones transposed) instead of two stacks of 8; 8 and 8
  need a slot per device either way and stay apart. 6 steps with refreshes every 3:
  every update of both leaves within 2e-4 of its own float64 re-derivation."""
  kw = registry.WITH_REFERENCE["shampoo"]
  mesh = _mesh()
  tx = fo.shampoo(util.LR, dims=util.STACK, stack_matrices=False, owner_layout=mesh, **kw)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  owned = _rotation_state(jax.eval_shape(tx.init, params)).owned
  assert {k: v.left.stats[k].shape[0] for k, v in owned.items()} == stacks
  grads = {k: util.structured_grads(s, 6, seed=2 + i) for i, (k, s) in enumerate(shapes.items())}
  got = util.tree_updates_on_mesh(tx, shapes, [{k: g[t] for k, g in grads.items()}
                                               for t in range(6)],
                                  mesh, {k: P(None, "fsdp", "tensor") for k in shapes})
  for k, s in shapes.items():
    want = util.run_reference("shampoo", s, grads[k], **kw)
    for t, b in enumerate(want):
      a = got[t][k]
      err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
      assert err < 2e-4, f"{k} step {t + 1}: relative error {err:.2e}"


def _compiled(tx, mesh, specs=GUESSED, params=None):
  """The compiled update under ``jax.set_mesh(mesh)``, its state made and laid out there."""
  params = _params() if params is None else params
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  shaped = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t, sh)
  with jax.set_mesh(mesh):
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    state = jax.eval_shape(tx.init, params)
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    return step.lower(shaped(params, p_sh), shaped(state, s_sh),
                      shaped(params, p_sh)).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_owned_state_refreshes_and_updates_with_two_all_to_alls(name):
  """Both sides rotated, every matrix to an owner: an ordinary step and a refresh step
  each send exactly the two exchanges (gradients to the owners, updates back) and less
  than the parameter layout does; the refresh adds nothing (its decompositions are
  local to the owners). Where the parameters' layout is not the one the owner layout
  guesses, XLA reshards on the way, and the update still sends less."""
  mesh = _mesh()
  on, off = _compiled(_tx(name, mesh), mesh), _compiled(_tx(name, False), mesh)
  ordinary, _ = collectives.traffic(on, 8, refresh=False)
  refresh, _ = collectives.traffic(on, 8, refresh=True)
  before, _ = collectives.traffic(off, 8, refresh=True)
  assert ordinary.collectives == refresh.collectives == 2, (ordinary, refresh)
  assert set(k for k, v in refresh.sent.items() if v) == {"all-to-all"}, refresh.sent
  assert refresh.total == ordinary.total < before.total, (refresh.total, before.total)
  params = sum(int(np.prod(s)) * 4 for s in PARAMS.values())
  # each way about (P - 1) / P^2 of the bytes, more by the balance of whole matrices
  assert refresh.total < 0.5 * params, refresh.total / params
  other = collectives.traffic(_compiled(_tx(name, mesh), mesh, SPECS), 8, refresh=True)[0]
  assert other.total < collectives.traffic(_compiled(_tx(name, False), mesh, SPECS), 8,
                                           refresh=True)[0].total


@pytest.mark.slow
@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_a_state_kept_per_leaf_is_refreshed_from_where_it_is_held(name):
  """Built outside any mesh (as MaxText builds its optimizer), the rotation family keeps
  its state per leaf, laid out as ``fo.state_shardings`` says; under the owner layout
  with each matrix's split given, a refresh moves each split side's statistics to an
  owner from that layout and its new basis back to it, and refreshes a side held whole
  where it is. 5 steps (refreshes every 2) on the 4 x 2 mesh give the updates of one
  device; an ordinary step sends what it sends with the layout off, a refresh less.
  (Sides rotated up to 16 only: the larger side's statistic of a 16 x 32 gradient is
  singular after a step, and the basis of its null space that a decomposition returns
  depends on the order its sums were taken in.)"""
  build = lambda owner: getattr(fo, name)(  # noqa: E731
      0.01, dims=DIMS, stack_matrices=False, owner_layout=owner, max_precond_dim=16,
      **ROTATION[name])
  given = fo.OwnerLayout(param_specs=SPECS)
  assert type(_rotation_state(build(given).init(_params()))).__name__ == "RotateState"
  want, _ = _run(build(False), 5)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    got, _ = _run(build(given), 5, mesh)
  _close(got, want, f"{name}, per-leaf state under the owner layout")
  on, off = _compiled(build(given), mesh, SPECS), _compiled(build(False), mesh, SPECS)
  sent = {(layout, refresh): collectives.traffic(text, 8, refresh=refresh)[0].total
          for layout, text in (("on", on), ("off", off)) for refresh in (False, True)}
  assert sent["on", False] == sent["off", False], sent
  assert sent["on", True] < 0.8 * sent["off", True], sent


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero_and_nan",
                                  pytest.param("bfloat16_params", marks=pytest.mark.slow),
                                  pytest.param("tiny", marks=pytest.mark.slow),
                                  pytest.param("huge", marks=pytest.mark.slow)])
def test_a_state_kept_per_leaf_takes_bad_gradients_as_one_device_does(case):
  """SOAP built outside any mesh (state per leaf) under the owner layout on the 4 x 2
  mesh, its refreshes from the state's layout: zero gradients leave the parameters
  unchanged and NaN ones stay in their leaf, as on one device; gradients near 1e-30 and
  1e18 and bfloat16 parameters give finite updates in the parameters' dtype, those of
  one device."""
  mesh = _mesh()
  dtype = jnp.bfloat16 if case == "bfloat16_params" else jnp.float32
  scale = {"tiny": 1e-30, "huge": 1e18}.get(case, 1.0)
  build = lambda owner: fo.soap(0.01, dims=DIMS, stack_matrices=False,  # noqa: E731
                                owner_layout=owner, max_precond_dim=16,
                                **ROTATION["soap"])
  tx = build(fo.OwnerLayout(param_specs=SPECS))
  params = lambda: jax.tree.map(lambda x: x.astype(dtype), _params())  # noqa: E731
  if case == "zero_and_nan":
    util.assert_zero_and_nan_stay_in_their_leaf(tx, PARAMS, params, _grads, SPECS, mesh)
    return
  grads = lambda t: jax.tree.map(lambda g: (g * scale).astype(dtype), _grads(t))  # noqa: E731
  want, _ = util.run_sharded(build(False), params(), grads, SPECS, 3)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(tx, params(), grads, SPECS, 3, mesh)
  for k in PARAMS:
    assert got[k].dtype == dtype, (k, got[k].dtype)
    assert np.isfinite(np.asarray(got[k], np.float32)).all(), k
  util.assert_close_change(got, want, params(), case, 5e-3 if dtype == jnp.bfloat16 else 1e-3)


# MaxText's kernels: the layer axis between the matrix axes (its Muon dimension numbers),
# column- and row-parallel under FSDP x TP
LAYERS = {"up": (32, 4, 64), "down": (64, 4, 32), "q": (32, 4, 32)}
LAYER_SPECS = {"up": P("fsdp", None, "tensor"), "down": P("tensor", None, "fsdp"),
               "q": P("fsdp", None, "tensor")}
LAYER_DIMS = {k: optax.contrib.MuonDimensionNumbers(reduction_axis=(0,), output_axis=(2,))
              for k in LAYERS}


@pytest.mark.parametrize("name", [pytest.param("soap", marks=pytest.mark.slow), "shampoo",
                                  pytest.param("eigen_adam", marks=pytest.mark.slow)])
def test_a_state_kept_per_leaf_keeps_its_layout_through_the_refresh(name):
  """Per-leaf state of stacked layer kernels (as MaxText's) under the owner layout on the
  4 x 2 mesh: an ordinary step sends no more than with the layout off (Shampoo, which
  rotates with the bases its refresh returns, within 1%: the eigenvalues the conditional
  returns are laid out by XLA), a refresh at most 0.8 of it (Shampoo: 0.75). Left to
  XLA, the bases Shampoo's refresh returned took the layout its rotated update wanted,
  and went back to the state's at every step (20% more than off)."""
  params = util.random_tree(LAYERS, 0, 0.1)
  build = lambda owner: getattr(fo, name)(0.01, dims=LAYER_DIMS,  # noqa: E731
                                          stack_matrices=False, owner_layout=owner)
  mesh = _mesh()
  texts = {layout: _compiled(build(owner), mesh, LAYER_SPECS, params) for layout, owner in
           (("on", fo.OwnerLayout(param_specs=LAYER_SPECS)), ("off", False))}
  sent = {(layout, refresh): collectives.traffic(text, 8, refresh=refresh)[0].total
          for layout, text in texts.items() for refresh in (False, True)}
  assert sent["on", False] <= 1.01 * sent["off", False], sent
  assert sent["on", True] < 0.8 * sent["off", True], sent


def _loads_and_slots(counts, sizes, devices):
  slots, lengths = owners.placement(counts, sizes, devices)
  load = [0] * devices
  for g, (sl, n) in enumerate(zip(slots, lengths)):
    assert n % devices == 0 and len(set(sl)) == counts[g] and all(0 <= s < n for s in sl)
    for s in sl:
      load[s // (n // devices)] += sizes[g]
  return max(load), sum(n // devices * z for n, z in zip(lengths, sizes))


def test_placement_balances_whole_matrices_over_the_devices():
  """Every matrix gets its own slot, each device ``c_g`` slots per group, and the
  largest load is no more than the larger of the mean and the largest matrix, plus the
  largest matrix (longest processing time first)."""
  counts, sizes = [2, 12, 16, 1], [2048 * 128, 128 * 344, 128 * 128, 7]
  top, _ = _loads_and_slots(counts, sizes, 8)
  total = sum(c * z for c, z in zip(counts, sizes))
  assert top <= max(total / 8, max(sizes)) + max(sizes)
  assert top == max(sizes)  # the two 2048-wide matrices alone on their devices


def test_placement_spreads_each_group_where_that_keeps_the_largest_load():
  """Every device runs the same program on ``c_g`` slots of each group, so a group
  piled on a few devices costs every device. 24 MLP matrices and 32 square ones on 32
  devices: one slot of each (not three squares on the devices without an MLP matrix),
  with the same largest load as longest processing time first. On random groups the
  largest load never exceeds that of longest processing time first, computed here
  independently, and the slots never cost more."""
  big, square = 512 * 1376, 512 * 512
  top, cost = _loads_and_slots([24, 32], [big, square], 32)
  assert (top, cost) == (big + square, big + square)

  def lpt(counts, sizes, devices):
    load, cost = [0] * devices, 0
    for g in sorted(range(len(counts)), key=lambda g: (-sizes[g], g)):
      held = [0] * devices
      for _ in range(counts[g]):
        d = min(range(devices), key=lambda x: (load[x], held[x], x))
        held[d] += 1
        load[d] += sizes[g]
      cost += max(held, default=0) * sizes[g]
    return max(load), cost

  rng = np.random.default_rng(0)
  for _ in range(200):
    groups = int(rng.integers(1, 5))
    counts = [int(c) for c in rng.integers(1, 40, groups)]
    sizes = [int(z) for z in rng.integers(1, 5000, groups)]
    devices = int(rng.choice([2, 4, 8, 16, 32]))
    got, want = _loads_and_slots(counts, sizes, devices), lpt(counts, sizes, devices)
    assert got[0] <= want[0] and got[1] <= want[1], (counts, sizes, devices, got, want)


@pytest.mark.slow
def test_the_owned_state_checkpoints_and_resumes_on_one_device_and_a_smaller_mesh(tmp_path):
  """SOAP stopped after 2 steps on the 4 x 2 mesh, saved with orbax, restored onto a
  2 x 2 mesh (4 devices, which divide the stacks: still on owners; the context mesh
  comes first) and onto one device: both continuations give the uninterrupted
  single-device run."""
  mesh = _mesh()
  want, _ = _run(_tx("soap", False, equal=True), 5)
  # built for the 4 x 2 mesh: on one device, a context mesh of that device says where it
  # now runs
  got, got1 = util.resume_elsewhere(tmp_path / "ck", _tx("soap", mesh, equal=True), _run,
                                    SPECS, mesh, 2, 3, one_device_mesh=True)
  _close(got, want, "4x2 -> 2x2")
  _close(got1, want, "4x2 -> 1")


@pytest.mark.slow
def test_zero_and_nan_gradients_stay_in_their_leaf_with_the_state_on_owners():
  """A zero gradient leaves its parameter unchanged and a NaN gradient makes only its
  own leaf NaN, on the mesh as on one device (the padding slots hold zeros)."""
  mesh = _mesh()
  util.assert_zero_and_nan_stay_in_their_leaf(_tx("eigen_adam", mesh), PARAMS, _params,
                                              _grads, SPECS, mesh)


def test_describe_counts_the_owned_stacks_with_their_padding():
  """``fo.describe`` gives each leaf its share of the owned stacks of its size: the
  single 16 x 16 matrix carries the 7 padding slots of its stack of 8."""
  mesh = _mesh()
  rows = {r.path: r for r in fo.describe(_tx("eigen_adam", mesh), _params()).rows}
  plain = {r.path: r for r in fo.describe(_tx("eigen_adam", False), _params()).rows}
  # and the step counter of its stack's state
  assert rows["sq"].state_numbers == 8 * plain["sq"].state_numbers + 1
  assert rows["wide"].state_numbers == plain["wide"].state_numbers  # rotated in place
  assert rows["b"].state_numbers == plain["b"].state_numbers


def test_owners_is_a_positive_count():
  with pytest.raises(ValueError, match="owners"):
    rotate(optax.identity(), owners=0)


def test_a_wide_one_sided_matrix_is_rotated_where_its_shards_are():
  """Eigen-Adam's 4 x 64 matrix (rotated on its 4 side, at most 1/8 of the other) stays
  out of the owners: its moments split on the 64 side over every mesh axis, its 4 x 4
  statistics and basis whole; laid out so, its update sends only the all-reduce of the
  statistics, a few percent of its bytes."""
  mesh = _mesh()
  tx = _tx("eigen_adam", mesh)
  specs = fo.state_partition_specs(tx, _params(), SPECS, mesh=mesh)
  local = specs.inner_states["structured"].inner_state[0].local
  assert local.inner_state.mu["wide"] == P(None, ("fsdp", "tensor"))
  assert local.left.stats["wide"] == P() and local.left.basis["wide"] == P()
  assert "4x64" not in specs.inner_states["structured"].inner_state[0].owned
  only = {"wide": PARAMS["wide"]}
  params = util.random_tree(only, 0, 0.1)
  one = {"wide": P(None, ("fsdp", "tensor"))}
  tx = fo.eigen_adam(0.01, dims={"wide": fo.MatrixDims()}, stack_matrices=False,
                     owner_layout=mesh, interval=2)
  text = _compiled(tx, mesh, one, params)
  sent = collectives.traffic(text, 8, refresh=True)[0]
  assert sent.total <= 0.2 * 4 * 64 * 4, sent
  assert set(k for k, v in sent.sent.items() if v) <= {"all-reduce"}, sent.sent


def test_a_column_parallel_one_sided_matrix_spreads_within_its_own_split():
  """A one-sided wide matrix split as tensor parallelism's output layer (rows over
  ``fsdp``, its 64 columns over ``tensor``): where the update knows that split
  (``Explicit`` axes, or the specs given), ``fo.state_shardings`` and the update both
  lay its moments on the 64 side over ``tensor`` first, so the gradient gets there by
  an all-to-all within each ``tensor`` block and no permutation across them; split
  guessed (``Auto`` axes), both keep the mesh's order, as before."""
  only = {"wide": PARAMS["wide"]}
  params = util.random_tree(only, 0, 0.1)
  col = {"wide": P("fsdp", "tensor")}

  def build(layout):
    return fo.eigen_adam(0.01, dims={"wide": fo.MatrixDims()}, stack_matrices=False,
                         owner_layout=layout, interval=2)

  for mesh, layout, order in [
      (_mesh(explicit=True), _mesh(explicit=True), ("tensor", "fsdp")),
      (_mesh(), fo.OwnerLayout(mesh=_mesh(), param_specs=col), ("tensor", "fsdp")),
      (_mesh(), _mesh(), ("fsdp", "tensor"))]:
    tx = build(layout)
    specs = fo.state_partition_specs(tx, params, col, mesh=mesh)
    assert specs.inner_states["structured"].inner_state[0].local.inner_state.mu["wide"] == \
        P(None, order)
    sent = collectives.traffic(_compiled(tx, mesh, col, params), 8, refresh=False)[0]
    kinds = {k for k, v in sent.sent.items() if v}
    if order[0] == "tensor":
      assert "collective-permute" not in kinds, sent.sent


@pytest.mark.parametrize("case", ["bfloat16_transport"] + [
    pytest.param(c, marks=pytest.mark.slow) for c in ("tiny", "huge", "bfloat16_params")])
def test_scales_dtypes_and_transport_with_the_state_on_owners(case):
  """Gradients near 1e-30 and 1e18, bfloat16 parameters, and bfloat16 transport to and
  from the owners: Eigen-Adam (scale-invariant) gives finite updates on the mesh, the
  single-device ones (float32 transport; bfloat16 transport within its rounding), in the
  parameters' dtype."""
  mesh = _mesh()
  scale = {"tiny": 1e-30, "huge": 1e18}.get(case, 1.0)
  dtype = jnp.bfloat16 if case == "bfloat16_params" else jnp.float32
  params = lambda: jax.tree.map(lambda x: x.astype(dtype), _params())  # noqa: E731
  grads = lambda t: jax.tree.map(lambda g: (g * scale).astype(dtype), _grads(t))  # noqa: E731
  owner = (fo.OwnerLayout(mesh=mesh, transport_dtype=jnp.bfloat16)
           if case == "bfloat16_transport" else mesh)
  tx = fo.eigen_adam(0.01, dims=DIMS, stack_matrices=False, owner_layout=owner, interval=2)
  want, _ = util.run_sharded(_tx("eigen_adam", False), params(), grads, SPECS, 3)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(tx, params(), grads, SPECS, 3, mesh)
  for k in PARAMS:
    assert got[k].dtype == dtype, (k, got[k].dtype)
    assert np.isfinite(np.asarray(got[k], np.float32)).all(), k
  # measured: 6.3e-4 (bfloat16 parameters), 4.8e-2 (bfloat16 transport: Adam's
  # per-coordinate scaling magnifies the rounding of small coordinates), 5e-6 (1e18)
  tol = {"bfloat16_params": 5e-3, "bfloat16_transport": 0.1}.get(case, 1e-3)
  util.assert_close_change(got, want, params(), case, tol)


@pytest.mark.slow
def test_a_matrix_the_mesh_does_not_split_is_updated_where_xla_lays_it_out():
  """A 6 x 10 matrix (neither side a multiple of the 4 x 2 mesh's axes) beside the
  others: its stack cannot go to owners and is updated where XLA lays it out, the
  other sizes still go to their owners (the update sends all-to-alls), and the updates
  are still one device's."""
  shapes = {**PARAMS, "odd": (6, 10)}
  specs = {**SPECS, "odd": P()}
  dims = {**DIMS, "odd": fo.MatrixDims()}
  params = lambda: util.random_tree(shapes, 0, 0.1)  # noqa: E731
  grads = lambda t: util.random_tree(shapes, 100 + 7 * t)  # noqa: E731
  mesh = _mesh()
  build = lambda owner: fo.eigen_adam(0.01, dims=dims, stack_matrices=False,  # noqa: E731
                                      owner_layout=owner, interval=2)
  want, _ = util.run_sharded(build(False), params(), grads, specs, 5)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(build(mesh), params(), grads, specs, 5, mesh)
  util.assert_close_change(got, want, params(), "odd matrix")
  # SOAP (every other matrix to its owner): the two exchanges, a small all-reduce, and
  # a small fraction of what the per-leaf layout sends
  soap = lambda owner: fo.soap(0.01, dims=dims, stack_matrices=False,  # noqa: E731
                               owner_layout=owner, precondition_frequency=2)
  sent = [collectives.traffic(_compiled(soap(owner), mesh, {**GUESSED, "odd": P()},
                                        params()), 8, refresh=True)[0]
          for owner in (mesh, False)]
  assert sent[0].count["all-to-all"] == 2, sent[0]
  assert sent[0].total < 0.1 * sent[1].total, (sent[0].total, sent[1].total)


# one case in the default run, the others in CI's slow step
@pytest.mark.parametrize("case", ["huge"] + [
    pytest.param(c, marks=pytest.mark.slow) for c in ("zero_and_nan", "tiny", "bfloat16_params")])
def test_a_matrix_held_transposed_takes_bad_gradients_as_one_device_does(case):
  """Shampoo on the mesh holds the 4 matrices of 32 x 16 transposed in the stack of the
  9 of 16 x 32 (``rotate``'s ``transposable``): a zero gradient leaves them unchanged,
  a NaN one makes only that leaf NaN (not the matrices it shares a stack and owners
  with), and gradients near 1e-30 and 1e15 and bfloat16 parameters give one device's
  updates, finite, in the parameters' dtype. (Near 1e18 Shampoo's summed float32
  statistics of the wide 4 x 64 matrix overflow, on one device as on the mesh.)"""
  mesh = _mesh()
  owned = _rotation_state(jax.eval_shape(_tx("shampoo", mesh).init, _params())).owned
  assert "32x16" not in owned and owned["16x32"].left.stats["16x32"].shape[0] == 16
  if case == "zero_and_nan":
    util.assert_zero_and_nan_stay_in_their_leaf(_tx("shampoo", mesh), PARAMS, _params,
                                                _grads, SPECS, mesh, leaf="t", other="stack")
    return
  scale = {"tiny": 1e-30, "huge": 1e15}.get(case, 1.0)
  dtype = jnp.bfloat16 if case == "bfloat16_params" else jnp.float32
  params = lambda: jax.tree.map(lambda x: x.astype(dtype), _params())  # noqa: E731
  grads = lambda t: jax.tree.map(lambda g: (g * scale).astype(dtype), _grads(t))  # noqa: E731
  want, _ = util.run_sharded(_tx("shampoo", False), params(), grads, SPECS, 3)
  with jax.set_mesh(mesh):
    got, _ = util.run_sharded(_tx("shampoo", mesh), params(), grads, SPECS, 3, mesh)
  for k in PARAMS:
    assert got[k].dtype == dtype, (k, got[k].dtype)
    assert np.isfinite(np.asarray(got[k], np.float32)).all(), k
  util.assert_close_change(got, want, params(), case, 5e-3 if case == "bfloat16_params"
                           else 1e-3)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "shampoo" else
                                               pytest.mark.slow) for n in ROTATION])
def test_convert_state_layout_moves_the_rotation_state_to_and_from_the_owners(name):
  """``fo.convert_state_layout`` between the rotation family's state on the owners (4 x 2
  mesh, split given) and its per-leaf state: fresh ``init`` s convert exactly into each
  other; per leaf -> owners -> per leaf returns the state unchanged; a per-leaf state
  after 3 steps continued on the owners for 2, and an owned one continued per leaf or
  on the owners of 4 devices, give the uninterrupted per-leaf run's updates. Shampoo's
  32 x 16 matrices are held transposed in the 16 x 32 stack (their sides swapped, their
  moments transposed); Eigen-Adam rotates the 4 x 64 matrix where its shards are."""
  mesh = _mesh()
  layout = fo.OwnerLayout(param_specs=SPECS, state_placed=True)
  with jax.set_mesh(mesh):
    tx = _tx(name, layout, equal=True)
  four = jax.make_mesh((4, 1), ("fsdp", "tensor"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(four):
    tx4 = _tx(name, layout, equal=True)
  kind = fo.RotateOwnedState
  owned_of = lambda st: next((x for x in jax.tree.leaves(  # noqa: E731
      st, is_leaf=lambda x: isinstance(x, kind)) if isinstance(x, kind)), None)
  per_leaf = _tx(name, False, equal=True)
  util.check_state_conversion(name, tx, tx4, per_leaf, per_leaf, mesh, _run, _close,
                              _params(), owned_of)
