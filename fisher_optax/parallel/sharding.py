"""Optimizer-state ``PartitionSpec``s from the parameters' specs (docs: "Sharding and
multi-host training").

:func:`state_partition_specs` returns, for any optax transformation built from
fisher_optax blocks (and optax's own), the ``PartitionSpec`` tree of its state:

* every state leaf is attributed to the parameter whose tree path ends its own path
  (``state.basis["layers"][0]["kernel"]`` belongs to ``params["layers"][0]["kernel"]``);
* its leading axes are the parameter's batch axes (stacked layers) and keep their specs;
* each remaining axis takes the spec of the parameter's matrix axis of the same size
  (moments ``r x n`` are split where the parameter's ``n`` axis is, scaling vectors
  likewise, Adam moments exactly like the parameter); where the parameter is split on
  its smaller side only (FSDP's split of a square matrix), the ``n`` axis of such
  ``r x n`` state is split over that side's mesh axes when a ``mesh`` is given and they
  divide it (held whole on every device, these moments kept one device's optimizer
  state at 0.93x Adam's for GaLore and 1.03x for Alice at the tiny LLaMA's shapes, FSDP
  over 8 CPU devices; split so, 0.59x and 0.69x, for 0.044x of the parameter bytes more
  sent per step: the coefficients gathered for ``U coeffs``), and else its ``r`` axis
  where they divide that (the 1B LLaMA's 5461-wide MLP matrices, FSDP over 8 CPU
  devices: GaLore's state per device 1.4x Adam's held whole, 0.36x split on ``r``, for
  the same bytes sent per step); where the parameter is split on both sides (FSDP x
  tensor parallelism), such state's ``n`` axis follows the larger side, and where the
  update knows where its state is (``Explicit`` mesh axes, ``OwnerLayout(param_specs=...,
  state_placed=True)``, or boxes named by the mesh's axes) it is split further over the
  smaller side's mesh axes, on ``n`` after the larger side's where they divide it, else
  on ``r`` where they divide that; the update sums and scatters ``U^T G`` onto it, or
  moves the gradient to its columns where that sends less
  (:func:`fisher_optax.parallel.owners.relay_split`): at the 60M LLaMA's shapes under
  FSDP 4 x TP 2 on 8 CPU devices GaLore's state per device was 0.26x of the parameter
  bytes held whole over the FSDP axis, against Adam's 0.25x, and 0.13x split so, for
  the same bytes sent per step (APOLLO 0.043x against 0.092x; Fira, Alice and Alice-0,
  which gather ``sigma`` whole for ``U sigma``, about 0.065x more); under FSDP 16 x TP 2
  on 32, 0.20x against Adam's 0.063x, and 0.04x split so, with 0.089x sent per step
  instead of 0.160x. An update that does not know would sum ``U^T G`` whole and gather
  the coefficients again (Alice: 0.36x against 0.17x per step), so there they are held
  as before; fields whose state NamedTuple declares a role in its ``SHARDING`` class attribute follow it, not their name: ``d x d``
  rotation statistics and bases (``left_square``/``right_square``) are split on their first
  axis only, a larger side's low-rank basis (``columns``) as a square parameter's columns
  where they are split, tracked ``r x r`` states, eigenvalues and PRNG keys
  (``replicated``) are replicated, as is every leaf not attributable to a parameter (step
  counters);
* a mesh axis is used at most once per spec, and only where the size divides (when a
  ``mesh`` is given);
* state kept in the owner layout (``rotate(..., owners=P)``, the rotation family's
  ``owner_layout=mesh``) is split over every mesh axis on its stack axis
  (role ``owners``); the moments of the matrices that layout rotates where their shards
  are, on their larger (unrotated) side (role ``spread``);
* under ``stack_matrices=True`` the structured rule's state belongs to the stacks of
  :mod:`fisher_optax.stacking` (one per parameter of a layer): their matrix axes follow
  their members' specs, their stack axis is replicated.

All of this only decides *layouts*; results do not depend on it (tests compare sharded
with single-device runs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fisher_optax import matrices, model_dims, routing, stacking
from fisher_optax.parallel import owners
from fisher_optax.parallel.roles import field_roles

def _spec_entries(spec: Optional[P], ndim: int) -> list:
  entries = list(spec) if spec is not None else []
  return entries + [None] * (ndim - len(entries))


def _axis_size(mesh: Optional[Mesh], entry) -> int:
  if mesh is None or entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  size = 1
  for n in names:
    size *= mesh.shape.get(n, 1)  # a logical name (mapped by rules later) is not checked
  return size


def _leaf_spec(shape, role, pshape, pspec, dims, mesh, crossed: bool = False) -> P:
  """The spec of a state leaf of ``shape`` and ``role`` that belongs to a parameter of
  shape ``pshape`` split as ``pspec`` (the rules of the module docstring; ``crossed``:
  the update knows where the state is, so the ``r x n`` state of a matrix split on both
  sides is split on ``r`` too)."""
  if role == "replicated":
    return P()
  pent = _spec_entries(pspec, len(pshape))
  if tuple(shape) == tuple(pshape):
    return _usable(shape, pent, mesh)
  if len(pshape) < 2:
    return P()
  view = matrices.matrix_view(pshape, dims)
  batch = view.batch_axes
  if tuple(shape[:len(batch)]) != tuple(pshape[a] for a in batch):
    return P()
  # each matrix side: (its size, the spec of its major axis; merged axes are sharded
  # like their first axis, which a row-major reshape keeps contiguous)
  rows = (view.fan_in, pent[view.rows[0]])
  cols = (view.fan_out, pent[view.cols[0]])
  trailing = _matrix_entries(list(shape[len(batch):]), role, rows, cols, mesh, crossed)
  return _usable(shape, [pent[a] for a in batch] + trailing, mesh)


def _matrix_entries(trailing: list, role, rows: tuple, cols: tuple, mesh,
                    crossed: bool = False) -> list:
  """The entries of a state leaf's axes past its parameter's batch axes (sizes
  ``trailing``), from the matrix sides ``rows`` and ``cols`` (``(size, entry)``)."""
  sides = [rows] if role == "rows" else [rows, cols]
  entries = []
  for pos, d in enumerate(trailing):
    if role in ("left_square", "right_square"):
      if pos:
        entries.append(None)
        continue
      cands = [sd for sd in sides if sd[0] == d]
      if len(cands) > 1:
        cands = [rows if role == "left_square" else cols]
      entries.append(cands[0][1] if cands else None)
      continue
    cands = [sd for sd in sides if sd[0] == d]
    if len(cands) > 1 and role == "columns" and cols[1] is not None and pos == 0:
      cands = [cols]  # a square parameter's split columns (tensor parallelism)
    if len(cands) > 1:  # square parameter: positional (rows first) unless a vector
      cands = [cands[pos if len(trailing) == 2 else (-1 if role != "rows" else 0)]]
    entry = cands[0][1] if cands else None
    if (mesh is not None and role == "auto" and pos == 1
        and len(trailing) == 2 and cands
        and (cands[0] is cols or rows[0] > cols[0])
        and trailing[0] not in (rows[0], cols[0])):
      smaller = (rows if cands[0] is cols else cols)[1]
      if entry is None:
        entries[-1], entry = _coefficient_split(trailing, smaller, entries[-1], mesh)
      elif crossed and smaller is not None and entries[-1] is None:
        # split on both sides (FSDP x tensor parallelism): n over both sides' axes where
        # they divide it, else r over the smaller side's axes
        both = _names(entry) + _names(smaller)
        if trailing[1] % _axis_size(mesh, both):
          entries[-1] = smaller
        else:
          entry = both
    entries.append(entry)
  return entries


def _names(entry) -> tuple:
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _coefficient_split(trailing: list, axes, r_entry, mesh) -> tuple:
  """The entries ``(r, n)`` of the state of a matrix's ``r x n`` coefficients (``n`` its
  larger side) where the matrix is split on its smaller side only, over the mesh axes
  ``axes``: ``n`` split over them where they divide it, not held whole on every device;
  where they do not, ``r`` split over them where they divide that and ``r`` has no entry
  yet (``r_entry``)."""
  size = _axis_size(mesh, axes)
  if trailing[1] % size and not trailing[0] % size and r_entry is None:
    return axes, None
  return r_entry, axes


def _usable(shape, entries: list, mesh) -> P:
  """``entries`` as a ``PartitionSpec``: each mesh axis used once (the first time), and
  only where its size divides the dimension (with a ``mesh``)."""
  used, out = set(), []
  for d, e in zip(shape, entries):
    names = e if isinstance(e, tuple) else ((e,) if e is not None else ())
    if e is None or any(n in used for n in names) or d % _axis_size(mesh, e):
      out.append(None)
      continue
    used.update(names)
    out.append(e)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


@dataclasses.dataclass(frozen=True)
class Owned:
  """A state leaf's owner (index of its parameter leaf, or ``None``) and its spec; not a
  pytree node, so a tree of them has the state's structure."""
  owner: Optional[int]
  spec: P


def state_partition_specs(tx, params: Any, param_specs: Any, *, dims: matrices.DimsSpec = None,
                          mesh: Optional[Mesh] = None) -> Any:
  """``PartitionSpec`` tree for ``tx.init(params)``.

  Args:
    tx: the (fisher_optax or optax) transformation.
    params: parameters, or their shapes (``jax.ShapeDtypeStruct`` leaves).
    param_specs: a tree of ``PartitionSpec`` (or ``None``) matching ``params``.
    dims: the optimizer's matrix axes; default: those the named optimizer ``tx`` was
      built with (its ``dims=``), else the last two axes.
    mesh: if given, mesh axes that do not divide a dimension are dropped.
  """
  if getattr(mesh, "explicit_axes", ()):
    # on Explicit axes init reads the parameters' split from their types (the low-rank
    # family's state on the owners): traced here with those types, as a sharded init is
    with jax.set_mesh(mesh):
      state_shapes = jax.eval_shape(tx.init, _typed(params, param_specs, mesh))
  else:
    state_shapes = jax.eval_shape(tx.init, params)
  owned = owned_specs(tx, state_shapes, params, param_specs, dims=dims, mesh=mesh)
  return jax.tree.map(lambda o: o.spec, owned)


def _typed(params: Any, param_specs: Any, mesh: Mesh) -> Any:
  """``params`` as shapes whose types carry their specs on ``mesh`` (a spec ``None``:
  replicated)."""
  leaves, treedef = jax.tree.flatten(params)
  specs = jax.tree.leaves(param_specs, is_leaf=lambda x: x is None or isinstance(x, P))
  if len(specs) != len(leaves):
    raise ValueError(f"param_specs has {len(specs)} leaves, the parameters {len(leaves)}: "
                     "give one PartitionSpec (or None) per parameter")
  return treedef.unflatten([
      jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype,
                           sharding=NamedSharding(mesh, P() if s is None else s))
      for x, s in zip(leaves, specs)])


def owned_specs(tx, state: Any, params: Any, param_specs: Any, *,
                dims: matrices.DimsSpec = None, mesh: Optional[Mesh] = None,
                boxed: bool = False) -> Any:
  """For each leaf of ``state`` (``tx``'s state for ``params``, arrays or shapes): an
  :class:`Owned` ``(owner, spec)``, ``owner`` the index of the parameter leaf it belongs to (in
  ``jax.tree.leaves(params)`` order; a stack's first member under the stacked layout) or
  ``None``, ``spec`` its ``PartitionSpec`` by the rules of :func:`state_partition_specs`.
  ``boxed``: the state is named in boxes on ``mesh`` for an update that reads them.
  """
  if dims is None and isinstance(tx, routing.RoutedTransformation):
    dims = tx.dims
  p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  s_leaves = jax.tree.leaves(param_specs, is_leaf=lambda x: x is None or isinstance(x, P))
  dims_tree = model_dims.resolve_dims(dims, params)
  d_leaves = jax.tree.leaves(dims_tree, is_leaf=lambda x: isinstance(x, matrices.MatrixDims))
  by_path = {tuple(path): (leaf.shape, spec, d, i)
             for i, ((path, leaf), spec, d) in enumerate(zip(p_leaves, s_leaves, d_leaves))}
  if stacking.is_stacked(tx):
    by_path.update(_stack_owners(stacking.stacks_of(params, tx.labels(params), dims), s_leaves))
  max_len = max((len(k) for k in by_path), default=0)

  roles = field_roles(state)
  info = getattr(tx, "info", {})
  owner_mesh = mesh if mesh is not None else info.get("owner_mesh")
  # the state kept on the owners over the axes the layout names (OwnerLayout.state_axes)
  owner_mesh = owners.axes_of(owner_mesh, info.get("owner_state_axes"))
  # whether the update will know each gradient's split (Explicit axes, or the specs given
  # to its owner layout), and so lay a one-sided matrix out on its own axes first
  knows_split = bool(getattr(mesh, "explicit_axes", ())) or info.get("owner_specs", False)
  # whether the update will also know where the state is (its types on Explicit axes,
  # OwnerLayout(state_placed=True), or boxes named on a mesh): only then is the state of
  # a matrix split on both sides split on r as well (module docstring)
  crossed = (bool(getattr(mesh, "explicit_axes", ())) or boxed
             or bool(info.get("owner_specs") and info.get("owner_placed")))

  def spec_for(path, leaf):
    path = tuple(path)
    role = roles.get(jax.tree_util.keystr(path))
    if role == "owners":
      # owner-layout stacks (not any one parameter's): split on the stack axis
      return Owned(None, owners.owned_spec(jax.numpy.shape(leaf), owner_mesh))
    for n in range(min(max_len, len(path)), 0, -1):
      hit = by_path.get(path[-n:])
      if hit is not None:
        pshape, pspec, d, owner = hit
        if role == "spread":
          shape = jax.numpy.shape(leaf)
          major = owners.spread_major(shape, (pshape, pspec)) if knows_split else ()
          return Owned(owner, owners.spread_spec(shape, owner_mesh, major))
        role = role or "auto"
        shape = leaf.shape if hasattr(leaf, "shape") else jax.numpy.shape(leaf)
        return Owned(owner, _leaf_spec(shape, role, pshape, pspec, d, mesh, crossed))
    return Owned(None, P())

  return jax.tree_util.tree_map_with_path(spec_for, state)


def _stack_owners(stacks: list, spec_leaves: list) -> dict:
  """Under ``stack_matrices=True`` the structured rule's state belongs to stacks
  ``(k, fan_in, fan_out)`` (:func:`fisher_optax.stacking.stacks_of`): each is a virtual
  parameter, its matrix axes sharded like its members' (where they all agree), its stack
  axis replicated."""
  out = {}
  for s in stacks:
    entries = [(_spec_entries(spec_leaves[i], len(v.shape)), v) for i, v in s.members]
    rows = {e[v.rows[0]] for e, v in entries}
    cols = {e[v.cols[0]] for e, v in entries}
    spec = P(None, rows.pop() if len(rows) == 1 else None, cols.pop() if len(cols) == 1 else None)
    out[(jax.tree_util.DictKey(s.name),)] = (s.shape, spec, matrices.MatrixDims(),
                                             s.members[0][0])
  return out


def state_shardings(tx, params: Any, param_specs: Any, mesh: Mesh, **kw) -> Any:
  """:func:`state_partition_specs` as a tree of ``NamedSharding`` on ``mesh``."""
  specs = state_partition_specs(tx, params, param_specs, mesh=mesh, **kw)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))
