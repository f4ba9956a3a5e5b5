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
``[k, ...]`` array per group instead of one per leaf, plus the int32 offsets where the
split cuts, :func:`unstack`) and, for methods that draw random numbers per matrix
(switching, APOLLO's projections), which draws each matrix gets.

Why: XLA compiles a leaf-by-leaf update into one subgraph per leaf (HLO passes and
distinct kernels grow with depth: RACS on the 130M LLaMA's 85 matrices compiles in ~8x
Adam's time on CPU); over stacks it compiles one subgraph per group, as for a model
that stacks its layers (``nnx.scan``). The named optimizers expose it as
``stack_matrices=True``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
  as in a model that stacks its layers: merging all same-size matrices into one stack
  (``q``, ``k``, ``v``, ``o`` together) compiled slower (RACS on the 130M LLaMA: 1.35 s
  against 0.8 s on an idle 2-core CPU): XLA:CPU compiles identical kernels once, and the
  groups of one parameter per layer have identical shapes, so theirs are shared, while one
  big stack's slices (one per member, each at its own offset) are all different. Any
  grouping gives the same per-matrix updates."""
  return re.sub(r"\d+", "*", routing.path_to_str(path)) + f" {view.fan_in}x{view.fan_out}"


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
    p = plan(params, dims)
    return StackMatricesState(inner.init(stack(p, params)))

  def update_fn(updates, state, params=None, **extra):
    p = plan(updates, dims)
    new, inner_state = inner.update(stack(p, updates), state.inner,
                                    None if params is None else stack(p, params), **extra)
    return unstack(p, new), StackMatricesState(inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
