"""The owner layout: whole-matrix work on the device that owns the matrix.

Under ``jax.jit`` with matrices sharded over a mesh (FSDP, tensor parallelism), GSPMD
partitions every product, Newton--Schulz iteration, eigh and QR of a sharded matrix on
its own, with collectives inside the loops, and gathers whole matrices onto every device
for the decompositions. In the owner layout the matrices that one whole-matrix function
serves (a stack of same-shape matrices, :func:`fisher_optax.grouping.map_grouped`) are
handed out along their stack axis: matrix ``j`` of a stack of ``k`` (padded to a multiple
of the device count ``P`` with copies of the last one) lives whole on device
``j // ceil(k / P)`` (devices in the mesh's order). One ``all_to_all`` per mesh axis
brings each matrix to its owner (each device sends the slice it holds of every matrix it
does not own), the owner runs the function on its whole local matrices with no
collective (``jax.shard_map``), and the inverse exchanges take the results back; results
that are optimizer state come back to every device instead. What each device sends per
function is then about ``2/P`` of the matrices' bytes, falling with the device count.

The layout is a placement: every matrix gets the function it gets on one device (tests
compare with single-device runs). :func:`owner_layout` turns it on for an optimizer's
update; :func:`map_whole` is what a block's whole-matrix function calls through, and
:func:`fisher_optax.parallel.packed.map_packed` serves all the stacks of one call
(:func:`fisher_optax.grouping.map_grouped`) in one exchange each way, placed together
so that no padding slot travels.

Where the matrices come from: the split each gradient has, read from its type on
``Explicit`` mesh axes or from ``OwnerLayout(param_specs=...)`` (:func:`view_split`),
else a guess from its shape (:func:`_matrix_split`) that XLA corrects matrix by matrix
where it is wrong. Leaves of one shape split differently travel from their own splits.

Which devices own: where the update knows the split, those of the mesh axes the
parameters are split over (:func:`exchange_axes`); a mesh axis every parameter is
replicated over (data-parallel replicas of FSDP) then carries nothing of the exchange,
and each replica group repeats the whole-matrix work of its own matrices.
``OwnerLayout(across_replicas=True)`` spreads that work over the replicas too. State
kept on the owners across steps (:func:`run_owned`) is spread over every device all
the same, so that its memory falls with the device count, unless
``OwnerLayout(state_axes=...)`` names fewer axes (:func:`state_mesh`).

Mesh: the one given to :func:`owner_layout`, else the context mesh of
``jax.set_mesh`` / ``jax.sharding.use_mesh`` (the ``Auto`` view that
:func:`fisher_optax.with_auto_axes` gives an ``Explicit`` mesh included). Without a mesh
of more than one device nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fisher_optax import linalg
from fisher_optax.parallel.roles import field_roles

AUTO = "auto"


class GuessedSplitWarning(UserWarning):
  """Warned when an update under the owner layout has to guess the matrices' split on a
  mesh of several axes (``Auto`` axes, no ``OwnerLayout(param_specs=...)``, no boxes
  naming mesh axes): the guess is Megatron's column-parallel layout, and a matrix split
  otherwise moves once more at every update (tiny LLaMA, data 2 x FSDP 4 on 8 CPU
  devices: Muon 0.35x of the parameter bytes per update guessed, 0.21x with the split
  given; SOAP 0.58x against 0.45x). ``OwnerLayout(guessed=True)`` silences it."""


@dataclasses.dataclass(frozen=True)
class OwnerLayout:
  """The owner layout's settings, for ``owner_layout=`` of a named optimizer or
  :func:`owner_layout`.

  Attributes:
    mesh: the mesh whose devices own the matrices where no context mesh
      (``jax.set_mesh``) is set at trace time (the context mesh comes first); ``None``:
      the context mesh only. Its size is also the device count the rotation family
      pads its state for, kept on the owners across steps (``rotate(..., owners=P)``).
    transport_dtype: the dtype matrices travel in to and from their owners (e.g.
      ``jnp.bfloat16``, as Moonlight sends Muon's gradients: half the bytes); the
      owners compute in float32 all the same. ``None``: the matrices' own dtype (float32
      inside the blocks).
    replicated: also on when the gradients are visibly replicated (``Explicit`` mesh
      axes and no leaf sharded over them); by default off there, since gathering the
      results back to every device would send more than computing everywhere.
    param_specs: the parameters' ``PartitionSpec`` s (a tree of the parameters'
      structure, as given to ``fo.state_shardings``), for a mesh with ``Auto`` axes,
      where a gradient's split is not visible while tracing: each matrix then travels
      to and from its owner from the split it has, and a refresh's bases come back
      split as the state keeps them. On ``Explicit`` axes the split is read from each
      gradient's type and this is not needed. ``None``: the split named by the boxes
      the parameters came to ``init`` in, where they name mesh axes (``nnx.Variable`` s
      of ``nnx.with_partitioning``, Linen's ``nn.with_partitioning``: the Flax recipes)
      or logical axes under logical axis rules in force at ``init`` (MaxText's);
      else a guess per shape (FSDP's split on a mesh of one axis, Megatron's
      column-parallel one on a mesh of several), which XLA corrects matrix by matrix
      where it is wrong (one more exchange of that matrix).
    guessed: also on where the update must guess the matrices' split on a mesh of
      several axes (``Auto`` axes, no ``param_specs``, no boxes naming mesh axes):
      ``"auto"`` (default) with a :class:`GuessedSplitWarning` the first time, ``True``
      without it. ``False`` turns the layout off there: for Alice-SOAP, whose bases are
      pinned where ``fo.state_shardings`` keeps them, a wrong guess moves them at every
      ordinary step (tiny LLaMA, FSDP 4 x TP 2 on 8 CPU devices: 0.60x of the parameter
      bytes per ordinary step guessed, 0.23x with the split known, 0.23x off).
    state_placed: with ``param_specs`` on ``Auto`` axes, a statement that the state is
      placed as ``fo.state_shardings(tx, params, param_specs, mesh)`` places it (the
      mesh given), so that the update may rely on its layout where it cannot read it:
      a low-rank source then moves a gradient split on its rows only to its columns
      where that sends less, as it does on ``Explicit`` axes (the 60M LLaMA under FSDP
      over 32 CPU devices: Alice-SOAP 0.186x -> 0.107x of the parameter bytes per
      ordinary step). It also tells ``fo.state_shardings`` that the update knows
      where the state is, so that the low-rank methods' coefficient moments of a
      matrix split on both sides (FSDP x tensor parallelism) are split over the FSDP
      axes too (on ``n`` where the devices divide it, else on ``r``), and summed and
      scattered there or reached by moving the gradient (the 60M LLaMA under FSDP 4 x
      TP 2 on 8 CPU devices: GaLore's state per device 0.26x -> 0.13x of the parameter
      bytes). Off by default: state placed otherwise (MaxText names it
      without a mesh, and holds the coefficients whole) would be gathered back at every
      step (MaxText's GaLore 0.21x -> 0.44x). On ``Explicit`` axes the state's layout
      is read from its types and this is not needed; boxes named by mesh axes, given
      to ``init`` under the mesh, say it themselves (the state's own boxes carry
      ``fo.state_shardings``' names, by which the Flax recipes lay it out).
    state_on_owners: the low-rank family's state (GaLore, Fira, Alice, Alice-0,
      Alice-SOAP) kept on the matrices' owners across steps
      (``fisher_optax.owned_stacks``): stacks of same-size matrices padded for the
      device count of ``mesh``, else of the context mesh when the optimizer is built;
      the gradients travel to their owners and the updates back by one ``all_to_all``
      each, and the tracking, the optimizer on the coefficients and the compensation
      run on whole local matrices. Each device then sends about ``2/P`` of those
      matrices' bytes per update instead of summing ``U^T G`` over a split side or
      gathering the basis ``U`` at every step. ``"auto"``
      (default): where the optimizer is built with a mesh of several devices (the
      context mesh, or ``mesh``), the split known (given in ``param_specs``, or read by
      ``init`` from the parameters' types on ``Explicit`` axes, or from the names of
      the boxes they come in on ``Auto`` axes where the matrices are not stacked) or
      the mesh of one axis (FSDP's split guessed), and a model of what each way sends
      moves some of the matrices (``fisher_optax.owned_stacks``); elsewhere, and for
      parameters visibly replicated over ``Explicit`` axes at ``init``, the state is
      laid out as the parameters. ``True``: asked for (an error without a mesh);
      ``False``: off.
    across_replicas: where the update knows the split and some mesh axis splits no
      parameter (data-parallel replicas of FSDP: a ``("data", "fsdp")`` mesh), the
      whole-matrix work of one update (Newton--Schulz, the refreshes' decompositions)
      also spread over that axis: each device then runs ``1/P`` of it instead of
      ``1/F`` (``F`` the size of the axes the parameters are split over), and sends
      part of its exchange across the replicas. By default (``False``) the owners are
      the devices of each replica group, and nothing of the exchange crosses between
      replicas, which are often the slowest links (across slices). State kept on the
      owners across steps (``state_on_owners``, the rotations' ``owners=P``) is spread
      over every device either way, unless ``state_axes`` says otherwise.
    state_axes: the mesh axes that state kept on the owners across steps (the rotation
      family's; the low-rank family's with ``state_on_owners``) is spread over: its
      stacks padded for the size of those axes and split over them, replicated over the
      others, its exchange within each group of their devices. ``None`` (default): every
      mesh axis, so that its memory falls with the device count. On data-parallel
      replicas of FSDP, ``("fsdp",)`` keeps it within each replica, as the parameters
      are: held once per replica (twice the memory per device with two replicas), and
      nothing of its exchange crosses between them. The parameters' split must lie
      within these axes; a matrix split over another axis is served where it is.
  """
  mesh: Any = None
  transport_dtype: Any = None
  replicated: bool = False
  param_specs: Any = dataclasses.field(default=None, hash=False, compare=False)
  guessed: Any = AUTO
  state_placed: bool = False
  state_on_owners: Any = AUTO
  across_replicas: bool = False
  state_axes: Optional[tuple] = None

  def __post_init__(self):
    if self.state_axes is not None:
      axes = (self.state_axes,) if isinstance(self.state_axes, str) else tuple(self.state_axes)
      if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError("OwnerLayout(state_axes=...) takes mesh axis names, e.g. "
                         f"('fsdp',), or None for every axis; got {self.state_axes!r}")
      object.__setattr__(self, "state_axes", axes)
      if self.mesh is not None:
        _check_axes(axes, self.mesh)


def _check_axes(axes: tuple, mesh) -> None:
  """Raises a ``ValueError`` where ``axes`` (``OwnerLayout.state_axes``) names an axis
  ``mesh`` lacks."""
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"OwnerLayout(state_axes={axes!r}): the mesh has no axis "
                     f"{missing[0]!r} (its axes: {tuple(mesh.axis_names)}); name axes of "
                     "the mesh the optimizer runs on, or None for every axis")


class _Active(NamedTuple):
  mesh: Any
  transport_dtype: Any
  specs: Optional[dict] = None  # path -> (the gradient's shape, its PartitionSpec)
  # path -> (shape, PartitionSpec) of arrays a block laid out from the gradient at that
  # path (a low-rank source's coefficients, :func:`coefficient_layout`)
  derived: Optional[dict] = None
  # path -> [(shape, PartitionSpec), ...] of the state arrays of the parameter at that
  # path, where their types show it (Explicit mesh axes), or [(shape, role), ...] where
  # the state is placed by fo.state_shardings' rules (OwnerLayout(state_placed=True)):
  # :func:`relay_split`
  held: Optional[dict] = None
  # whether fo.state_shardings laid the state out knowing the parameters' split, as the
  # update knows it (:func:`parameter_axes_first`)
  majors: bool = True
  # the mesh axes one update's exchanges span (:func:`exchange_axes`; None: every one)
  over: Optional[tuple] = None
  # the mesh axes the state kept on the owners is spread over (None: every one)
  state_over: Optional[tuple] = None


class _Axes(NamedTuple):
  """Some axes of a mesh, read as a mesh by the exchanges' layout arithmetic
  (``axis_names``, ``shape``): the owners of one update (:func:`exchange_mesh`) or of the
  state kept on them (:func:`state_mesh`)."""
  axis_names: tuple
  shape: dict


# The owner layout of the update being traced (None: off).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fisher_optax_owner_layout",
                                                         default=None)


class _Boxes(NamedTuple):
  specs: dict  # path -> (the parameter's shape, the PartitionSpec of its box's names)
  mesh: Any  # the mesh the boxes name (their metadata, or the context mesh), or None
  # path -> (shape, PartitionSpec) of those names mapped to mesh axes by the logical axis
  # rules in force at init, or None where none were
  ruled: Optional[dict] = None


# The parameters' boxes while ``init`` of a tree of boxes runs (None: plain arrays).
_BOXES: contextvars.ContextVar = contextvars.ContextVar("fisher_optax_boxes", default=None)


@contextlib.contextmanager
def reading_boxes(params: Any, specs: Any, mesh: Any, ruled: Any = None):
  """Runs ``init`` of the plain arrays ``params`` whose boxes (``nnx.Variable``, Linen's
  ``nn.Partitioned``) named them ``specs`` (a tree of ``PartitionSpec`` s, ``None`` where
  a box has no names) on ``mesh`` (``None``: not known); ``ruled``: those names mapped to
  mesh axes by the logical axis rules in force (``None``: no rules). The owner layouts
  that ``init`` reaches record them (:func:`owner_layout`); :mod:`fisher_optax.routing`
  also passes the specs concrete arrays are placed by, with ``mesh`` ``None``."""
  keys, leaves = _keyed_leaves(params)
  shapes = {k: tuple(jnp.shape(x)) for k, x in zip(keys, leaves)}
  keyed = lambda tree: {k: (shapes[k], sp) for k, sp in path_specs(tree).items()  # noqa: E731
                        if k in shapes}
  token = _BOXES.set(_Boxes(keyed(specs), mesh, None if ruled is None else keyed(ruled)))
  try:
    yield
  finally:
    _BOXES.reset(token)


def spec_axes(spec: Any) -> set:
  """The mesh axes a ``PartitionSpec`` names (``None`` entries skipped)."""
  return {n for e in (spec or ()) if e is not None
          for n in (e if isinstance(e, tuple) else (e,))}


def _named_on(table: dict, tree: Any, mesh) -> dict:
  """``{path: PartitionSpec}`` of the leaves of ``tree`` whose box (``table``: path ->
  (shape, spec)) named them with their shape, where every name is an axis of ``mesh``;
  ``{}`` otherwise."""
  out = {}
  for k, x in zip(*_keyed_leaves(tree)):
    entry = table.get(k)
    if entry is not None and entry[0] == tuple(jnp.shape(x)):
      out[k] = entry[1]
  named = set().union(*map(spec_axes, out.values()))
  return out if out and named <= set(mesh.axis_names) else {}


def _box_split(boxes: _Boxes, updates: Any, mesh) -> tuple:
  """``({path: PartitionSpec}, placed)`` of the gradients in ``updates`` whose parameter's
  box named it with that shape, where every name is an axis of ``mesh`` (mesh axes, as
  ``nnx.with_partitioning`` gives them), else where the names mapped by the logical axis
  rules in force at ``init`` are (MaxText's); else ``({}, False)``. ``placed``: the boxes
  named mesh axes of the mesh ``init`` ran on, laid out as ``mesh``, so that the state's
  boxes carry ``fo.state_shardings``' names for it."""
  out = _named_on(boxes.specs, updates, mesh)
  if out:
    placed = boxes.mesh is not None and dict(boxes.mesh.shape) == dict(mesh.shape)
    return out, placed
  if boxes.ruled is None:
    return {}, False
  return _named_on(boxes.ruled, updates, mesh), False


def parameter_axes_first() -> bool:
  """Whether the update lays a one-sided matrix's unrotated side out over its parameter's
  own mesh axes first (:func:`spread_major`), as ``fo.state_shardings`` lays out its state
  where the update knows the split (``Explicit`` axes, ``OwnerLayout(param_specs=...)``);
  not where the split is read from the boxes given to ``init``, whose state they named
  by ``fo.state_shardings``' rules without it."""
  on = _ACTIVE.get()
  return on is None or on.majors


def active() -> Optional[Any]:
  """The mesh the owner layout uses in the update being traced, or ``None``."""
  on = _ACTIVE.get()
  return None if on is None else on.mesh


@contextlib.contextmanager
def using(mesh: Optional[Any], transport_dtype: Any = None, specs: Optional[dict] = None,
          held: Optional[dict] = None, majors: bool = True, over: Optional[tuple] = None,
          state_over: Optional[tuple] = None):
  """Traces the body with the owner layout on ``mesh`` (``None``: off); ``specs``: per
  path (:func:`path_specs`), the gradient's shape and ``PartitionSpec``, where known;
  ``held``: per path, the shapes and specs of its parameter's state arrays, where known
  (:func:`state_held`); ``majors``: :func:`parameter_axes_first`; ``over``: the mesh
  axes the exchanges span (:func:`exchange_axes`; ``None``: every one); ``state_over``:
  those the state kept on the owners is spread over (``OwnerLayout.state_axes``)."""
  token = _ACTIVE.set(None if mesh is None else _Active(mesh, transport_dtype, specs,
                                                        held=held, majors=majors,
                                                        over=over, state_over=state_over))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def exchange_axes(specs: Optional[dict], mesh) -> Optional[tuple]:
  """The mesh axes one update's owners span, from the gradients' known split
  (``specs``: ``{path: (shape, PartitionSpec)}``): those of ``mesh`` that split some
  gradient (and those of size one), in the mesh's order, where that leaves out an axis
  of several devices (every parameter replicated over it: data-parallel replicas of
  FSDP); ``None`` (every axis) otherwise, and where nothing is known."""
  if not specs:
    return None
  named = set().union(*(spec_axes(sp) for _, sp in specs.values()))
  split = {n for n in named if n in mesh.axis_names and mesh.shape[n] > 1}
  every = {n for n in mesh.axis_names if mesh.shape[n] > 1}
  if not split or split == every:
    return None
  return tuple(n for n in mesh.axis_names if n in split or mesh.shape[n] == 1)


def axes_of(mesh, axes: Optional[tuple]) -> Any:
  """``mesh`` read as its ``axes`` alone (in the mesh's order; ``None``: ``mesh``
  itself), for the owners' layout arithmetic."""
  if axes is None or mesh is None:
    return mesh
  names = tuple(n for n in mesh.axis_names if n in axes)
  return _Axes(names, {n: mesh.shape[n] for n in names})


def exchange_mesh() -> Any:
  """The owners of the update being traced, as a mesh for the exchanges' layout
  arithmetic: the active mesh, or those of its axes that :func:`exchange_axes` chose."""
  on = _ACTIVE.get()
  return axes_of(on.mesh, on.over)


def state_mesh() -> Any:
  """The owners of the state kept on them across steps, as a mesh for the layout
  arithmetic: the active mesh, or its axes ``OwnerLayout.state_axes`` names."""
  on = _ACTIVE.get()
  return axes_of(on.mesh, on.state_over)


def _mesh_size(mesh) -> int:
  return math.prod(mesh.shape.values()) if mesh is not None else 1


def _split_axes(mesh) -> int:
  """How many of ``mesh``'s axes have more than one device."""
  return sum(1 for size in mesh.shape.values() if size > 1)


def _sharded(tree: Any, mesh) -> bool:
  """Whether any leaf of ``tree`` is sharded over an ``Explicit`` axis of ``mesh`` (read
  from its type); ``True`` when no leaf's type says (``Auto`` axes, where sharding is
  XLA's choice and not visible while tracing)."""
  explicit = set(getattr(mesh, "explicit_axes", ()) or ())
  if not explicit:
    return True
  return any(spec_axes(_typed_spec(x)) & explicit for x in jax.tree.leaves(tree))


def _typed_spec(x: Any) -> Optional[P]:
  """The ``PartitionSpec`` in ``x``'s type (``None`` where its type carries none)."""
  return getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)


def _typed_explicit_axes(x: Any) -> set:
  """The ``Explicit`` axes of the mesh in ``x``'s type (empty where it carries none)."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return set(getattr(mesh, "explicit_axes", ()) or ())


def typed_specs(params: Any) -> Optional[Any]:
  """The parameters' ``PartitionSpec`` s as their types give them on a mesh with
  ``Explicit`` axes (a tree like ``params``; the context mesh need not be set: a jitted
  ``init`` of arrays placed on such a mesh sees their shardings in their types), where
  some leaf is sharded over such an axis; ``None`` where the types say nothing (``Auto``
  axes, or no leaf sharded over an explicit axis)."""
  if not any(spec_axes(_typed_spec(x)) & _typed_explicit_axes(x)
             for x in jax.tree.leaves(params)):
    return None
  return jax.tree.map(_typed_spec, params)


def boxed_specs(params: Any, mesh: Any) -> Optional[Any]:
  """The parameters' ``PartitionSpec`` s as the boxes they came to ``init`` in name them
  (a tree like ``params``, ``P()`` where a box has no names), where those names are axes
  of ``mesh`` (a mesh of the same shape as the one the boxes were named on: Flax's
  ``nnx.with_partitioning`` and ``nn.with_partitioning`` under ``jax.set_mesh``) and
  some leaf is sharded over one; ``None`` otherwise (plain arrays, placed arrays, whose
  placement a jitted ``init`` does not see, or logical names)."""
  found = _BOXES.get()
  if (found is None or found.mesh is None or mesh is None
      or dict(found.mesh.shape) != dict(mesh.shape)):
    return None
  table = _named_on(found.specs, params, mesh)
  if not any(map(spec_axes, table.values())):  # no leaf is sharded
    return None
  return jax.tree.unflatten(jax.tree.structure(params),
                            [table.get(k, P()) for k in leaf_keys(params)])


def as_layout(setting: Any) -> Optional[OwnerLayout]:
  """``owner_layout=setting`` as an :class:`OwnerLayout` (``None``: off): ``"auto"`` is
  ``OwnerLayout()``, ``True`` ``OwnerLayout(replicated=True)``, a mesh
  ``OwnerLayout(mesh)``. Anything else raises a ``ValueError`` naming the values."""
  if isinstance(setting, OwnerLayout):
    return setting
  if setting is False:
    return None
  if setting is True:
    return OwnerLayout(replicated=True)
  if isinstance(setting, str) and setting == AUTO:
    return OwnerLayout()
  if isinstance(setting, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    return OwnerLayout(mesh=setting)
  raise ValueError("`owner_layout` must be True, False, 'auto', a jax.sharding.Mesh or a "
                   f"fo.OwnerLayout, got {setting!r}")


def state_devices(setting: Any) -> Any:
  """The device count a block keeps its state in the owner layout for (``None``: state
  laid out as the parameters), read when the optimizer is built: the size of the mesh
  ``owner_layout=setting`` names (a ``Mesh`` or ``fo.OwnerLayout(mesh=...)``); for a
  setting without a mesh (``"auto"``, ``True``), ``"auto"``, which the block reads as
  the context mesh's (:func:`build_devices`). ``None`` for a mesh of one device."""
  layout = as_layout(setting)
  if layout is None:
    return None
  if layout.mesh is None:
    if layout.state_axes is not None:  # asked for: those axes of the context mesh
      return build_devices(layout.state_axes)
    return AUTO
  size = _mesh_size(axes_of(layout.mesh, layout.state_axes))
  return size if size > 1 else None


def build_devices(axes: Optional[tuple] = None) -> Optional[int]:
  """The size of the context mesh (``jax.set_mesh``; ``axes``: of those of its axes)
  where it has several devices, else ``None``: the device count ``owners="auto"`` lays
  state out for, read when the optimizer is built (as ``stack_matrices="auto"`` reads
  the backend), so that its state's structure is fixed by the optimizer, the same
  wherever ``init`` is traced."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  if axes is not None:
    _check_axes(axes, mesh)
  size = _mesh_size(axes_of(mesh, axes))
  return size if size > 1 else None


def visibly_replicated(params: Any) -> bool:
  """Whether ``init`` runs under a context mesh with ``Explicit`` axes over none of which
  a leaf of ``params`` is sharded (replicated data parallelism, visible in the types):
  state built for owners from the context mesh is then kept per leaf instead."""
  mesh = jax.sharding.get_abstract_mesh()
  return (not mesh.empty and bool(getattr(mesh, "explicit_axes", ()))
          and not _sharded(params, mesh))


def resolve_mesh(layout: Optional[OwnerLayout], updates: Any) -> Optional[Any]:
  """The mesh ``layout`` uses for ``updates`` (traced now), or ``None``: the context mesh
  (``jax.set_mesh``), else the layout's own; none where neither is set or the mesh has
  one device, or (unless ``layout.replicated``) where the context mesh's axes are
  ``Explicit`` and no leaf of ``updates`` is sharded over them (replicated data
  parallelism). The context mesh comes first so that a state restored onto another
  mesh is updated on the mesh it now lives on."""
  if layout is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = layout.mesh
    if mesh is None:
      return None
  elif not layout.replicated and not _sharded(updates, mesh):
    return None
  return mesh if _mesh_size(mesh) > 1 else None


def owner_layout(tx, setting: Any = AUTO):
  """``tx`` with its whole-matrix work on the matrices' owner devices.

  Every whole-matrix function that ``tx``'s blocks run through
  ``fisher_optax.parallel.owners.map_whole`` (Newton--Schulz, the refreshes'
  decompositions) runs, while ``update`` is traced, on the matrices' owners of the mesh
  that ``setting`` picks (``resolve_mesh`` in ``fisher_optax.parallel.owners``).
  ``init`` and the state are ``tx``'s: this wrapper moves matrices within one update,
  never the state (a rotation built with ``owners=P``, ``blocks/rotate_owned.py``,
  keeps its own state on the owners), so checkpoints, ``fo.state_shardings`` and
  ``fo.describe`` are those of ``tx``. The named optimizers
  apply it (their ``owner_layout=``); a chain of blocks built by hand takes it as
  ``fo.owner_layout(optax.chain(...))``.

  Where no ``param_specs`` are given, ``init`` keeps what the boxes the parameters came
  in named them (a named optimizer's ``init`` of ``nnx.Variable`` s or Linen's
  ``nn.Partitioned``, as the Flax recipes give them; the last such ``init`` counts), and
  those names mapped by the logical axis rules in force (``nn.logical_axis_rules``; kept
  when the same names are initialised again outside them): on ``Auto`` mesh axes the
  update reads each matrix's split there, where the names, else the mapped ones, are
  axes of the mesh. Likewise ``init`` of concrete arrays placed by ``NamedSharding`` s
  (``jax.device_put`` with shardings) keeps their specs. The state ``init`` returns is
  ``tx``'s all the same.

  Args:
    tx: any optax transformation.
    setting: ``"auto"`` (the context mesh when it has several devices and, on
      ``Explicit`` axes, when the gradients are sharded), ``True`` (the context mesh),
      ``False`` (off: ``tx`` itself), a ``jax.sharding.Mesh`` (that mesh, e.g. for a
      ``jax.jit`` with shardings and no context mesh) or an :class:`OwnerLayout`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
  """
  import optax  # here, not at module level: this module sits below the blocks
  layout = as_layout(setting)
  tx = optax.with_extra_args_support(tx)
  if layout is None:
    return tx

  given = None if layout.param_specs is None else path_specs(layout.param_specs)
  # what the parameters' boxes named them at the last ``init`` given boxes (the Flax NNX
  # and Linen recipes: ``nnx.with_partitioning``), where no specs are given
  boxed: list = []

  def init_fn(params):
    found = _BOXES.get()
    if found is not None and given is None:
      if found.ruled is None and boxed and boxed[0].specs == found.specs:
        # the same names, initialised again outside the rules (MaxText does both)
        found = found._replace(ruled=boxed[0].ruled)
      boxed[:] = [found]
    return tx.init(params)

  def update_fn(updates, state, params=None, **extra):
    mesh = resolve_mesh(layout, updates)
    specs, held, majors = None, None, True
    if mesh is not None:
      specs, held, majors = _known_split(layout, given, boxed[0] if boxed else None,
                                         updates, state, mesh)
    if mesh is not None and not specs and _split_axes(mesh) > 1:
      mesh = _guessing(layout, mesh)
    over = None if mesh is None or layout.across_replicas else exchange_axes(specs, mesh)
    if mesh is not None and layout.state_axes is not None:
      _check_axes(layout.state_axes, mesh)
    with using(mesh, layout.transport_dtype, specs, held, majors, over,
               None if mesh is None else layout.state_axes):
      return tx.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _guessing(layout: OwnerLayout, mesh) -> Optional[Any]:
  """The mesh of an update that must guess the matrices' split on ``mesh`` (of several
  axes), as ``layout.guessed`` says: ``None`` (off) for ``False``; else ``mesh``, with a
  :class:`GuessedSplitWarning` naming the fixes for ``"auto"`` (Python's default filter
  shows it once per process)."""
  if not layout.guessed:
    return None
  if layout.guessed != AUTO:
    return mesh
  names = tuple(n for n in mesh.axis_names if mesh.shape[n] > 1)
  warnings.warn(
      f"fisher_optax: the owner layout guesses each matrix's split on the mesh axes "
      f"{names} (Megatron's column-parallel layout: {names[-1]!r} on the columns, the "
      "others on the rows); a matrix split otherwise (data-parallel replicas of FSDP, "
      "row-parallel layers) moves once more at every update. Give the split: "
      "fo.OwnerLayout(param_specs=...) (the specs you give fo.state_shardings), a mesh "
      "with Explicit axes (jax.make_mesh's default), or parameters in boxes named by mesh "
      "axes (nnx.with_partitioning) given to init. OwnerLayout(guessed=True) keeps the "
      "guess without this warning; guessed=False turns the layout off there.",
      GuessedSplitWarning, stacklevel=4)
  return mesh


def _known_split(layout: OwnerLayout, given: Optional[dict], boxes: Optional[_Boxes],
                 updates: Any, state: Any, mesh) -> tuple:
  """``(specs, held, majors)`` for :func:`using`: where the update learns each gradient's
  split (``{path: (shape, PartitionSpec)}``, ``None``: guessed) and its state's layout
  (:func:`state_held`). In order: the context mesh's ``Explicit`` axes (the types); the
  specs given (``given``, ``path_specs`` of ``layout.param_specs``); the boxes the
  parameters came to ``init`` in (``boxes``; the state laid out by its own boxes' names
  where they named this mesh, ``majors`` off: :func:`parameter_axes_first`)."""
  specs, held, majors = given, None, True
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and context.explicit_axes:
    # the context mesh's Explicit axes: each gradient's split is part of its type
    specs = path_specs(jax.tree.map(lambda x: jax.typeof(x).sharding.spec, updates))
    held = state_held(state, specs)
  elif given is None and boxes is not None:
    specs, placed = _box_split(boxes, updates, mesh)
    majors = False
    if placed:
      held = state_held(state, specs, placed=True)
  elif specs and layout.state_placed:
    held = state_held(state, specs, placed=True)
  if specs:  # each with its gradient's shape: a leaf of another shape at that path
    # (a block's coefficients, a stack) is not split as the parameter is
    specs = {k: (tuple(jnp.shape(x)), specs[k])
             for k, x in zip(*_keyed_leaves(updates)) if k in specs}
  return specs, held, majors


def _path_key(path) -> str:
  """A tree path as a string, without the trailing attribute of a box's value (a Flax
  ``nnx.Variable`` flattens to its ``value``), so that a tree of specs and one of
  updates name a leaf alike."""
  keys = list(path)
  while keys and isinstance(keys[-1], jax.tree_util.GetAttrKey):
    keys.pop()
  return jax.tree_util.keystr(tuple(keys))


def path_specs(tree: Any) -> dict:
  """``{path: PartitionSpec}`` of a tree of ``PartitionSpec`` s (leaves ``None``: not
  known), the paths as :func:`leaf_specs` reads them."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, P) or x is None)
  return {_path_key(path): spec for path, spec in flat if isinstance(spec, P)}


def _keyed_leaves(tree: Any) -> tuple:
  """The leaves of ``tree`` and their paths as :func:`_path_key` writes them."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [_path_key(path) for path, _ in flat], [x for _, x in flat]


def leaf_keys(tree: Any) -> list:
  """Per leaf of ``tree``, its path as the owner layout's tables name it."""
  return _keyed_leaves(tree)[0]


def leaf_specs(tree: Any) -> list:
  """Per leaf of ``tree`` (flattened as ``jax.tree.leaves``), the ``PartitionSpec`` of
  the gradient at its path in the update being traced where the leaf has that
  gradient's shape, or ``None`` where not known (no owner layout, an ``Auto`` mesh
  without ``OwnerLayout(param_specs=...)``, a leaf of another shape, or a tree the
  optimizer built itself, such as ``stack_matrices``' stacks)."""
  on = _ACTIVE.get()
  keys, leaves = _keyed_leaves(tree)
  if on is None or not (on.specs or on.derived):
    return [None] * len(leaves)
  out = []
  for k, x in zip(keys, leaves):
    entries = [e for e in ((on.specs or {}).get(k), (on.derived or {}).get(k)) if e]
    out.append(next((sp for shape, sp in entries if shape == tuple(jnp.shape(x))), None))
  return out


def state_held(state: Any, specs: dict, placed: bool = False) -> dict:
  """``{parameter path: [(shape, PartitionSpec), ...]}`` of the state arrays (two axes or
  more) whose path ends with that parameter's (as ``fo.state_shardings`` attributes
  them; the longest such path), read from their types (Explicit mesh axes); ``placed``:
  ``[(shape, role), ...]`` instead, each array's role in ``fo.state_shardings``' rules
  (its state's declared ``SHARDING``, else ``"auto"``), for state placed by them."""
  roles = field_roles(state) if placed else {}
  keys = sorted(specs, key=len, reverse=True)
  out: dict = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    if jnp.ndim(x) < 2:
      continue
    k = _path_key(path)
    owner = next((p for p in keys if k.endswith(p)), None)
    if owner is not None:
      how = (roles.get(jax.tree_util.keystr(tuple(path)), "auto") if placed
             else jax.typeof(x).sharding.spec)
      out.setdefault(owner, []).append((tuple(jnp.shape(x)), how))
  return out


def relay_split(view, key: str, rank: int, *, stay: float = 3.0,
                stay_on_r: Optional[float] = None,
                basis_sent: bool = True) -> Optional[list]:
  """Where a low-rank source moves a gradient split on its rows only to a split of its
  columns before ``sigma = U^T G`` (``[(2, mesh axis), ...]``), else ``None``.

  ``stay``: what not moving sends, in multiples of ``r n`` (3 for a tracked basis, as
  below; 1 for a random projection, whose sum is scattered where its state is);
  ``stay_on_r``: the same where the state is split on ``r`` (below; default ``stay``);
  ``basis_sent``: whether moving sends the basis (not one drawn on every device).

  Split on its rows over ``R`` devices, ``U^T G`` is a sum over them: an all-reduce of
  the ``r x n`` coefficients, and the coefficients gathered again for ``U coeffs`` where
  their state is split (``fo.state_shardings`` splits it over the rows' mesh axes): about
  ``3 r n`` values sent per matrix. Moved to columns, the product is local: the gradient
  and the update each cross once (``m n / R``) and the basis is gathered (``m r``). Taken
  where that is less, and only where the update sees that every ``r x n`` state array of
  the parameter is split so (its type, on Explicit mesh axes; on Auto axes, its role
  under ``fo.state_shardings``' rules where ``OwnerLayout(state_placed=True)`` says they
  placed it, which split such an array's ``n`` over the rows' axes where those divide
  it and ``r`` is neither side's size): held whole, the state
  would be gathered back at every step (MaxText's state, named without a mesh: GaLore
  0.21x -> 0.44x of the parameter bytes per step). With the state split, at the 60M
  LLaMA's shapes under FSDP over 32 CPU devices: GaLore 0.105x -> 0.044x, Alice 0.120x
  -> 0.075x, Alice-SOAP 0.186x -> 0.107x; over 8 devices GaLore 0.095x -> 0.063x.
  Those figures are against the all-reduce. Scattered where the state is
  (:func:`scatter_rows`), the sum of an untracked basis sends about ``2 r n``, and
  ``3 r n`` where a compensation gathers ``sigma`` (Fira, Alice-0), which the source
  does not see. Counted as 2, the 60M LLaMA's 512 x 512 attention matrices at rank 128
  over 8 devices cost the same either way and stay: GaLore's update sent the same bytes
  in 64 collectives instead of 96, with 0.133x temporary memory instead of 0.144x, but
  Fira's and Alice-0's sent 0.095x instead of 0.063x. So 3 is counted here.

  Where the devices do not divide ``n``, the state is split on ``r``. Not moving is then
  one reduce-scatter of ``U^T G`` on ``r`` and the coefficients gathered
  (:func:`scatter_rows`), ``2 r n``, and ``sigma`` gathered where the source tracks it
  (``stay_on_r``). Moving splits the columns unevenly (XLA pads them to ``n'``, the next
  multiple of ``R``) and the coefficients cross to their state and back, ``2 r n' / R``
  more. At the tiny LLaMA's shapes under FSDP over 32 CPU devices (its 128 x 344 MLP
  matrices): GaLore 0.255x -> 0.135x, Alice 0.391x -> 0.183x, Fira 0.358x -> 0.141x;
  APOLLO 0.122x -> 0.049x (its bases drawn where the columns are,
  :func:`drawn_projections`). At the 1B LLaMA's (2048 x 5461) over 8: Alice 0.561x ->
  0.442x, Fira 0.527x -> 0.384x, GaLore 0.395x -> 0.384x, the update's temporary
  memory 0.08x to 0.17x more (the bases gathered).

  Split on both sides (FSDP x tensor parallelism): :func:`_relay_both_sides`."""
  rows = _rows_where_state_is(view, key, rank, crossed=True)
  if not rows:
    return None
  cols = split_columns(view, key)
  if cols:
    return _relay_both_sides(view, rank, rows, cols, stay, basis_sent)
  size = math.prod(_ACTIVE.get().mesh.shape[n] for n in rows)
  m, n, r = view.m, view.n, rank
  if n % size:  # the state split on r: the coefficients cross to it and back
    even = -(-n // size) * size
    sent = 2 * m * even / size + (m * r if basis_sent else 0) + 2 * r * even / size
    if sent >= (stay if stay_on_r is None else stay_on_r) * r * n:
      return None
  elif 2 * m * n / size + (m * r if basis_sent else 0) >= stay * r * n:
    return None
  return [(2, name) for name in rows]


def _relay_both_sides(view, rank: int, rows: tuple, cols: tuple, stay: float,
                      basis_sent: bool) -> Optional[list]:
  """:func:`relay_split` for a gradient split on both sides (rows over ``rows``, columns
  over ``cols``: FSDP x tensor parallelism, the rows over ``R`` devices and the columns
  over ``C``): moved within each block of the columns' axes to a split of its columns
  over them and the rows' (``[(2, column axis), ..., (2, row axis), ...]``), where that
  divides ``n`` and where ``2 m n / (R C) + m r`` is less than ``2 r n / C``, the least
  that staying sends (a reduce-scatter and a gather of the coefficients, GaLore's), so
  that no source sends more for it; else ``None``. At the 60M LLaMA's shapes under FSDP
  16 x TP 2 over 32 CPU devices (its 512 x 1376 MLP matrices move, its 512 x 512
  attention matrices stay): GaLore 0.160x -> 0.089x of the parameter bytes per ordinary
  step, Fira 0.241x -> 0.103x, Alice 0.274x -> 0.135x, APOLLO 0.053x -> 0.024x; under
  FSDP 4 x TP 2 over 8 nothing moves."""
  mesh = _ACTIVE.get().mesh
  size = math.prod(mesh.shape[n] for n in rows)
  whole = size * math.prod(mesh.shape[c] for c in cols)
  m, n, r = view.m, view.n, rank
  if n % whole or (2 * m * n / whole + (m * r if basis_sent else 0)
                   >= min(stay, 2.0) * r * n * size / whole):
    return None
  return [(2, c) for c in cols] + [(2, name) for name in rows]


def coefficient_axis(n: int, axes: tuple, cols: tuple = ()) -> int:
  """The axis of a matrix's ``r x n`` coefficients that ``fo.state_shardings`` splits over
  the mesh axes ``axes`` of the matrix's rows: ``-1`` (``n``) where they divide ``n``,
  else ``-2`` (``r``); ``-2`` where the columns are split too (over ``cols``: FSDP x
  tensor parallelism), whose axes ``n`` keeps."""
  size = math.prod(_ACTIVE.get().mesh.shape[a] for a in tuple(axes) + tuple(cols))
  return -1 if n % size == 0 else -2


def _gradient_split(view, key: str) -> Optional[list]:
  """The split a gradient has (:func:`view_split`), read from the specs given, else
  ``None``."""
  on = _ACTIVE.get()
  entry = None if on is None else (on.specs or {}).get(key)
  if entry is None or entry[0] != tuple(view.shape):
    return None
  return view_split(view, entry[1], spread=False)


def _rows_where_state_is(view, key: str, rank: int, split: Any = False,
                         crossed: bool = False) -> tuple:
  """The mesh axes that split a gradient's rows, where it is split on its rows only and
  every ``r x n`` state array of its parameter is split over those axes as
  ``fo.state_shardings`` splits it (:func:`_state_split_on_rows`): on ``n`` where they
  divide it, else on ``r`` where they divide that (:func:`coefficient_axis`); else
  ``()``. ``split``: the gradient's split (:func:`view_split`), by default read from the
  specs given. ``crossed``: a gradient split on its columns too counts, where the
  state's ``r`` is split over the rows' axes and its ``n`` as the columns."""
  on = _ACTIVE.get()
  if on is None or not on.held:
    return ()
  if split is False:
    split = _gradient_split(view, key)
  rows = tuple(n for a, n in split or [] if a == 1)
  cols = tuple(n for a, n in split or [] if a == 2)
  if not rows or (cols and not crossed):
    return ()
  size = math.prod(on.mesh.shape[n] for n in rows)
  if view.n % (size * math.prod(on.mesh.shape[n] for n in cols)) and rank % size:
    return ()
  if not _state_split_on_rows(on, view, key, rank, rows, cols):
    return ()
  return rows


def _state_split_on_rows(on: _Active, view, key: str, r: int, rows: tuple,
                         cols: tuple = ()) -> bool:
  """Whether every ``r x n`` state array of the parameter at ``key`` has its axis
  :func:`coefficient_axis` (``n``, else ``r``) split over the mesh axes ``rows`` (those
  that split the gradient's rows), and its ``n`` over ``cols`` where the gradient's
  columns are split too: read from its type (Explicit mesh axes), or from its
  role under ``fo.state_shardings``' rules where ``OwnerLayout(state_placed=True)`` says
  they placed it (role ``auto``, ``r`` not a side: the rules split the coefficients of a
  matrix split on its smaller side so, and no others along those axes)."""
  m, n = view.m, view.n
  axis = coefficient_axis(n, rows, cols)
  at = len(view.batch_shape) + 2 + axis
  # r x n arrays of the matrices' own batch (not a batch x n vector whose batch is r)
  held = [e for e in on.held.get(key, []) if tuple(e[0][-2:]) == (r, n)
          and len(e[0]) == len(view.batch_shape) + 2]
  if (axis == -2 or cols) and not held:  # no state of the coefficients to keep split so
    return False
  for shape, sp in held:
    if isinstance(sp, str):
      if sp != "auto" or r in (m, n) or len(shape) != len(view.batch_shape) + 2:
        return False
      continue
    entries = list(sp) + [None] * 8
    names = lambda e: () if e is None else e if isinstance(e, tuple) else (e,)  # noqa: E731
    if axis == -1:  # n over the columns' axes, then the rows'
      if tuple(names(entries[at])) != tuple(cols) + tuple(rows):
        return False
    elif (tuple(names(entries[at])) != rows
          or (cols and tuple(names(entries[at + 1])) != cols)):
      return False
  return True


def scatter_rows(view, key: str, rank: int) -> tuple:
  """The mesh axes over which ``sigma = U^T G`` is summed and scattered at once
  (:func:`scattered_projection`), else ``()``: where a gradient is split on its rows
  (its split known) and every ``r x n`` state array of the parameter is split over those
  axes, on ``n`` where they divide it, else on ``r`` (:func:`_rows_where_state_is`); on
  ``r`` where its columns are split too (:func:`split_columns`). Its
  coefficients then stay where their state is (:func:`coefficient_layout`): one
  reduce-scatter of the ``r x n`` coefficients, half the bytes of the all-reduce that
  left them on every device (XLA:CPU's partitioner does not turn an all-reduce and a
  slice into one; with the state split on ``r``, at the tiny LLaMA's shapes under FSDP
  over 32 CPU devices, whose 344 columns do not divide, GaLore sent 0.352x of the
  parameter bytes per step that way and 0.255x scattered, APOLLO 0.413x and 0.122x).
  APOLLO's source takes it wherever it applies; a low-rank source where
  :func:`relay_split` declines to move the gradient (few devices on the rows against
  the rank, or columns they do not divide)."""
  return _rows_where_state_is(view, key, rank, crossed=True)


def split_columns(view, key: str) -> tuple:
  """The mesh axes that split a gradient's columns where its split is known, else
  ``()``."""
  return tuple(n for a, n in _gradient_split(view, key) or [] if a == 2)


def scattered_projection(basis: jax.Array, a: jax.Array, rows: tuple,
                         cols: tuple = ()) -> jax.Array:
  """``U^T A`` (``basis``: ``... x m x r``; ``a``: ``... x m x n``, its rows split over
  the mesh axes ``rows``, its columns over ``cols``) in a ``shard_map``: each device's
  rows give a partial product, and one ``psum_scatter`` sums them and leaves the
  ``r x n`` product split over ``rows`` on the axis :func:`coefficient_axis` names
  (``n``, else ``r``), ``n`` over ``cols``, as its state is."""
  on = _ACTIVE.get()
  lead = [None] * (a.ndim - 2)
  c = cols or None
  axis = coefficient_axis(a.shape[-1], rows, cols)

  def local(u, x):
    return jax.lax.psum_scatter(linalg.project_rows(u, x), rows,
                                scatter_dimension=x.ndim + axis, tiled=True)

  out = P(*lead, None, tuple(cols) + tuple(rows)) if axis == -1 else P(*lead, rows, c)
  return jax.shard_map(local, in_specs=(P(*lead, rows, None), P(*lead, rows, c)),
                       out_specs=out, check_vma=False, **_mesh_argument(on.mesh))(basis, a)


def columns_only(view, key: str) -> tuple:
  """The mesh axes that split a gradient's columns where it is split on its columns
  only (its split known, from the specs given or its type; ``n`` divides over them),
  else ``()``."""
  split = _gradient_split(view, key)
  if not split or any(a == 1 for a, _ in split):
    return ()
  return tuple(n for a, n in split if a == 2)


def drawn_projections(draw: Callable, key: jax.Array, leaves: list) -> list:
  """``sigma_i = U_i^T G_i`` with every basis drawn whole on every device and used at
  once, for leaves whose columns are split: ``leaves`` is ``[(indices, gradient,
  axes, r), ...]`` (``indices``: the matrices' tree-wide indices, shape ``k``;
  ``gradient``: canonical ``k x m x n``, its columns split over the mesh axes ``axes``);
  ``draw(key, i, m, r)`` is matrix ``i``'s ``m x r`` basis. Leaves of one local shape
  share a ``shard_map`` whose loop draws each basis and projects the local columns with
  it, so no basis crosses between devices and one is held at a time (a loop step per
  matrix); returns ``k x r x n`` per leaf, split as its gradient's columns. Columns the
  devices do not divide (:func:`relay_split`) are padded with zeros to a multiple of
  their count for the ``shard_map``, and the padding's coefficients dropped."""
  on = _ACTIVE.get()
  widths = [g.shape[-1] for _, g, _, _ in leaves]
  leaves = [(i, _even_columns(g, axes), axes, r) for i, g, axes, r in leaves]
  groups: dict = {}
  for i, (_, g, axes, r) in enumerate(leaves):
    groups.setdefault((g.shape[1:], g.dtype, axes, r), []).append(i)
  out = [None] * len(leaves)
  for (shape, _, axes, r), members in groups.items():
    spec = P(None, None, axes)

    def local(k, idx, gs, m=shape[0], r=r):
      # matrix j of the group: leaf `owner[j]`, entry `pos[j]` of its stack; picked by a
      # switch rather than from a concatenation, which copied the group's gradients
      owner = jnp.asarray([a for a, x in enumerate(gs) for _ in range(x.shape[0])])
      pos = jnp.asarray([b for x in gs for b in range(x.shape[0])])
      ids = jnp.concatenate(idx)
      pick = [functools.partial(lambda a, b, *xs: jax.lax.dynamic_index_in_dim(
          xs[a], b, keepdims=False), a) for a in range(len(gs))]

      def one(j, acc):
        g = (pick[0](pos[j], *gs) if len(gs) == 1
             else jax.lax.switch(owner[j], pick, pos[j], *gs))
        sigma = linalg.project_rows(draw(k, ids[j], m, r), g)
        return jax.lax.dynamic_update_index_in_dim(acc, sigma.astype(acc.dtype), j, 0)

      acc = jnp.zeros((ids.shape[0], r, gs[0].shape[-1]),
                      jnp.result_type(gs[0].dtype, jnp.float32))
      sigma = jax.lax.fori_loop(0, ids.shape[0], one, acc)
      starts = list(itertools.accumulate([0] + [x.shape[0] for x in gs]))
      return [sigma[a:b] for a, b in zip(starts, starts[1:])]

    idx = [leaves[i][0] for i in members]
    gs = [leaves[i][1] for i in members]
    res = jax.shard_map(local, in_specs=(P(), [P()] * len(idx), [spec] * len(gs)),
                        out_specs=[spec] * len(gs), check_vma=False,
                        **_mesh_argument(on.mesh))(key, idx, gs)
    for i, r in zip(members, res):
      out[i] = r[..., :widths[i]]
  return out


def _even_columns(x: jax.Array, axes: tuple) -> jax.Array:
  """``x`` with zero columns appended up to a multiple of the size of the mesh axes
  ``axes`` (unchanged where it divides)."""
  size = math.prod(_ACTIVE.get().mesh.shape[a] for a in axes)
  pad = -x.shape[-1] % size
  return x if not pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def relaid(x: jax.Array, split: list) -> jax.Array:
  """A canonical ``batch + (m, n)`` array (or a basis ``batch + (m, r)`` with ``split``
  empty: whole) constrained to ``split``'s columns (:func:`relay_split`)."""
  on = _ACTIVE.get()
  entries = [None] * jnp.ndim(x)
  names = tuple(name for a, name in split if a == 2)
  if names:
    entries[-1] = names
  return _constrain(x, P(*entries), on.mesh)


def coefficient_layout(coeffs: Any, views: list, moved: Optional[list] = None) -> tuple:
  """A low-rank source's coefficients ``sigma = U^T G`` (``batch + (r, n)`` per leaf;
  ``views``: their gradients' :class:`fisher_optax.matrices.MatrixView` s; ``moved``:
  per leaf, where the source moved the gradient's columns, :func:`relay_split`, or
  ``None``) laid out as the product leaves them where the gradient's split is known
  (:func:`view_split`), or where the source moved it:
  ``n`` split as the gradient's columns, ``r`` and the batch axes whole (every device
  holds them where the columns are whole: the sum over the split rows leaves them
  there). Returns the coefficients, constrained to that layout, and ``{path: (shape,
  spec)}`` for :func:`deriving`, so that the blocks run on the coefficients
  (Alice-SOAP's right side) move them from the split they have: guessed from their
  shape on a mesh of several axes, the ``r x 2048`` coefficients of the tiny LLaMA's
  output layer were moved between devices at every step on the way to a refresh (FSDP
  4 x TP 2, 8 CPU devices); left to XLA where the columns are whole, those of its MLP
  matrices were split and gathered again at every step (FSDP over 32 devices: 0.80x of
  the parameter bytes per ordinary step, 0.43x laid out here). Unchanged where the
  split is not known."""
  on = _ACTIVE.get()
  keys, leaves = _keyed_leaves(coeffs)
  if on is None:
    return coeffs, {}
  out, derived = [], {}
  for k, x, view, relay in zip(keys, leaves, views, moved or [None] * len(leaves)):
    entries = [e for e in ((on.specs or {}).get(k), (on.derived or {}).get(k)) if e]
    spec = next((sp for shape, sp in entries if shape == tuple(view.shape)), None)
    if relay is not None:  # sigma taken where the source moved the columns
      split = list(relay)
    elif spec is not None:
      split = view_split(view, spec, spread=False)
      if split is not None:  # the sum over the split rows left where the state keeps them
        kept = _rows_where_state_is(view, k, jnp.shape(x)[-2], split, crossed=True)
        cols = tuple(n for a, n in split if a == 2)
        if kept and coefficient_axis(view.n, kept, cols) == -2:
          rspec = P(*([None] * (jnp.ndim(x) - 2)), kept, cols or None)
          derived[k] = (tuple(jnp.shape(x)), rspec)
          out.append(_constrain(x, rspec, on.mesh))
          continue
        split = split + [(2, n) for n in kept]
    elif not entries and _split_axes(on.mesh) == 1:
      # a gradient whose split is not known, on a mesh of one axis: FSDP's, as the
      # exchange guesses it (a guess on a mesh of several axes moved the coefficients
      # of the matrices it got wrong at every step: APOLLO at the tiny LLaMA's shapes,
      # FSDP 4 x TP 2, 0.13x -> 0.16x of the parameter bytes)
      split = _matrix_split((view.num_matrices, view.m, view.n), on.mesh)
    else:  # coefficients of coefficients (sigma's own): their sum leaves them anywhere
      split = None
    cols = tuple(n for a, n in split or [] if a == 2)
    if split is None:
      out.append(x)
      continue
    cspec = P(*([None] * (jnp.ndim(x) - 1)), cols or None)
    derived[k] = (tuple(jnp.shape(x)), cspec)
    out.append(_constrain(x, cspec, on.mesh))
  return jax.tree.unflatten(jax.tree.structure(coeffs), out), derived


@contextlib.contextmanager
def deriving(derived: dict):
  """Traces the body knowing the layout of arrays derived from the gradients
  (:func:`coefficient_layout`), which :func:`leaf_specs` then reports at their paths."""
  on = _ACTIVE.get()
  if on is None or not derived:
    yield
    return
  token = _ACTIVE.set(on._replace(derived={**(on.derived or {}), **derived}))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def leaf_param_specs(tree: Any) -> list:
  """Per leaf of ``tree``, the shape and ``PartitionSpec`` of the gradient at its path
  in the update being traced (whatever the leaf's own shape: a block's coefficients
  at a parameter's path), or ``None`` where not known."""
  on = _ACTIVE.get()
  keys, leaves = _keyed_leaves(tree)
  if on is None or not on.specs:
    return [None] * len(leaves)
  return [on.specs.get(k) for k in keys]


def sized_split(size: int, param: Optional[tuple], last: bool = False) -> Optional[list]:
  """The split of the rows of a stack ``(k, size, r)`` (a basis of a side of ``size``)
  that ``fo.state_shardings`` gives a state array of its parameter ``param`` (``(shape,
  spec)``): the mesh axes of the parameter's axis of that size (the first of two; with
  ``last``, for a basis of the columns, the last of two where it is split, as the
  state's role ``columns`` says), ``[]`` where it is replicated, ``None`` where no axis
  has that size or nothing is known."""
  if param is None:
    return None
  shape, spec = param
  entries = list(spec) + [None] * (len(shape) - len(spec))
  pairs = list(zip(shape, entries))
  if last and [e for d, e in pairs if d == size][-1:] == [None]:
    last = False  # the columns whole: as the rows, which "auto" gives a square parameter
  for d, e in (pairs[::-1] if last else pairs):
    if d == size:
      return [(1, n) for n in (() if e is None else e if isinstance(e, tuple) else (e,))]
  return None


def view_split(view, spec: Optional[P], spread: bool = True,
               axes: Optional[tuple] = None) -> Optional[list]:
  """How a leaf's canonical stack ``(k, m, n)`` (:class:`fisher_optax.matrices.MatrixView`
  ``view``; its batch axes flattened into ``k``) is split over the owner layout's mesh
  when the leaf is split as ``spec``: a split ``[(array axis, mesh axis), ...]`` over
  every mesh axis the exchange spans (:func:`exchange_mesh`; ``axes``: those instead),
  the axes the leaf is replicated over added to a side they divide (empty: replicated),
  or ``None`` where that is not known or not a split of the matrix axes alone (no
  ``spec``; a batch axis split; a merged matrix axis split past its major axis), for
  the caller to guess (:func:`_matrix_split`). With ``spread=False``, the split the
  leaf has, the mesh axes it is replicated over left out."""
  on = _ACTIVE.get()
  if on is None or spec is None or view is None:
    return None
  entries = list(spec) + [None] * (len(view.shape) - len(spec))
  if any(n not in on.mesh.axis_names for e in entries if e is not None
         for n in (e if isinstance(e, tuple) else (e,))):
    return None
  # a mesh axis of size one splits nothing (MaxText names a dozen, most of size one)
  names = lambda e: () if e is None else tuple(  # noqa: E731
      n for n in (e if isinstance(e, tuple) else (e,)) if on.mesh.shape[n] > 1)
  if any(names(entries[a]) for a in view.batch_axes):
    return None
  sides = []
  for side in (view.rows, view.cols):
    if any(names(entries[a]) for a in side[1:]):
      return None
    sides.append(names(entries[side[0]]))
  rows, cols = (sides[1], sides[0]) if view.transpose else sides
  mesh = on.mesh
  size = lambda ns: math.prod(mesh.shape[n] for n in ns)  # noqa: E731
  if view.m % size(rows) or view.n % size(cols):
    return None
  split = [(1, n) for n in rows] + [(2, n) for n in cols]
  if not split or not spread:
    return split
  return spread_onto(split, (view.m, view.n),
                     axes if axes is not None else exchange_mesh().axis_names, mesh)


def spread_onto(split: list, matrix: tuple, axes: tuple, mesh) -> Optional[list]:
  """A split ``[(1 or 2, mesh axis), ...]`` of a stack of matrices ``matrix`` (``(m,
  n)``) over every axis of ``axes``: the exchange splits every matrix over each axis it
  spans, so one that ``split`` leaves out (the leaf replicated over it: data parallelism
  beside FSDP) splits it further where it divides, the rows first, a local slice on the
  way in. ``None`` where those axes divide neither side."""
  rows = tuple(n for a, n in split if a == 1)
  cols = tuple(n for a, n in split if a == 2)
  rest = tuple(n for n in axes if n not in rows + cols)
  if not rest:
    return list(split)
  size = lambda ns: math.prod(mesh.shape[n] for n in ns)  # noqa: E731
  if matrix[0] % size(rows + rest) == 0:
    rows += rest
  elif matrix[1] % size(cols + rest) == 0:
    cols += rest
  else:
    return None
  return [(1, n) for n in rows] + [(2, n) for n in cols]


def held_where_replicated(leaves: list, views: list, specs: list) -> list:
  """``leaves`` (an update's arrays, with their matrix views and the ``PartitionSpec`` s
  the update knows them by, ``None`` where not known) kept in their own layout where
  an exchange over every mesh axis would split their matrices further over mesh axes
  they are replicated over (:func:`view_split`: data parallelism beside FSDP; the
  state kept on the owners is spread over every axis by default, and so is one
  update's work with ``across_replicas``). Their slices then come off the array where
  it enters the exchange, a local slice; unpinned, XLA computed what produced them (the momentum
  whose new state is replicated over those axes) on the slices and gathered the state
  back (tiny LLaMA, data 2 x FSDP 4 on 8 CPU devices, ``Auto`` axes, specs given:
  Muon's update sent 0.289x of the parameter bytes per step unpinned, 0.214x pinned,
  as on ``Explicit`` axes)."""
  on = _ACTIVE.get()
  if on is None:
    return leaves
  out = []
  for x, v, sp in zip(leaves, views, specs):
    if (sp is not None and v is not None and jnp.ndim(x) == len(v.shape)
        and view_split(v, sp, axes=on.mesh.axis_names) != view_split(v, sp, spread=False)):
      x = _constrain(x, sp, on.mesh)
    out.append(x)
  return out


def sender(transport: Any) -> Callable[[jax.Array], jax.Array]:
  """Casts a floating array to the transport dtype (``None``: leaves it) for its way to
  or from the owners."""
  def send(x):
    if transport is not None and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(transport)
    return x
  return send


def as_auto(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """``mesh``'s devices and axes, every axis ``Auto``."""
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def on_auto_axes(tree: Any) -> Any:
  """``tree`` with every concrete array placed on a mesh with ``Explicit`` axes moved to
  the same mesh with ``Auto`` axes: the same shards on the same devices, no longer
  typed by their sharding (so that indexing them needs no ``out_sharding``)."""
  def one(x):
    sh = getattr(x, "sharding", None)
    if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and isinstance(sh, jax.sharding.NamedSharding)
        and getattr(sh.mesh, "explicit_axes", ())):
      return jax.device_put(x, jax.sharding.NamedSharding(as_auto(sh.mesh), sh.spec))
    return x
  return jax.tree.map(one, tree)


def _mesh_argument(mesh) -> dict:
  """``shard_map``'s ``mesh=``: none where a context mesh is set (inside the named
  optimizers' ``jax.sharding.auto_axes`` that is the ``Auto`` view of an ``Explicit``
  mesh, which the arrays' types match; the ``Explicit`` mesh given to ``owner_layout``
  would not be), else the layout's own."""
  if isinstance(mesh, jax.sharding.AbstractMesh) or not jax.sharding.get_abstract_mesh().empty:
    return {}
  if getattr(mesh, "explicit_axes", ()):  # no context mesh: arrays untyped, axes as Auto
    mesh = as_auto(mesh)
  return dict(mesh=mesh)


def _matrix_split(shape: tuple, mesh) -> Optional[list]:
  """How a stack ``(k, ..., m, n)`` enters and leaves the owners: ``[(array axis, mesh
  axis), ...]``, the mesh axes that split its matrix axes outside the owners (``None``:
  it moves split over its stack axis alone, as XLA chooses).

  The parameters' own split is not visible while tracing on ``Auto`` axes, so this is a
  guess that XLA corrects matrix to matrix where it is wrong: on a mesh of one axis,
  FSDP's (the larger side; the rows of a square matrix); on a mesh of several,
  Megatron's column-parallel layout (the last mesh axis on the columns, the others on
  the rows), else, where that does not divide the matrix, its row-parallel one (the
  last mesh axis on the rows, the others on the columns)."""
  if len(shape) < 3:
    return None
  m_axis, n_axis = len(shape) - 2, len(shape) - 1
  names = tuple(mesh.axis_names)
  if len(names) == 1:
    size = mesh.shape[names[0]]
    # the larger axis, the first of two equal ones (FSDP's choice), else the other
    for a in ((m_axis, n_axis) if shape[m_axis] >= shape[n_axis] else (n_axis, m_axis)):
      if shape[a] % size == 0:
        return [(a, names[0])]
    return None
  data, last = math.prod(mesh.shape[n] for n in names[:-1]), mesh.shape[names[-1]]
  if shape[m_axis] % data == 0 and shape[n_axis] % last == 0:
    return [(m_axis, n) for n in names[:-1]] + [(n_axis, names[-1])]
  if shape[m_axis] % last == 0 and shape[n_axis] % data == 0:
    # e.g. down_proj (344 x 128) under FSDP 16 x TP 2: 344 does not divide by 16
    return [(m_axis, names[-1])] + [(n_axis, n) for n in names[:-1]]
  return None


def guessed_split(shape: tuple) -> Optional[list]:
  """:func:`_matrix_split` of a stack of ``shape`` under the active owner layout's mesh."""
  return _matrix_split(shape, _ACTIVE.get().mesh)


def transposed_split(split: Optional[list]) -> Optional[list]:
  """The split of a stack ``(k, m, n)`` as the split of its transpose ``(k, n, m)``."""
  return None if split is None else [({1: 2, 2: 1}.get(a, a), n) for a, n in split]


def _entries(shape: tuple, split: Optional[list], axes: tuple) -> P:
  """The ``PartitionSpec`` of a stack outside the owners (``split``) or, with ``split``
  ``None``, of a stack split over its stack axis."""
  if split is None:
    return P(axes)
  entries = [None] * len(shape)
  for a, name in split:
    entries[a] = name if entries[a] is None else (
        (entries[a] if isinstance(entries[a], tuple) else (entries[a],)) + (name,))
  return P(*entries)


def _exchange(x, name):
  """``all_to_all`` over mesh axis ``name`` of an array ``(F, ...)`` (``F`` its size):
  slice ``j`` goes to device ``j``, and slice ``j`` of the result came from device ``j``.
  Exchanged along the leading axis, every slice sent is contiguous (an all-to-all whose
  split axis is inner and whose operand was transposed failed XLA:CPU's HLO verifier:
  operand slices of one shape in different layouts)."""
  return jax.lax.all_to_all(x, name, split_axis=0, concat_axis=0, tiled=True)


def _reorder(x, a: int, sizes: list):
  """Axis ``a`` of ``x`` read as ``sizes + [piece]`` nested blocks, the order of those
  block indices reversed (an involution when applied with ``sizes`` reversed)."""
  n = len(sizes)
  y = x.reshape(x.shape[:a] + tuple(sizes) + (-1,) + x.shape[a + 1:])
  y = jnp.moveaxis(y, list(range(a, a + n)), list(range(a + n - 1, a - 1, -1)))
  return y.reshape(x.shape)


def _names_per_axis(split) -> dict:
  out: dict = {}
  for a, name in split:
    out.setdefault(a, []).append(name)
  return out


def _to_owners(x, split):
  """Inside ``shard_map``: a block split over matrix axes -> whole matrices, the stack
  split over the mesh axes in order (one exchange per mesh axis): ``(k, .., m/F, ..)``
  -> ``(F, k/F, .., m/F, ..)`` -> exchange (slice ``f`` now the ``f``-th piece of axis
  ``a`` of the ``k/F`` matrices this device keeps) -> ``(k/F, .., m, ..)``. An axis
  split over several mesh axes comes out of its exchanges with its pieces in the
  reverse order of theirs, which :func:`_reorder` puts back."""
  for a, name in split:
    size = jax.lax.axis_size(name)
    k = x.shape[0]
    y = _exchange(x.reshape((size, k // size) + x.shape[1:]), name)
    y = jnp.moveaxis(y, 0, a)  # (k/F, .., F, m/F, ..)
    x = y.reshape(y.shape[:a] + (y.shape[a] * y.shape[a + 1],) + y.shape[a + 2:])
  for a, names in _names_per_axis(split).items():
    if len(names) > 1:
      x = _reorder(x, a, [jax.lax.axis_size(n) for n in reversed(names)])
  return x


def _from_owners(x, split):
  """The inverse of :func:`_to_owners`."""
  for a, names in _names_per_axis(split).items():
    if len(names) > 1:
      x = _reorder(x, a, [jax.lax.axis_size(n) for n in names])
  for a, name in reversed(split):
    size = jax.lax.axis_size(name)
    y = x.reshape(x.shape[:a] + (size, x.shape[a] // size) + x.shape[a + 1:])
    y = _exchange(jnp.moveaxis(y, a, 0), name)  # (F, k/F, .., m/F, ..)
    x = y.reshape((y.shape[0] * y.shape[1],) + y.shape[2:])
  return x


def _result_splits(out_leaves: list, padded: list, mesh, replicate: bool,
                   layouts: Optional[Callable[[list, Any], list]]) -> list:
  """How :func:`map_whole`'s results leave the owners: state (``replicate``) split as
  ``layouts`` says where that splits it over every mesh axis, else gathered (``None``);
  other results split as the gradients are guessed to be (:func:`_matrix_split`)."""
  if not replicate:
    return [_matrix_split(o.shape, mesh) for o in out_leaves]
  # a split over some of the exchange's axes only comes back replicated (then sliced)
  out = [sp if covers(sp, mesh) else None
         for sp in (layouts(padded, None) if layouts is not None else [])]
  return out + [None] * (len(out_leaves) - len(out))


def covers(split: Optional[list], mesh) -> bool:
  """Whether ``split`` splits over every axis of ``mesh`` (the exchange's, where results
  kept as state come back split, one piece per owner)."""
  return split is not None and sorted(n for _, n in split) == sorted(mesh.axis_names)


def map_whole(fn: Callable[..., Any], args: list, local: Callable[..., Any], *,
              replicate: bool = False,
              layouts: Optional[Callable[[list, Any], list]] = None,
              split: Optional[list] = None) -> Any:
  """``local(fn, *args)`` (``fn`` over the stack axis of ``args``: arrays ``(k, ...)`` or
  ``None``) with each matrix on its owner when the owner layout is on; otherwise
  ``local(fn, *args)`` as it is.

  The stack axis is padded to a multiple of the owners' count with copies of the last
  matrix (real inputs, so that no padded slot meets a degenerate case). In
  ``jax.shard_map`` over every mesh axis, one ``all_to_all`` per mesh axis the exchange
  spans (:func:`exchange_mesh`) turns each
  device's slices of every matrix into whole matrices of its own (:func:`_matrix_split`
  says from which split), ``local`` runs on them, and the inverse ``all_to_all`` s
  return the results to that split, where cutting the padding is local. Floating arrays
  travel in the layout's transport dtype, if it has one.

  ``replicate``: the results are optimizer state (a refresh's new bases), gathered to
  every device. Whatever layout the state has, taking it from a replicated result is
  local; results returned split by a guess the state did not share made XLA move the
  state at every step, refresh or not (the keep branch of the refresh's conditional has
  to agree with the refresh branch). ``layouts``: with ``replicate``, given the padded
  arguments and their split (``None`` here: guessed), a split per result (``None``:
  gathered) where results come back split instead (:func:`exchange_split`), each
  device receiving its own rows only. ``split``: where known, the split of the stack's
  arrays of its matrices' shape (the first argument's), in and out (without
  ``replicate``), in place of the guess."""
  on = _ACTIVE.get()
  if on is None:
    return local(fn, *args)
  mesh, transport = exchange_mesh(), on.transport_dtype
  k = next(a.shape[0] for a in args if a is not None)
  pad = -k % _mesh_size(mesh)
  padded = [a if a is None or not pad else
            jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)], axis=0) for a in args]
  present = [i for i, a in enumerate(padded) if a is not None]
  dtypes = [padded[i].dtype for i in present]
  shapes = jax.eval_shape(lambda *xs: local(fn, *xs), *padded)
  out_leaves, out_tree = jax.tree.flatten(shapes)
  found = _whole_splits([padded[i].shape for i in present], out_leaves, padded, mesh,
                        replicate, layouts, split)
  if found is None:  # no one order of exchanges keeps every layout: XLA serves the stack
    return local(fn, *args)
  in_splits, out_splits, order = found
  send = sender(transport)  # floating inputs travel in it; the owners compute in their own

  def body(*xs):
    full = [None] * len(padded)
    for i, x, d, sp in zip(present, xs, dtypes, in_splits):
      full[i] = (x if sp is None else _to_owners(x, sp)).astype(d)
    res = jax.tree.leaves(local(fn, *full))
    if replicate:
      return [jax.lax.all_gather(send(r), order, axis=0, tiled=True) if sp is None
              else _from_owners(send(r), sp) for r, sp in zip(res, out_splits)]
    return [send(r) if sp is None else _from_owners(send(r), sp)
            for r, sp in zip(res, out_splits)]

  out = jax.shard_map(
      body, in_specs=tuple(_entries(padded[i].shape, sp, order)
                           for i, sp in zip(present, in_splits)),
      out_specs=[P() if replicate and sp is None else _entries(o.shape, sp, order)
                 for o, sp in zip(out_leaves, out_splits)],
      check_vma=False, **_mesh_argument(on.mesh))(*[send(padded[i]) for i in present])
  return jax.tree.unflatten(out_tree, [y[:k].astype(o.dtype) if pad else y.astype(o.dtype)
                                       for y, o in zip(out, out_leaves)])


def _whole_splits(in_shapes: list, out_leaves: list, padded: list, mesh, replicate: bool,
                  layouts, split: Optional[list]) -> Optional[tuple]:
  """:func:`map_whole`'s ``(in_splits, out_splits, order)``: how each argument and result
  travels (``split`` for those of the first argument's matrix shape where given, else the
  guess, :func:`_matrix_split`; results kept as state as :func:`_result_splits` says),
  all exchanged in one ``order`` of the mesh axes, the first argument's. An owner's
  matrices are the stack's chunk that its place in the exchanges' order picks
  (:func:`_to_owners`: the first mesh axis exchanged the major one), so arrays split
  over their stack axis alone go in and out in that order too; in the mesh's order, a
  split of another order paired the eigenvalues of one matrix with the basis of
  another. ``None`` where a split cannot be exchanged in that order without changing
  its layout."""
  axes = tuple(mesh.axis_names)
  matrix = in_shapes[0][1:]
  known = lambda shape: (split if split is not None and shape[1:] == matrix  # noqa: E731
                         else _matrix_split(shape, mesh))
  in_splits = [known(shape) for shape in in_shapes]
  out_splits = (_result_splits(out_leaves, padded, mesh, replicate, layouts)
                if replicate or split is None else [known(o.shape) for o in out_leaves])
  lead = next((sp for sp in in_splits if sp), None)
  order = axes if lead is None else tuple(dict.fromkeys([n for _, n in lead] + list(axes)))
  ordered = [sp if sp is None else _in_order(sp, order) for sp in in_splits + out_splits]
  if any(sp is not None and o is None for sp, o in zip(in_splits + out_splits, ordered)):
    return None
  return ordered[:len(in_splits)], ordered[len(in_splits):], order


def _in_order(split: list, order: tuple) -> Optional[list]:
  """``split`` with its mesh axes exchanged in ``order``'s order, where that keeps the
  order of the names on each array axis (its layout), else ``None``."""
  ranked = sorted(split, key=lambda e: order.index(e[1]))
  on_axes = lambda sp: {a: [n for b, n in sp if b == a] for a, _ in sp}  # noqa: E731
  return ranked if on_axes(ranked) == on_axes(split) else None


def _spread_split(shape: tuple, mesh) -> Optional[list]:
  """:func:`spread_spec` as a split (``[(array axis, mesh axis), ...]``, every mesh axis
  on the one array axis), or ``None`` where it splits nothing."""
  spec = spread_spec(shape, mesh)
  for a, entry in enumerate(spec):
    if entry is not None:
      return [(a, name) for name in (entry if isinstance(entry, tuple) else (entry,))]
  return None


def owned_spec(shape: tuple, mesh) -> P:
  """The ``PartitionSpec`` of a state array kept in the owner layout across steps
  (:func:`run_owned`): its leading (stack) axis split over every axis of ``mesh`` where
  the mesh's size divides it; replicated otherwise (scalars, or a stack padded for
  another device count)."""
  size = _mesh_size(mesh)
  if mesh is None or not shape or shape[0] % size:
    return P()
  return P(tuple(mesh.axis_names))


def placement(counts: list, sizes: list, devices: int) -> tuple:
  """Where the matrices of state kept in the owner layout live: per group ``g`` (``counts[g]``
  matrices of ``sizes[g]`` elements each), the slot of each matrix in the group's stack of
  ``c_g P`` slots (device ``d`` holds slots ``[d c_g, (d + 1) c_g)``, ``c_g`` the most
  matrices of the group one device owns; the other slots are padding and hold zeros).

  Two costs follow from it. The largest load ``L`` (elements one device owns) sets the
  length of the exchange's rows, so what every device sends. The slots ``sum_g c_g
  sizes[g]`` set what every device computes and holds, since each runs the same program
  on ``c_g`` matrices of every group. Groups of larger matrices first, each matrix to the
  device with the fewest elements so far (longest processing time first) gives the
  smallest ``L`` this places, even where a group has fewer matrices than devices (an
  embedding and an output layer on 8 devices). A second pass keeps that ``L`` and spreads
  each group as evenly as it allows: each matrix to a device holding the fewest of its
  group, among those it fits on within ``L`` (the least loaded of them). The second pass
  is kept where its slots cost less (24 matrices of 512 x 1376 and 32 of 512 x 512 on 32
  devices: ``c = (1, 1)`` instead of ``(1, 3)``, the same ``L``). Returns the slots and
  each group's stack length ``c_g P``."""
  order = sorted(range(len(counts)), key=lambda g: (-sizes[g], g))

  def place(bound: Optional[int]) -> tuple:
    load = [0] * devices
    wheres: list = [None] * len(counts)
    for g in order:
      held = [0] * devices
      where = []
      for _ in range(counts[g]):
        fits = [x for x in range(devices) if bound is not None and load[x] + sizes[g] <= bound]
        if fits:
          d = min(fits, key=lambda x: (held[x], load[x], x))
        else:
          d = min(range(devices), key=lambda x: (load[x], held[x], x))
        where.append((d, held[d]))
        held[d] += 1
        load[d] += sizes[g]
      wheres[g] = (where, max(held, default=0))
    return wheres, max(load, default=0)

  def cost(wheres: list) -> int:
    return sum(c * z for (_, c), z in zip(wheres, sizes))

  wheres, bound = place(None)
  spread_out, top = place(bound)
  if top <= bound and cost(spread_out) < cost(wheres):
    wheres = spread_out
  out = [[d * c + j for d, j in where] for where, c in wheres]
  return out, [c * devices for _, c in wheres]


def device_load(slots: list, lengths: list, sizes: list, devices: int) -> list:
  """The elements each device owns where the matrices of groups of ``sizes`` elements
  sit in ``slots`` of stacks of ``lengths`` (:func:`placement`'s results): device ``d``
  holds slots ``[d c, (d + 1) c)`` of a stack of ``c P``."""
  load = [0] * devices
  for sl, n, size in zip(slots, lengths, sizes):
    for s in sl:
      load[s // (n // devices)] += size
  return load


def _block_layout(shape: tuple, split: list, mesh) -> tuple:
  """For a stack ``(k, m, n)`` split over mesh axes as ``split`` says: the block one device
  holds ``(k, m / R_m, n / R_n)`` and, for the blocks of a matrix listed in the order of
  the flat device index (row-major over the mesh axes), the permutation that puts them
  back together: ``(perm, grid)`` with ``pieces.reshape(mesh shape + block)
  .transpose(perm).reshape(m, n)``."""
  names = list(mesh.axis_names)
  per_axis = _names_per_axis(split)
  rows, cols = per_axis.get(len(shape) - 2, []), per_axis.get(len(shape) - 1, [])
  rm = math.prod(mesh.shape[n] for n in rows)
  rn = math.prod(mesh.shape[n] for n in cols)
  block = (shape[-2] // rm, shape[-1] // rn)
  a = len(names)
  perm = ([names.index(n) for n in rows] + [a] + [names.index(n) for n in cols] + [a + 1])
  return block, perm


def spread_spec(shape: tuple, mesh, major: tuple = ()) -> P:
  """The ``PartitionSpec`` of a matrix (stack) rotated where its shards are, on its
  unrotated side: the strictly larger of its last two axes split over every mesh axis
  (where the mesh's size divides it), ``major``'s first (the mesh axes the parameter
  already splits that side over, :func:`spread_major`), then the others in the mesh's
  order; everything else whole; a square one (a ``d x d`` statistic or basis) whole."""
  size = _mesh_size(mesh)
  if mesh is None or len(shape) < 2 or shape[-1] == shape[-2]:
    return P()
  a = len(shape) - 1 if shape[-1] > shape[-2] else len(shape) - 2
  if shape[a] % size:
    return P()
  first = tuple(n for n in major if n in mesh.axis_names)
  entries = [None] * len(shape)
  entries[a] = first + tuple(n for n in mesh.axis_names if n not in first)
  return P(*entries)


def spread_major(shape: tuple, param: Optional[tuple]) -> tuple:
  """The mesh axes that the parameter ``param`` (``(shape, spec)``; ``None``: not known)
  splits a matrix's unrotated (strictly larger) side over: those of its one axis of that
  size, else none. Where :func:`spread_spec` puts them first, a side split over them
  becomes split over every mesh axis by a local exchange within each of their blocks;
  in the mesh's order it was a permutation across them as well (tensor parallelism's
  512 x 32000 output layer at the 60M LLaMA's shapes: a collective-permute and an
  all-to-all each way)."""
  if param is None or len(shape) < 2 or shape[-1] == shape[-2]:
    return ()
  size = max(shape[-1], shape[-2])
  pshape, spec = param
  entries = list(spec) + [None] * (len(pshape) - len(spec))
  hits = [e for d, e in zip(pshape, entries) if d == size]
  if len(hits) != 1 or hits[0] is None:
    return ()
  return hits[0] if isinstance(hits[0], tuple) else (hits[0],)


def spread(x: jax.Array, major: tuple = ()) -> jax.Array:
  """``x`` laid out by :func:`spread_spec` (``major``: :func:`spread_major`) on the owner
  layout's mesh (as it is where the layout is off). Under FSDP, which splits a matrix's
  larger side over every device, that is where it already is; under tensor parallelism
  XLA moves it once here, instead of summing products over a split rotated side."""
  on = _ACTIVE.get()
  if on is None:
    return x
  spec = spread_spec(x.shape, state_mesh(), major)
  return x if spec == P() else _constrain(x, spec, on.mesh)


def pinned(tree: Any) -> Any:
  """Under the owner layout, ``tree``'s arrays replicated over its mesh (as they leave a
  refresh: :func:`map_whole` with ``replicate=True``); unchanged without the layout.

  For the state a refresh's conditional returns: its keep branch has the state's layout
  and its refresh branch another, and the conditional's output has one layout. Left to
  XLA, that layout was at times split on a basis' rank axis, and every product with the
  basis then gathered its result (Alice at the tiny LLaMA's shapes, FSDP over 8 CPU
  devices: 0.42x of the parameter bytes sent per ordinary step). Both branches pinned
  to the state's layout (this, and :func:`pinned_basis` for bases) sent 0.11x."""
  on = _ACTIVE.get()
  if on is None:
    return tree
  return jax.tree.map(lambda x: _constrain(x, P(), on.mesh), tree)


def basis_split(basis_shape: tuple, matrix_shape: tuple, larger: bool,
                mesh=None, split: Optional[list] = None) -> Optional[list]:
  """Where the state keeps a basis ``(k, d, r)`` of the rows side of matrices
  ``matrix_shape`` (``(k, d, n)``), as a split (``[(array axis, mesh axis), ...]``;
  ``None``: replicated): ``d`` split as the matrices' rows are (``split``, the
  matrices' split where known, :func:`view_split`; else as :func:`_matrix_split`
  guesses), the rank axis whole (``fo.state_shardings`` splits a basis as its
  parameter's axis of that size). With ``larger`` (a basis of a matrix's larger side,
  refreshed from coefficients ``sigma^T``, not a parameter) as :func:`spread_spec`
  splits the basis."""
  mesh = mesh if mesh is not None else _ACTIVE.get().mesh
  if larger and split is None:
    return _spread_split(tuple(basis_shape), mesh)
  if split is None:
    split = _matrix_split(tuple(matrix_shape), mesh)
  a, b = len(basis_shape) - 2, len(matrix_shape) - 2
  return [(a, n) for c, n in split or [] if c == b] or None


def exchange_split(basis_shape: tuple, matrix_shape: tuple, larger: bool,
                   mesh=None, split: Optional[list] = None) -> Optional[list]:
  """How a refresh returns a basis to :func:`basis_split`'s layout in one exchange: that
  split, the axes of the exchange (``mesh``, by default :func:`exchange_mesh`) it leaves
  out on the rank axis (where they divide it; a split over every axis of the exchange,
  which :func:`pinned_basis` then gathers on the rank axis), or ``None`` (gathered to
  every device). Mesh axes the exchange does not span stay whole: the basis comes back
  alike to every replica, where taking the state's slice is local."""
  mesh = mesh if mesh is not None else exchange_mesh()
  if split is not None:
    split = [(a, n) for a, n in split if n in mesh.axis_names]
  split = basis_split(basis_shape, matrix_shape, larger, mesh, split) or []
  used = {n for _, n in split}
  rest = [n for n in mesh.axis_names if n not in used]
  if basis_shape[-1] % math.prod(mesh.shape[n] for n in rest):
    return None
  return split + [(len(basis_shape) - 1, n) for n in rest]


def pinned_basis(u: jax.Array, matrix_shape: tuple, larger: bool,
                 split: Optional[list] = None) -> jax.Array:
  """Under the owner layout, a basis laid out where :func:`basis_split` says (``split``:
  the matrices' split where known); unchanged without the layout."""
  on = _ACTIVE.get()
  if on is None:
    return u
  split = basis_split(u.shape, matrix_shape, larger, on.mesh, split)
  spec = P() if split is None else _entries(u.shape, split, tuple(on.mesh.axis_names))
  return _constrain(u, spec, on.mesh)


def gram_in_place(shapes: list, splits: Optional[list] = None) -> list:
  """Per stack ``(k, m, n)`` of one refresh, whether its Gram ``G G^T`` is summed where
  its columns are rather than on an owner (:func:`summed_in_place`): under the owner
  layout, for a wide matrix (``2 m <= n``) whose columns the mesh's ``P`` devices
  divide, when it is larger than a device's share of all the stacks (on one owner it
  would set the length of every device's exchange: the tiny LLaMA's 128 x 2048 output
  layer is 20% of its parameters) or its Gram is small next to it (``2 m P <= n``). A
  device then sends about ``2 m^2`` numbers for it (the sum of the ``m x m`` Grams)
  instead of ``m n / P`` to its owner. Only where the stack's split is known
  (``splits``: :attr:`fisher_optax.lifting.Lifted.held_splits`) or the mesh has one
  axis: from a guessed split on a mesh of several axes, XLA moved the gradient toward
  the summed layout ahead of the refresh's conditional, and every ordinary step paid
  for it (GaLore, tiny LLaMA, FSDP 4 x TP 2: 0.15x -> 0.18x of the parameter bytes)."""
  on = _ACTIVE.get()
  if on is None:
    return [False] * len(shapes)
  size = _mesh_size(exchange_mesh())
  share = sum(math.prod(s) for s in shapes) / size
  splits = splits if splits is not None else [None] * len(shapes)
  out = []
  for s, split in zip(shapes, splits):
    m, n = s[-2], s[-1]
    wide = 2 * m <= n and n % size == 0
    known = split is not None or _split_axes(on.mesh) == 1
    out.append(wide and known and (m * n > share or 2 * m * size <= n))
  return out


def summed_in_place(g: jax.Array, operand: Callable, split: Optional[list] = None
                    ) -> jax.Array:
  """``operand(g)`` (a Gram ``G G^T`` per matrix of the stack ``g``) with ``g``'s columns
  split over every mesh axis the exchange spans (:func:`exchange_mesh`), those that
  split them already first (``split``: the stack's split where known, else guessed):
  each device forms the Gram of its columns and one all-reduce sums them, left on every
  device (:func:`gram_in_place`)."""
  on = _ACTIVE.get()
  names = tuple(exchange_mesh().axis_names)
  split = split if split is not None else _matrix_split(g.shape, exchange_mesh()) or []
  cols = tuple(n for a, n in split if a == g.ndim - 1)
  spec = P(*([None] * (g.ndim - 1)), cols + tuple(n for n in names if n not in cols))
  return _constrain(operand(_constrain(g, spec, on.mesh)), P(), on.mesh)


def rows_in_place(shapes: list, ranks: list) -> list:
  """Per stack ``(k, m, n)`` of tall matrices (``m > n``: coefficients ``sigma^T`` whose
  rows are a parameter's larger side, which a larger side's basis of rank ``ranks[i]``
  is refreshed from), whether it is refreshed where its rows are (:func:`on_rows`)
  rather than on an owner: under the owner layout, where the mesh's ``P`` devices
  divide ``m`` and the matrix is larger than a device's share of the refresh's work (an
  output layer's coefficients: on one owner it would set every device's exchange), or
  moving it (``m (n + 2 r) / P`` numbers: the matrix in, its bases back) would send
  more than the refresh's ``r x r`` sums in place (about ``20 r^2``).

  On an owner, a whole ``m x n`` matrix and its ``m x r`` bases sit in one device's
  memory: Alice-SOAP's at the 60M LLaMA's shapes under FSDP kept the update's temporary
  memory at 0.64x of the parameter bytes on 8 CPU devices and 0.58x on 32, most of it
  whole 32000 x 128 arrays; with the output layer's refreshed in place (its first
  refresh's SVD by a tall-skinny QR, ``linalg.split_left_singular``), 0.20x and 0.097x,
  and a refresh step sends 0.29x and 0.22x instead of 0.43x and 0.42x. Every stack in
  place sent more (0.62x on 32 devices): ten ``r x r`` sums per matrix outweigh moving a
  small one."""
  on = _ACTIVE.get()
  if on is None:
    return [False] * len(shapes)
  size = _mesh_size(exchange_mesh())
  share = sum(math.prod(s) for s in shapes) / size
  out = []
  for s, r in zip(shapes, ranks):
    m, n = s[-2:]
    out.append(m > n and m % size == 0
               and (m * n > share or m * (n + 2 * r) > 20 * r * r * size))
  return out


def on_rows(body: Callable[[list], list], items: list, splits: Optional[list] = None
            ) -> list:
  """``body(items)`` (a refresh of stacks, ``[(operand, basis, tracked, noise), ...]``
  -> ``[(basis, tracked), ...]``) inside a ``shard_map`` where every device holds a
  contiguous block of each operand's and basis' rows, split over every mesh axis the
  exchange spans (:func:`exchange_mesh`), and the rest whole;
  ``fisher_optax.linalg.rows_split`` makes the reductions over rows sum over the
  devices, so the mathematics is one matrix's. The bases come back split so,
  the tracked states replicated. ``splits``: per item, its stack's split where known
  (the mesh axes that split its rows already come first: the blocks are where they are);
  items whose axes come in another order run in a ``shard_map`` of their own."""
  if not items:
    return []
  on = _ACTIVE.get()
  splits = splits if splits is not None else [None] * len(items)
  orders: dict = {}
  for j, split in enumerate(splits):
    first = tuple(n for a, n in split or [] if a == 1)
    names = first + tuple(n for n in exchange_mesh().axis_names if n not in first)
    orders.setdefault(names, []).append(j)
  out = [None] * len(items)
  for names, members in orders.items():
    rows = P(None, names, None)
    group = [items[j] for j in members]
    in_specs = [tuple(rows if i < 2 else P() for i in range(len(item))) for item in group]

    def run(xs, names=names):
      with using(None), linalg.rows_split(names):
        return body(xs)

    res = jax.shard_map(run, in_specs=(in_specs,), out_specs=[(rows, P()) for _ in group],
                        check_vma=False, **_mesh_argument(on.mesh))(group)
    for j, r in zip(members, res):
      out[j] = r
  return out


def everywhere(fn: Callable, args: Any) -> Any:
  """``fn(args)`` on every device of the owner layout's mesh from replicated ``args``,
  with replicated results and no collective: left to XLA, a refresh of a Gram summed in
  place (:func:`summed_in_place`) was partitioned with gathers inside its loops."""
  on = _ACTIVE.get()
  return jax.shard_map(fn, in_specs=P(), out_specs=P(), check_vma=False,
                       **_mesh_argument(on.mesh))(args)


class SquareSplit(NamedTuple):
  """How one side's ``d x d`` statistics and bases are held and travel, and how its
  eigenvalues (``(k, d)``) are held (:func:`square_split`)."""
  held: list
  moved: Optional[list]
  values: list


def square_split(split: Optional[list], shape: tuple, side: str,
                 first: Optional[int] = None) -> Optional[SquareSplit]:
  """Under the owner layout, how a side's ``d x d`` statistics (a stack ``(k, d, d)``) of
  matrices ``(k, m, n)`` split as ``split`` (:func:`view_split` with ``spread=False``;
  ``None``: not known, guessed from ``shape`` as the exchange guesses a gradient's,
  :func:`_matrix_split`) are held and how they travel: ``(held, moved)``. ``held``, as
  ``fo.state_shardings`` lays such statistics out (roles ``left_square`` /
  ``right_square``): their first axis as that side of the matrix, or, for statistics of
  a square parameter's own shape (``first``: the axis of ``(k, m, n)`` that is the
  parameter's first), both axes as the parameter's; ``[]`` where they are whole on every
  device. ``moved``: ``held`` with the exchange's other mesh axes added to an axis they
  divide (the exchange splits a matrix over every axis it spans, :func:`exchange_mesh`;
  the rest is a local slice), ``None``
  where they divide neither. ``values``: the split of its eigenvalues, as that side of
  the matrix. ``None`` without the owner layout."""
  on = _ACTIVE.get()
  if on is None:
    return None
  if split is None:
    split = _matrix_split(tuple(shape), on.mesh) or []
  axis = 1 if side == "left" else 2
  values = [(1, name) for a, name in split if a == axis]
  held = values if first is None else (
      [(1, name) for a, name in split if a == first]
      + [(2, name) for a, name in split if a == 3 - first])
  d = shape[1]
  size = lambda ns: math.prod(on.mesh.shape[n] for n in ns)  # noqa: E731
  rows = [n for a, n in held if a == 1]
  cols = [n for a, n in held if a == 2]
  rest = [n for n in exchange_mesh().axis_names if n not in rows + cols]
  moved = None
  if d % size(rows + rest) == 0:
    moved = [(1, n) for n in rows + rest] + [(2, n) for n in cols]
  elif d % size(cols + rest) == 0:
    moved = [(1, n) for n in rows] + [(2, n) for n in cols + rest]
  return SquareSplit(held, moved, values)


def pinned_stack(x: jax.Array, split: Optional[list]) -> jax.Array:
  """Under the owner layout, a stack ``(k, m, n)`` kept where ``split`` says
  (:func:`view_split` with ``spread=False``; ``None``: not known, left to XLA)."""
  on = _ACTIVE.get()
  if on is None or split is None:
    return x
  return _constrain(x, _entries(x.shape, split, tuple(on.mesh.axis_names)), on.mesh)


def _constrain(x: jax.Array, spec: P, mesh) -> jax.Array:
  """``with_sharding_constraint`` to ``spec`` on the context mesh, else on ``mesh`` (as
  ``Auto`` axes where it has ``Explicit`` ones)."""
  if isinstance(mesh, jax.sharding.Mesh) and getattr(mesh, "explicit_axes", ()):
    mesh = as_auto(mesh)
  ctx = jax.sharding.get_abstract_mesh()
  if not ctx.empty:
    return jax.lax.with_sharding_constraint(x, spec)
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def run_owned(body: Callable[[int, jax.Array, Any], tuple], moved: list, owned: list,
              slots: list, lengths: list, splits: Optional[list] = None) -> tuple:
  """``body(g, stack, state) -> (out, new_state)`` for every group ``g`` of matrices, each
  matrix on its owner and the group's state ``owned[g]`` kept there from step to step.

  ``moved[g]``: the gradients of group ``g``, a list of stacks ``(k_j, m, n)`` (one per
  leaf) in the parameters' layout; ``splits[g][j]``: how stack ``j`` is split over the
  mesh where known (:func:`view_split`), else guessed from the shape
  (:func:`_matrix_split`). ``body`` gets group ``g`` as a stack of slots, matrix ``i``
  (in the order of the leaves' stacks) at slot ``slots[g][i]`` of ``lengths[g]``
  (:func:`placement`), and returns a stack in the same slots. ``owned[g]``: the group's
  state, arrays whose leading axis is the group's slots (split over the state's owners,
  every mesh axis or those of ``OwnerLayout.state_axes``, :func:`state_mesh`;
  :func:`owned_spec`) or scalars (replicated), which ``body`` must advance alike for any
  number of matrices (step counters). Returns per group the real matrices' results, a
  list of stacks in the gradients' layout and order, and the new states.

  Under the owner layout, for the groups whose slots the device count divides and whose
  matrices the mesh splits, inside ``jax.shard_map`` each device packs the blocks it
  holds of the matrices device ``o`` owns into row ``o`` of one buffer, one
  ``all_to_all`` over the state's owners' axes delivers the rows, and each owner puts
  its matrices together and runs ``body`` on its own slots and state with no collective (a device
  that owns none of a group's matrices runs it on none: padding costs no work), and
  sends the results back the same way: each device sends about ``2/P`` of the
  matrices' bytes per update and no padding slot travels. Each leaf's blocks travel
  from the split it has, so leaves of one shape split differently (tensor
  parallelism's row- and column-parallel matrices) need no common layout first. Other
  groups (and all of them without the owner layout) run ``body`` on their real
  matrices, taken from and put back into their slots of the state, laid out by XLA."""
  if not moved:
    return [], list(owned)
  on = _ACTIVE.get()
  if on is None:
    return _run_padded(body, moved, owned, slots, lengths)
  mesh = state_mesh()  # the state's owners (OwnerLayout.state_axes), every axis by default
  size = _mesh_size(mesh)
  shapes = _body_shapes(body, moved, owned, lengths)
  given = splits if splits is not None else [[None] * len(x) for x in moved]
  # a replicated matrix travels as guessed (local slices); from the state's slots, XLA summed
  # the whole owned state (SOAP, tiny, data parallel, 8 devices: 19.7x the parameters)
  item_splits = [[_owned_split(x.shape, sp, mesh) for x, sp in zip(xs, sps)]
                 for xs, sps in zip(moved, given)]

  def movable(g):  # its stacks split over the devices, its matrices over the owners
    return (all(jnp.shape(x)[0] % size == 0 for x in jax.tree.leaves(owned[g])
                if jnp.ndim(x)) and lengths[g] % size == 0
            and all(sp is not None and {n for _, n in sp} <= set(mesh.axis_names)
                    for sp in item_splits[g])
            and tuple(shapes[g][0].shape[1:]) == tuple(moved[g][0].shape[1:]))

  ways = [[g for g in range(len(moved)) if movable(g)],
          [g for g in range(len(moved)) if not movable(g)]]
  outs, new = [None] * len(moved), [None] * len(moved)
  for way, run, extra in zip(ways, (_run_exchanged, _run_padded),
                             ([[item_splits[g] for g in ways[0]]], [])):
    if way:
      got = run(lambda i, x, st, way=way: body(way[i], x, st), [moved[g] for g in way],
                [owned[g] for g in way], [slots[g] for g in way], [lengths[g] for g in way],
                *extra)
      for g, o, st in zip(way, *got):
        outs[g], new[g] = o, st
  return outs, new


def _owned_split(shape: tuple, split: Optional[list], mesh) -> Optional[list]:
  """How a stack of ``shape`` travels to the state's owners (``mesh``:
  :func:`state_mesh`) from ``split`` (its known split; ``None`` or ``[]``: guessed from
  the shape, :func:`_matrix_split`): the state's slots are spread over the owners' axes
  whatever axes one update's exchange spans, so a split over fewer is split further
  there, locally (:func:`spread_onto`); one over an axis outside them is returned as it
  is, for :func:`run_owned` to serve where it is."""
  if split and not {n for _, n in split} <= set(mesh.axis_names):
    return list(split)
  return ((spread_onto(split, shape[1:], mesh.axis_names, mesh) if split else None)
          or _matrix_split(shape, mesh))


def _body_shapes(body, moved: list, owned: list, lengths: list) -> list:
  """Per group, the shapes ``body`` returns for a stack of its ``lengths[g]`` slots."""
  with using(None):
    return [jax.eval_shape(lambda x, st, g=g: body(g, x, st),
                           jax.ShapeDtypeStruct((n,) + xs[0].shape[1:], xs[0].dtype), st)
            for g, (xs, n, st) in enumerate(zip(moved, lengths, owned))]


def _split_entries(moved: list, splits: list, slots: list) -> tuple:
  """One entry per group and split (the leaves that share a split travel as one stack):
  ``(group, split)``, its leaves ``(index in the group, stack size)``, its matrices'
  slots, and its stack."""
  entries, members, entry_slots, stacks = [], [], [], []
  for g, xs in enumerate(moved):
    by: dict = {}
    start = 0
    for j, (x, sp) in enumerate(zip(xs, splits[g])):
      by.setdefault(tuple(sp), []).append((j, range(start, start + x.shape[0])))
      start += x.shape[0]
    for key, ms in by.items():
      parts = [xs[j] for j, _ in ms]
      entries.append((g, list(key)))
      members.append([(j, len(r)) for j, r in ms])
      entry_slots.append([slots[g][i] for _, r in ms for i in r])
      stacks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
  return entries, members, entry_slots, stacks


def _run_exchanged(body, moved: list, owned: list, slots: list, lengths: list,
                   splits: list) -> tuple:
  """:func:`run_owned` for groups whose matrices the owner layout's mesh splits
  (``splits[g][j]``, leaf ``j``'s split): one ``all_to_all`` in and one out, inside
  ``jax.shard_map``, every leaf's blocks packed from and back to its own split."""
  on = _ACTIVE.get()
  mesh, transport = state_mesh(), on.transport_dtype
  owned_leaves, owned_tree = jax.tree.flatten(owned)
  axes = tuple(mesh.axis_names)
  owned_specs = [owned_spec(jnp.shape(x), mesh) for x in owned_leaves]
  shapes = _body_shapes(body, moved, owned, lengths)
  entries, members, entry_slots, stacks = _split_entries(moved, splits, slots)
  lays = [_block_layout(x.shape, sp, mesh) for x, (_, sp) in zip(stacks, entries)]
  plan = _ExchangePlan.make(mesh, entry_slots, [lengths[g] for g, _ in entries], lays, lays)
  send = sender(transport)

  def local(xs, leaves):
    me = jax.lax.axis_index(axes)
    got = jax.lax.all_to_all(plan.rows_to_owners([send(x) for x in xs]), axes, 0, 0,
                             tiled=True)  # row d: from device d
    pieces = plan.whole_matrices(got, me, [x.shape[1:] for x in stacks],
                                 [x.dtype for x in stacks])
    whole: list = [None] * len(moved)
    for e, ((g, _), x) in enumerate(zip(entries, pieces)):
      ok = plan._mine(e, me, plan.off_in)[1]
      whole[g] = x if whole[g] is None else jnp.where(ok[:, None, None], x, whole[g])
    states = jax.tree.unflatten(owned_tree, leaves)
    outs, new = [], []
    with using(None):
      for g, (stack, st) in enumerate(zip(whole, states)):
        per = lengths[g] // plan.size  # this device's slots of the group
        with _running(me * per + jnp.arange(per)):
          out, st = _on_owner(body, g, stack, st,
                              _holds(slots[g], lengths[g], plan.size, me))
        outs.append(out)
        new.append(st)
    back = jax.lax.all_to_all(plan.rows_back([send(outs[g]) for g, _ in entries], me),
                              axes, 0, 0, tiled=True)  # row o: from owner o
    return plan.blocks_back(back), jax.tree.leaves(new)

  got, new = jax.shard_map(
      local, in_specs=([_entries(x.shape, sp, axes) for x, (_, sp) in zip(stacks, entries)],
                       owned_specs),
      out_specs=([_entries(x.shape, sp, axes) for x, (_, sp) in zip(stacks, entries)],
                 owned_specs),
      check_vma=False, **_mesh_argument(on.mesh))(list(stacks), owned_leaves)
  outs: list = [[None] * len(xs) for xs in moved]
  for (g, _), ms, o in zip(entries, members, got):
    start = 0
    for j, k in ms:
      part = o if k == o.shape[0] else jax.lax.slice_in_dim(o, start, start + k)
      outs[g][j] = part.astype(shapes[g][0].dtype)
      start += k
  return outs, jax.tree.unflatten(owned_tree, new)


def _holds(slots: list, length: int, devices: int, me) -> Optional[jax.Array]:
  """Whether this device owns any of a group's matrices (slots ``slots`` of ``length``;
  a run-time value), or ``None`` where every device owns some."""
  owning = {s // (length // devices) for s in slots}
  if len(owning) == devices:
    return None
  return jnp.asarray([d in owning for d in range(devices)])[me]


def _on_owner(body, g: int, stack, state, holds) -> tuple:
  """``body(g, stack, state)`` on one owner's slots; with ``holds`` (whether this device
  owns any of the group's matrices, a run-time value) a device that owns none runs it on
  no matrix instead: its scalars (step counters) advanced as on the others, its slots'
  state and results zero (padding: never sent, never read). Zeros rather than the old
  state, which would make XLA copy the state on every step (measured: SOAP's temporary
  memory at ``tiny`` on 8 devices 10.9x the parameter bytes against 4.5x)."""
  if holds is None:
    return body(g, stack, state)

  def idle():
    none = jax.tree.map(lambda x: x[:0] if jnp.ndim(x) else x, state)
    _, new = body(g, stack[:0], none)
    new = jax.tree.map(lambda old, x: jnp.zeros_like(old) if jnp.ndim(old) else x, state,
                       new)
    out = jax.eval_shape(lambda: body(g, stack, state)[0])
    return jnp.zeros(out.shape, out.dtype), new

  return jax.lax.cond(holds, lambda: body(g, stack, state), idle)


# The slots of the group's stack that :func:`run_owned`'s ``body`` is traced on (None:
# outside it).
_SLOTS: contextvars.ContextVar = contextvars.ContextVar("fisher_optax_running_slots",
                                                        default=None)


@contextlib.contextmanager
def _running(slots: jax.Array):
  token = _SLOTS.set(slots)
  try:
    yield
  finally:
    _SLOTS.reset(token)


def running_slots() -> Optional[jax.Array]:
  """Inside :func:`run_owned`'s ``body``, the slot (in the group's stack of
  ``lengths[g]``) of each matrix of the stack it runs on (``int32``; on an owner its own
  slots, a run-time value), else ``None``: for a body whose results depend on which
  matrix it holds (per-matrix random draws)."""
  return _SLOTS.get()


def _run_padded(body, moved, owned, slots, lengths) -> tuple:
  """:func:`run_owned` without owners: ``body`` on each group's real matrices (its leaves'
  stacks concatenated), their state taken from their slots and put back (the same
  values, laid out by XLA; padding slots untouched, as on a device that owns none)."""
  outs, new = [], []
  with using(None):
    for g, (xs, st, sl, n) in enumerate(zip(moved, owned, slots, lengths)):
      x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0)
      if list(sl) == list(range(n)):
        with _running(jnp.arange(n)):
          out, st = body(g, x, st)
      else:
        at = jnp.asarray(sl)
        with _running(at):
          out, mine = body(g, x, jax.tree.map(lambda y: y[at] if jnp.ndim(y) else y, st))
        st = jax.tree.map(lambda old, y: old.at[at].set(y) if jnp.ndim(old) else y, st, mine)
      sizes = [y.shape[0] for y in xs]
      outs.append([jax.lax.slice_in_dim(out, sum(sizes[:j]), sum(sizes[:j + 1]))
                   for j in range(len(xs))] if len(xs) > 1 else [out])
      new.append(st)
  return outs, new


@dataclasses.dataclass(frozen=True)
class _ExchangePlan:
  """The static tables of :func:`run_owned`'s two exchanges, from the shapes alone.

  ``per[g]``: slots per device of group ``g``; ``owner[g][i]``: the device of its matrix
  ``i``; ``real[g][s]``: whether slot ``s`` holds a matrix; ``lay_in`` / ``lay_out``: per
  group the block one device holds and the permutation that puts a matrix's blocks back
  together (:func:`_block_layout`); ``off_in`` / ``off_out``: per group and slot, the
  offset of that matrix's block in its owner's row (every device's row to one owner has
  the same layout); ``len_in`` / ``len_out``: the rows' length, the most any owner
  gets."""
  grid: tuple
  slots: list
  per: list
  owner: list
  real: list
  lay_in: list
  lay_out: list
  off_in: list
  off_out: list
  len_in: int
  len_out: int

  @classmethod
  def make(cls, mesh, slots, lengths, lay_in, lay_out) -> "_ExchangePlan":
    grid = tuple(mesh.shape[n] for n in mesh.axis_names)
    size = math.prod(grid)
    per = [n // size for n in lengths]
    owner = [[s // c for s in sl] for sl, c in zip(slots, per)]

    def offsets(lays):
      at = [[0] * n for n in lengths]
      fill = [0] * size
      for g, (block, _) in enumerate(lays):
        for i, s in enumerate(slots[g]):
          at[g][s] = fill[owner[g][i]]
          fill[owner[g][i]] += math.prod(block)
      return at, max(max(fill), 1)

    real = [[False] * n for n in lengths]
    for g, sl in enumerate(slots):
      for s in sl:
        real[g][s] = True
    (off_in, len_in), (off_out, len_out) = offsets(lay_in), offsets(lay_out)
    return cls(grid, slots, per, owner, real, lay_in, lay_out, off_in, off_out, len_in,
               len_out)

  @property
  def size(self) -> int:
    return math.prod(self.grid)

  def _mine(self, g: int, me, table: list) -> tuple:
    """This device's slots of group ``g``: their offsets in ``table`` and whether each
    holds a matrix (run-time values: they depend on the device)."""
    mine = me * self.per[g] + jnp.arange(self.per[g])
    return jnp.asarray(table[g], jnp.int32)[mine], jnp.asarray(self.real[g])[mine]

  def rows_to_owners(self, xs: list) -> jax.Array:
    """``(P, len_in)``: row ``o`` holds this device's blocks of the matrices ``o`` owns."""
    rows = []
    for o in range(self.size):
      parts = [xs[g][i].reshape(-1) for g in range(len(xs)) for i in range(len(self.slots[g]))
               if self.owner[g][i] == o]
      row = jnp.concatenate(parts) if parts else jnp.zeros((0,), xs[0].dtype)
      rows.append(jnp.pad(row, (0, self.len_in - row.shape[0])))
    return jnp.stack(rows)

  def whole_matrices(self, got: jax.Array, me, shapes: list, dtypes: list) -> list:
    """The owner's slots of every group, ``(per[g], m, n)``, put together from the rows
    ``got`` (row ``d`` from device ``d``); padding slots zero."""
    out = []
    for g, ((bm, bn), perm) in enumerate(self.lay_in):
      at, ok = self._mine(g, me, self.off_in)
      take = jax.vmap(lambda a, bm=bm, bn=bn: jax.lax.dynamic_slice_in_dim(
          got, a, bm * bn, axis=1))(at)
      mats = take.reshape((self.per[g],) + self.grid + (bm, bn))
      mats = jnp.transpose(mats, [0] + [1 + p for p in perm]).reshape(
          (self.per[g],) + tuple(shapes[g]))
      out.append(jnp.where(ok[:, None, None], mats.astype(dtypes[g]), 0))
    return out

  def rows_back(self, outs: list, me) -> jax.Array:
    """``(P, len_out)``: row ``d`` holds device ``d``'s blocks of this owner's updates."""
    back = jnp.zeros((self.size, self.len_out), outs[0].dtype)
    for g, ((bm, bn), perm) in enumerate(self.lay_out):
      inv = [perm.index(j) for j in range(len(perm))]
      cut = perm.index(len(self.grid))  # the mesh axes before it split the rows
      blocks = outs[g].reshape((self.per[g],) + tuple(self.grid[j] for j in perm[:cut])
                               + (bm,) + tuple(self.grid[j] for j in perm[cut + 1:-1])
                               + (bn,))
      blocks = jnp.transpose(blocks, [0] + [1 + j for j in inv]).reshape(
          self.per[g], self.size, bm * bn)
      at, ok = self._mine(g, me, self.off_out)
      for j in range(self.per[g]):
        put = jax.lax.dynamic_update_slice_in_dim(back, blocks[j], at[j], axis=1)
        back = jnp.where(ok[j], put, back)
    return back

  def blocks_back(self, got: jax.Array) -> list:
    """This device's blocks ``(k_g, m / R_m, n / R_n)`` of every group's updates, in the
    gradients' order, from the rows ``got`` (row ``o`` from owner ``o``)."""
    res = []
    for g, ((bm, bn), _) in enumerate(self.lay_out):
      parts = [jax.lax.slice_in_dim(got[self.owner[g][i]], self.off_out[g][s],
                                    self.off_out[g][s] + bm * bn)
               for i, s in enumerate(self.slots[g])]
      res.append(jnp.stack(parts).reshape((len(parts), bm, bn)))
    return res
