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
:func:`fisher_optax.state_partition_specs` and :func:`fisher_optax.describe` read.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fisher_optax import grouping, lifting, matrices, routing


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
  dims_leaves = treedef.flatten_up_to(matrices.resolve_dims(dims, tree))
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
