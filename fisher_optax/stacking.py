"""The matrices of every layer stacked into one leaf per parameter, for the structured rule.

:func:`stack_matrices` runs a matrix transformation on a tree with one leaf per
parameter of a layer: every routed leaf is brought to its matrix view ``(b, fan_in,
fan_out)`` (batch axes merged; :class:`~fisher_optax.matrices.MatrixView` without the
smaller-side transpose, which the blocks inside still apply); the leaves of the same
parameter in every layer with the same ``(fan_in, fan_out)`` (:func:`group_name`) are
concatenated along the stack axis (mixed dtypes promote); the results are split,
brought back to each leaf's layout and cast to its dtype. Every block maps its
per-matrix mathematics over a stack (``Lifted.per_matrix``), so the update of each
matrix is the one it gets unstacked; what changes is the layout of the state (one
``[k, ...]`` array per group instead of one per leaf) and, for methods that draw random
numbers per matrix (switching, APOLLO's projections), which draws each matrix gets.

Why: XLA compiles a leaf-by-leaf update into one subgraph per leaf (HLO passes and
distinct kernels grow with depth); over stacks it compiles one subgraph per group, as
for a model that stacks its layers (``nnx.scan``). The named optimizers expose it as
``stack_matrices=True`` (their ``_finish`` applies :func:`stack_matrices`); the state's
owners under that layout (:func:`stacks_of`) are what
:func:`fisher_optax.state_partition_specs` and :func:`fisher_optax.describe` read;
:func:`convert_state_layout` moves a state between the two layouts.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax import lifting, matrices, model_dims, owned_stacks, routing
from fisher_optax.blocks import rotate_owned
from fisher_optax.parallel import owners, slots, variables


class StackMatricesState(NamedTuple):
  """``inner``: the inner transformation's state over the stacked tree, a dict keyed by
  group (:func:`group_name`)."""
  inner: Any


class StackPlan(NamedTuple):
  """How one tree's leaves are stacked: per leaf its view, dtype and (group, first
  matrix, number of matrices); ``groups`` lists each group's member leaves in order."""
  treedef: Any
  views: list
  dtypes: list
  slots: list
  groups: dict


def group_name(path: Any, view: matrices.MatrixView) -> str:
  """``"layers/*/attn/q_proj/kernel 768x768"``: the leaf's ``/``-joined path with every
  run of digits replaced by ``*`` (so the layers of a model, ``layers/0/...`` or
  ``layers_0/...``, fall into one group), then its matrix size ``fan_in x fan_out``.

  Grouping by path as well as size keeps each stack to one parameter of every layer,
  as in a model that stacks its layers: the groups of one parameter per layer have
  identical shapes, so XLA shares their kernels, while one big stack of all same-size
  matrices (``q``, ``k``, ``v``, ``o`` together) would cut each member at its own offset.
  Any grouping gives the same per-matrix updates."""
  return re.sub(r"\d+", "*", matrices.path_to_str(path)) + f" {view.fan_in}x{view.fan_out}"


def plan(tree: Any, dims: matrices.DimsSpec) -> StackPlan:
  """Groups the leaves of ``tree`` (arrays or shape structs; ``optax.MaskedNode``s are
  not leaves) by :func:`group_name` of their path and matrix view under ``dims``."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  dims_leaves = treedef.flatten_up_to(model_dims.resolve_dims(dims, tree))
  views = [matrices.matrix_view(jnp.shape(x), d, what="stack_matrices")
           for (_, x), d in zip(flat, dims_leaves)]
  groups: dict = {}
  slots = []
  for i, ((path, _), v) in enumerate(zip(flat, views)):
    name = group_name(path, v)
    members = groups.setdefault(name, [])
    slots.append((name, sum(views[j].num_matrices for j in members), v.num_matrices))
    members.append(i)
  return StackPlan(treedef, views, [jnp.dtype(x.dtype) for _, x in flat], slots, groups)


def plan_routed(params: Any, labels: Any, dims: matrices.DimsSpec) -> tuple[StackPlan, list]:
  """The plan of the leaves a named optimizer routes to its structured rule (``labels``:
  its ``"structured"``/``"fallback"`` tree over ``params``), and their indices among
  ``params``' leaves; for :mod:`fisher_optax.parallel.sharding` and
  :func:`fisher_optax.describe`."""
  flat_labels = jax.tree.leaves(labels)
  masked = jax.tree.map(lambda x, lab: x if lab == "structured" else optax.MaskedNode(),
                        params, labels)
  return plan(masked, dims), [i for i, lab in enumerate(flat_labels) if lab == "structured"]


class Stack(NamedTuple):
  """One stack of a named optimizer built with ``stack_matrices=True``: its ``name``
  (:func:`group_name`, the key of its state), ``shape`` ``(k, fan_in, fan_out)`` and
  ``members``, ``(leaf index among the parameters' leaves, matrix view)`` in order."""
  name: str
  shape: tuple
  members: list


AUTO = "auto"


def resolve(stack_matrices: Any) -> bool:
  """``stack_matrices`` of a named optimizer as a bool: ``"auto"`` stacks on GPU and TPU
  (``jax.default_backend()`` when the optimizer is built) and not on CPU.

  Measured (docs: "Performance"): on an NVIDIA H200, stacking took the 60M LLaMA's
  ordinary step from 2.18x to 0.90x ``optax.adam``'s (RACS) and from 2.47x to 1.36x
  (Alice), each matrix's kernels otherwise launched one leaf at a time. On a 2-core CPU
  the per-leaf layout was the faster (130M ordinary step: RACS 0.57-0.68x against
  1.27-2.22x stacked, GaLore 1.58-1.75x against 1.91x, Alice 3.48-3.70x against 4.75x)
  and holds no transient copy of the gradients."""
  if isinstance(stack_matrices, bool):
    return stack_matrices
  if stack_matrices == AUTO:
    return jax.default_backend() != "cpu"
  raise ValueError(f"`stack_matrices` must be True, False or 'auto', got {stack_matrices!r}")


def is_stacked(tx: Any) -> bool:
  """Whether ``tx`` is a named optimizer built with ``stack_matrices=True``."""
  return (isinstance(tx, routing.RoutedTransformation)
          and bool(tx.info.get("stack_matrices")))


def stacks_of(params: Any, labels: Any, dims: matrices.DimsSpec) -> list:
  """The :class:`Stack` s such a named optimizer makes of ``params`` (``labels``: its
  routing labels over them): the owners of its structured rule's state."""
  p, index = plan_routed(params, labels, dims)
  out = []
  for name, members in p.groups.items():
    views = [p.views[j] for j in members]
    shape = (sum(v.num_matrices for v in views), views[0].fan_in, views[0].fan_out)
    out.append(Stack(name, shape, [(index[j], p.views[j]) for j in members]))
  return out


def state_numbers_by_member(state: Any, stacks: list, *, nbytes: bool = False) -> dict:
  """``{leaf index: numbers}`` (or bytes): the numbers of each stack's state (every array
  under a key named like the stack) shared among its member leaves in proportion to
  their matrices (every matrix of a stack holds the same state)."""
  per_stack = {s.name: 0 for s in stacks}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)
                 and k.key in per_stack), None)
    if name is not None:
      size = int(np.prod(getattr(leaf, "shape", ())))
      per_stack[name] += size * (np.dtype(leaf.dtype).itemsize if nbytes else 1)
  out: dict = {}
  for s in stacks:
    for i, view in s.members:
      out[i] = out.get(i, 0) + per_stack[s.name] * view.num_matrices // s.shape[0]
  return out


def add_stacked_state(counts: list, rec: Any, paths: list, *, nbytes: bool = False) -> None:
  """Adds the state numbers (or bytes) of a stacked named optimizer's stacks to their
  member leaves: ``counts[i]`` belongs to the parameter path ``paths[i]``; ``rec`` is the
  :class:`~fisher_optax.routing.RoutedInit` of the optimizer's ``init``."""
  stacks = stacks_of(rec.params, rec.labels, rec.routed.dims)
  inner_paths = [matrices.path_to_str(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(rec.params)[0]]
  outer = {p: i for i, p in enumerate(paths)}
  for i, numbers in state_numbers_by_member(rec.state, stacks, nbytes=nbytes).items():
    counts[outer[inner_paths[i]]] += numbers


def stack(p: StackPlan, tree: Any) -> dict:
  """``tree`` (the planned structure) -> ``{group: (k, fan_in, fan_out) array}``."""
  leaves = p.treedef.flatten_up_to(tree)

  def view(i):
    v = p.views[i]
    return v.to_canonical(leaves[i]).reshape((v.num_matrices, v.fan_in, v.fan_out))

  return {name: (view(idx[0]) if len(idx) == 1
                 else jnp.concatenate([view(i) for i in idx], axis=0))
          for name, idx in p.groups.items()}


def unstack(p: StackPlan, stacked: dict) -> Any:
  """Inverse of :func:`stack`; each leaf cast (saturating) to its planned dtype. A leaf
  that is part of its stack is cut out with a static slice (XLA:CPU's cost of those:
  :func:`fisher_optax.grouping.map_grouped`)."""
  out = []
  for (name, start, num), v, dtype in zip(p.slots, p.views, p.dtypes):
    x = stacked[name]
    if num != x.shape[0]:
      x = jax.lax.slice_in_dim(x, start, start + num, axis=0)
    x = v.from_canonical(x.reshape(v.batch_shape + (v.fan_in, v.fan_out)))
    out.append(lifting.cast_like(x, dtype))
  return p.treedef.unflatten(out)


def _is_placeholder(x: Any) -> bool:
  """optax.tree.map_params's stand-in for the parameters: a pytree node without children,
  so only its type tells it apart from an empty tree."""
  return type(x).__name__ == "_ParamsPlaceholder"


def stack_matrices(inner: optax.GradientTransformation, *,
                   dims: matrices.DimsSpec = None) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` (a matrix transformation built with ``dims=None``) on the leaves
  stacked per parameter and size (module docstring); ``dims`` are the leaves' own
  matrix axes.

  Per matrix ``W_i`` of the tree, the update is ``inner``'s update of ``W_i`` (blocks map
  their per-matrix equations over stacks), so this changes compile time and the state's
  layout, not the mathematics. ``params`` (if given) are stacked like the updates.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    if any(not hasattr(x, "shape") for x in jax.tree.leaves(params, is_leaf=_is_placeholder)):
      raise ValueError(
          "stack_matrices: the stacked layout's state is one array per stack of "
          "same-shape matrices, not per parameter, so it cannot be initialised from "
          "leaves without shapes (optax.tree.map_params initialises with placeholders). "
          "The default stack_matrices='auto' stacks on GPU and TPU: build the optimizer "
          "with stack_matrices=False for a parameter-shaped state, or use "
          "fo.state_partition_specs / fo.state_shardings, which know both layouts.")
    p = plan(params, dims)
    return StackMatricesState(inner.init(stack(p, params)))

  def update_fn(updates, state, params=None, **extra):
    p = plan(updates, dims)
    new, inner_state = inner.update(stack(p, updates), state.inner,
                                    None if params is None else stack(p, params), **extra)
    return unstack(p, new), StackMatricesState(inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ------------------------------------------------------------ converting a state's layout


def _is_leaf_node(treedef) -> bool:
  return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _groups_of(node: Any, plans: list):
  """The plan whose groups are exactly the keys of the dict ``node`` (a stacked
  layout's arrays of one statistic), else ``None``."""
  if not isinstance(node, dict) or not node:
    return None
  return next((pl for pl in plans if set(node) == set(pl[1].groups)), None)


def _to_stacked(per_leaf: Any, template: dict, plan_of) -> dict:
  """One statistic: per-leaf arrays (``per_leaf``: the masked parameter tree) -> one
  ``(k, ...)`` array per group, members concatenated in the plan's order (a member's
  entry may be a subtree, e.g. ``None`` for a side a block leaves alone)."""
  rec, p, index = plan_of
  entries = jax.tree_util.tree_structure(rec.params).flatten_up_to(per_leaf)

  def group(t, *xs):
    parts = [jnp.reshape(x, (p.views[j].num_matrices,) + t.shape[1:]).astype(t.dtype)
             for j, x in zip(members, xs)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

  out = {}
  for name, members in p.groups.items():
    out[name] = jax.tree.map(group, template[name], *[entries[index[j]] for j in members])
  return out


def _to_per_leaf(stacked: dict, template: Any, plan_of) -> Any:
  """Inverse of :func:`_to_stacked`: each member's rows of its group, in its own shape."""
  rec, p, index = plan_of
  treedef = jax.tree_util.tree_structure(rec.params)
  entries = treedef.flatten_up_to(template)

  def member(x, t, start, num):
    if num != x.shape[0]:
      x = jax.lax.slice_in_dim(x, start, start + num, axis=0)
    return jnp.reshape(x, t.shape).astype(t.dtype)

  for j, (name, start, num) in enumerate(p.slots):
    entries[index[j]] = jax.tree.map(lambda x, t: member(x, t, start, num),
                                     stacked[name], entries[index[j]])
  return treedef.unflatten(entries)


def _convert(src: Any, tpl: Any, plans: list, path: tuple) -> Any:
  """``src`` brought to the layout of ``tpl`` (its abstract twin in the target layout),
  walking both trees together."""
  where = jax.tree_util.keystr(path) or "the state"
  owned = owned_stacks.OwnedStacksState
  if (isinstance(src, owned) or isinstance(tpl, owned)) and not _same_layout(src, tpl):
    return _convert_owned(src, tpl, plans, where)
  rotated = rotate_owned.RotateOwnedState
  if (isinstance(src, rotated) or isinstance(tpl, rotated)) and not _same_layout(src, tpl):
    return _convert_rotated(src, tpl, plans, where)
  if isinstance(tpl, StackMatricesState) or isinstance(src, StackMatricesState):
    inner = lambda x: x.inner if isinstance(x, StackMatricesState) else x  # noqa: E731
    out = _convert(inner(src), inner(tpl), plans, path)
    return StackMatricesState(out) if isinstance(tpl, StackMatricesState) else out
  plan_tpl, plan_src = _groups_of(tpl, plans), _groups_of(src, plans)
  if (plan_tpl is None) != (plan_src is None):
    try:
      return (_to_stacked(src, tpl, plan_tpl) if plan_tpl is not None
              else _to_per_leaf(src, tpl, plan_src))
    except (ValueError, TypeError, KeyError) as e:
      raise ValueError(
          f"convert_state_layout: {where} does not hold the matrices of the target "
          "optimizer's parameters in either layout: the state is not one of this "
          f"optimizer's (other hyperparameters, another parameter tree?). ({e})") from None
  src_children, src_def = slots.one_level(src)
  tpl_children, tpl_def = slots.one_level(tpl)
  def mismatch():
    return ValueError(
        f"convert_state_layout: {where} is {_describe(src)} in the given state but "
        f"{_describe(tpl)} for the target optimizer: the state is not one of this "
        "optimizer's (other hyperparameters, another parameter tree?)")

  if _is_leaf_node(tpl_def):
    if not _is_leaf_node(src_def) or tuple(jnp.shape(src)) != tuple(tpl.shape):
      raise mismatch()
    return src if jnp.result_type(src) == tpl.dtype else jnp.asarray(src, tpl.dtype)
  if src_def.node_data() != tpl_def.node_data() or len(src_children) != len(tpl_children):
    raise mismatch()
  keys = [k for k, _ in jax.tree_util.tree_flatten_with_path(
      tpl, is_leaf=lambda y: y is not tpl)[0]]
  return tpl_def.unflatten([_convert(s, t, plans, path + k)
                            for s, t, k in zip(src_children, tpl_children, keys)])


# the rotations (settings, tree) the target's init recorded, for _convert_rotated
_ROTATIONS: contextvars.ContextVar = contextvars.ContextVar("rotations", default=None)


def _same_layout(src: Any, tpl: Any) -> bool:
  """Whether two states have one structure and the same shapes (a state kept on the
  owners padded for as many devices, over the same stacks, as the target's)."""
  if jax.tree.structure(src) != jax.tree.structure(tpl):
    return False
  return all(tuple(jnp.shape(a)) == tuple(jnp.shape(b))
             for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(tpl)))


def _convert_owned(src: Any, tpl: Any, plans: list, where: str) -> Any:
  """A state kept on the owners (``OwnedStacksState``) to the parameters' layout, or
  back, or to the owners of another device count: each named optimizer's structured
  leaves are tried as the tree the state was built for
  (:func:`fisher_optax.owned_stacks.to_per_leaf`)."""
  ways = []
  for rec, _, _ in plans:
    tree = jax.tree.map(lambda x, lab: x if lab == "structured" else optax.MaskedNode(),
                        rec.params, rec.labels)
    ways.append((lambda s, tree=tree, d=rec.routed.dims: owned_stacks.to_per_leaf(s, tree, d),
                 lambda s, t, tree=tree, d=rec.routed.dims: owned_stacks.to_owned(
                     s, t, tree, d)))
  return _through_per_leaf(src, tpl, plans, where, owned_stacks.OwnedStacksState, ways,
                           "low-rank")


def _convert_rotated(src: Any, tpl: Any, plans: list, where: str) -> Any:
  """The rotation family's state kept on the owners (``RotateOwnedState``) to its
  per-leaf state, or back, or to the owners of another device count: the rotations'
  settings and trees are those their ``init`` recorded for the target
  (:func:`fisher_optax.blocks.rotate_owned.to_per_leaf`)."""
  ways = [(lambda s, rot=rot, tree=tree: rotate_owned.to_per_leaf(rot, s, tree),
           lambda s, t, rot=rot, tree=tree: rotate_owned.to_owned(rot, s, tree,
                                                                 t.load.shape[0]))
          for rot, tree in _ROTATIONS.get() or []]
  return _through_per_leaf(src, tpl, plans, where, rotate_owned.RotateOwnedState, ways,
                           "rotation")


def _through_per_leaf(src: Any, tpl: Any, plans: list, where: str, kind: type, ways: list,
                      what: str) -> Any:
  """``src`` to the layout of ``tpl`` where either is a state of ``kind`` kept on the
  owners: through the per-leaf layout, which :func:`_convert` brings to ``tpl`` (stacked
  or not). ``ways``: ``(to_per_leaf, to_owned)`` pairs to try, the first that fits."""
  errors = []
  for to_per_leaf, to_owned in ways:
    try:
      mid = to_per_leaf(src) if isinstance(src, kind) else src
      if not isinstance(tpl, kind):
        return _convert(mid, tpl, plans, ())
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tpl)
      out = to_owned(_convert(mid, jax.eval_shape(to_per_leaf, shapes), plans, ()), tpl)
      if not _same_layout(out, tpl):
        raise ValueError("the stacks' state differs from the target's")
      return out
    except (ValueError, TypeError, KeyError) as e:
      errors.append(e)
  raise ValueError(
      f"convert_state_layout: {where} does not hold the {what} state of the target "
      "optimizer's parameters, on their owners or laid out as the parameters: the state "
      f"is not one of this optimizer's (other hyperparameters, another parameter tree?). "
      f"({errors[0] if errors else 'no ' + what + ' state recorded'})")


def _describe(x: Any) -> str:
  if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, tuple):
    return f"an array of shape {tuple(x.shape)}"
  if isinstance(x, dict):
    keys = sorted(map(str, x))
    return f"a dict with keys {keys[:4]}{' ...' if len(keys) > 4 else ''}"
  return f"a {type(x).__name__}"


def convert_state_layout(state: Any, tx: optax.GradientTransformation, params: Any) -> Any:
  """``state`` of a named optimizer (alone or inside ``optax.chain``,
  ``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.partition``...) saved in one
  ``stack_matrices`` layout, converted to the layout of ``tx``: the same optimizer
  with the same hyperparameters, built with the other ``stack_matrices``.

  The statistics are moved, not recomputed: a stacked array ``(k, ...)`` of a group holds
  its members' per-leaf arrays, each reshaped to ``(matrices, ...)``, in the order of the
  parameters' leaves; converting back and forth returns the state unchanged, and the next
  update equals the one of the layout the state came from (to float32 rounding, as
  between the layouts' updates). Counters, keys and the fallback's state are kept. A
  state already in ``tx``'s layout is returned as it is. The draws of the methods that
  draw random numbers per matrix (switching, APOLLO) continue as the target layout draws
  them.

  State kept on the matrices' owners -- the low-rank family's
  (``fo.OwnerLayout(state_on_owners=...)``, :class:`~fisher_optax.OwnedStacksState`) and
  the rotation family's (built under a mesh, :class:`~fisher_optax.RotateOwnedState`) --
  converts the same way to and from the parameters' layout (each matrix's statistics
  from and to its slot of its size's stack, a matrix held transposed in its stack with
  its sides swapped and its moments transposed; padding slots start as ``init`` leaves
  them) and between the owners of two device counts, e.g. for a checkpoint of a run on 8
  devices continued by an optimizer built under a mesh of 32, or on one device. Such a
  state also continues as it is on any mesh or on one device.

  This is what a checkpoint needs when it moves between backends: ``stack_matrices``'
  default ``"auto"`` stacks on GPU and TPU and not on CPU. Restore it with the
  abstract state of the layout it was saved in, then convert::

    saved_tx = fo.racs(lr, stack_matrices=True)     # the layout of the checkpoint
    state = checkpointer.restore(path, jax.eval_shape(saved_tx.init, params))
    state = fo.convert_state_layout(state, fo.racs(lr, stack_matrices=False), params)

  Args:
    state: the optimizer state in either layout (arrays, also placed on a mesh with
      ``Explicit`` axes; under ``jax.jit`` tracers; boxed in ``nnx.Variable`` s or Linen
      boxes as ``tx.init`` boxes it, or not).
    tx: the transformation that will continue it.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``, or a tree of boxes:
      the result is then boxed as ``tx.init`` boxes the state of these parameters).

  Returns:
    The state in ``tx``'s layout, with the structure, shapes and dtypes of
    ``tx.init(params)``. Arrays keep their values; place them with
    :func:`fisher_optax.state_shardings` when the layout's sharding matters.

  Raises:
    ValueError: ``tx`` holds no named optimizer, or ``state`` is not a state of ``tx``
      in either layout (the message names the first leaf that differs).
  """
  if variables.has_variables(params) or variables.has_variables(state):
    # boxes (nnx.Variables, Linen's nn.Partitioned) carry names only: the values are
    # converted, then boxed as tx.init boxes its state for these parameters
    out = convert_state_layout(variables.unwrap(state), tx, variables.unwrap(params))
    return variables.rewrap_like(jax.eval_shape(lambda p: tx.init(p), params), out)
  with routing.record_routed_inits() as found, rotate_owned.recording() as rotations:
    # a new function each call: a trace jax cached would not run the recording inits
    template = jax.eval_shape(lambda p: tx.init(p), params)
  if not found:
    raise ValueError("convert_state_layout: tx holds no fisher_optax named optimizer "
                     "(fo.racs, fo.alice, ...), so it has no stack_matrices layout")
  plans = []
  for rec in found:
    p, index = plan_routed(rec.params, rec.labels, rec.routed.dims)
    plans.append((rec, p, index))
  token = _ROTATIONS.set(rotations)
  try:
    # arrays on Explicit mesh axes are taken apart as on Auto ones (the same shards);
    # place the result with fo.state_shardings
    with _auto_context():
      return _convert(owners.on_auto_axes(state), template, plans, ())
  finally:
    _ROTATIONS.reset(token)


def _auto_context():
  """Under a context mesh with ``Explicit`` axes, the same mesh with ``Auto`` axes (the
  state's arrays are moved to it, :func:`fisher_optax.parallel.owners.on_auto_axes`),
  else nothing."""
  ctx = jax.sharding.get_abstract_mesh()
  if ctx.empty or not getattr(ctx, "explicit_axes", ()):
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(ctx.update_axis_types(
      {name: jax.sharding.AxisType.Auto for name in ctx.axis_names}))
