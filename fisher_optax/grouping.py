"""Grouping: one call serves many leaves' same-shape matrices.

A block computes per matrix; a model has many leaves of few shapes (the 130M LLaMA's 84
matrices have 4). :func:`shared` traces a per-leaf function once per shape,
:func:`map_grouped` concatenates same-shape stacks so that one decomposition call per
shape serves every layer (compile time flat in depth) and splits the results back,
:func:`vmap_grouped` does the same for per-element functions such as random draws.

Every note on XLA:CPU code generation that shapes these helpers is here, with its measured
effect; the blocks above hold only their mathematics.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from fisher_optax.parallel import owners, packed


def vmap_batch(fn: Callable[..., Any], nbatch: int) -> Callable[..., Any]:
  """Maps ``fn`` (written for one matrix) over ``nbatch`` leading batch axes.

  XLA:CPU note. An axis of size one is not ``vmap``-ed: ``fn`` runs on the arguments with
  that axis dropped and its outputs get it back (the same per-matrix arithmetic; random
  draws from keys passed in are the same under ``vmap``). A stack of one matrix is what
  ``stack_matrices=True`` makes of a parameter no other layer shares, such as the
  output layer. Vmapped over it, RACS's fixed point on a ``(1, 512, 32000)`` stack took
  2543 ms on a 2-core CPU (``benchmarks/primitives.py --preset 60M --only racs``), and
  the 60M LLaMA's RACS update with its output layer on RACS, stacked, measured 12.8x
  Adam's update; without the ``vmap`` 1.16x (``benchmarks/step_time.py --preset 60M
  --optimizers racs --layout stacked --hparams '{"lm_head_on_adam": false}'``).
  """
  for _ in range(nbatch):
    fn = _map_leading(fn)
  return fn


def _map_leading(fn: Callable[..., Any]) -> Callable[..., Any]:
  mapped = jax.vmap(fn)

  def call(*args):
    sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(args)}
    if sizes != {1}:
      return mapped(*args)
    out = fn(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), out)

  return call



def _members(groups: Sequence[Any]) -> dict:
  """``{key: [indices with that key]}`` for a list of static keys, in first-seen order."""
  members: dict = {}
  for i, key in enumerate(groups):
    members.setdefault(key, []).append(i)
  return members


def vmap_grouped_starts(shapes: Sequence[Sequence[int]], groups: Sequence[Any]) -> list:
  """Per leaf of :func:`vmap_grouped` (its argument's shape), the offset of its elements
  in its group's concatenation (static ints)."""
  starts = [0] * len(shapes)
  for idx in _members(groups).values():
    offset = 0
    for i in idx:
      starts[i] = offset
      offset += math.prod(shapes[i])
  return starts


def split(x: jax.Array, starts: Sequence[int], sizes: Sequence[int]) -> list:
  """``[x[s:s + z] for s, z in zip(starts, sizes)]`` along the first axis (static offsets).

  How a grouped result is handed back to its members. On GPU/TPU these are static slices;
  on CPU, ``dynamic_slice`` calls at offsets XLA cannot see (same values either way).
  """
  static = lambda y: [y if s == 0 and z == y.shape[0]  # noqa: E731
                      else jax.lax.slice_in_dim(y, s, s + z) for s, z in zip(starts, sizes)]
  if len(starts) < 2 or x.size == 0 or owners.active() is not None:
    # under the owner layout (a sharded program) the run-time offsets below made GSPMD
    # gather the whole grouped result onto every device: the tiny LLaMA's Muon update
    # sent 0.51x its parameter bytes per device instead of 0.16x on 8 CPU devices
    return static(x)
  # XLA:CPU note. A slice at a constant offset, fused with its neighbours, compiles into a
  # kernel of its own per offset, so splitting a grouped result compiled one kernel per
  # member leaf. Offsets handed in as run-time values make every member's slice the same
  # computation, which XLA:CPU compiles once. Offsets returned by a conditional are such
  # values: both branches return the same constants, and XLA keeps the conditional because
  # its predicate is read from the data. Measured on the 60M LLaMA tree (GaLore's update):
  # the refresh's split compiled 55 slice kernels instead of one, and the update compiled in
  # about 2.3 s instead of 1.5 s (optax.adam: about 0.7 s in the same process). The values,
  # the mathematics and the step time on accelerators are unchanged: the CPU branch of
  # ``platform_dependent`` is the only one compiled for CPU, static slices elsewhere.

  def on_cpu(y):
    offsets = lambda: tuple(jnp.int32(s) for s in starts)  # noqa: E731
    at = jax.lax.cond(jnp.ravel(y)[0].astype(jnp.float32) > 0, offsets, offsets)
    return [y if s == 0 and z == y.shape[0] else _take(y, o, z)
            for s, o, z in zip(starts, at, sizes)]

  return jax.lax.platform_dependent(x, cpu=on_cpu, default=static)


@functools.partial(jax.jit, static_argnums=2)
def _take(x: jax.Array, start: jax.Array, size: int) -> jax.Array:
  """``x[start:start + size]`` at a run-time ``start`` (traced once per shape)."""
  return jax.lax.dynamic_slice_in_dim(x, start, size)


def vmap_grouped(fn: Callable[[Any], Callable[[jax.Array], Any]], args: Sequence[jax.Array],
                 groups: Sequence[Any]) -> list:
  """``fn(group)`` (a function of one element) over every element of every ``args[i]``,
  one ``vmap`` call per distinct static ``groups[i]`` (e.g. an output shape).

  Returns, per leaf, an array of shape ``args[i].shape + out_shape``, equal to
  ``vmap``-ing ``fn(groups[i])`` over that leaf alone (e.g. per-matrix random draws:
  one draw call per shape instead of one per leaf).

  The results are split back with :func:`split`.
  """
  # XLA:CPU note: a threefry hash compiles into one large kernel (~0.2 s of compile
  # each), so drawing leaf by leaf made compile time grow with depth; grouped, it grows
  # with the number of distinct shapes.
  out: list = [None] * len(args)
  starts = vmap_grouped_starts([jnp.shape(a) for a in args], groups)
  for key, idx in _members(groups).items():
    flat = jnp.concatenate([jnp.reshape(args[i], (-1,)) for i in idx])
    res = jax.vmap(fn(key))(flat)
    parts = split(res, [starts[i] for i in idx], [math.prod(jnp.shape(args[i])) for i in idx])
    for i, part in zip(idx, parts):
      out[i] = jnp.reshape(part, jnp.shape(args[i]) + res.shape[1:])
  return out


def shared(fn: Callable[..., Any], static_argnums=()) -> Callable[..., Any]:
  """``fn`` (one leaf's or one matrix's computation) under ``jax.jit``, for a block to
  call on every leaf of a tree: JAX traces and lowers it once per distinct argument
  shape (the 130M LLaMA's 84 matrices have 4 shapes) and emits a call per leaf, where
  calling ``fn`` itself traced it again for every leaf, so tracing, lowering and XLA's
  passes grew with depth. XLA inlines the calls: the computation is the same.
  Closures over traced values (``optax.inject_hyperparams``) are allowed;
  ``static_argnums`` as for ``jax.jit`` (e.g. a :class:`MatrixView`)."""
  return jax.jit(fn, static_argnums=static_argnums)


def _groups(items: list) -> list:
  """Indices of ``items`` (argument tuples of arrays or shape-dtype structs) grouped by
  the shapes of their arguments after the stack axis, in first-seen order."""
  return list(_members([tuple(None if a is None else tuple(a.shape[1:]) for a in args)
                        for args in items]).values())


def _stack_size(args) -> int:
  return next(a.shape[0] for a in args if a is not None)


def group_starts(items: list) -> list:
  """Per item of :func:`map_grouped`'s ``items`` (arrays or ``jax.ShapeDtypeStruct``), its
  offset in its group's concatenation (static ints)."""
  starts = [0] * len(items)
  for members in _groups(items):
    offset = 0
    for j in members:
      starts[j] = offset
      offset += _stack_size(items[j])
  return starts


def map_matrices(fn, *args):
  """``fn`` (written for one matrix) over the leading axis of its arguments (arrays or None).

  Serves a stack of same-shape matrices (e.g. every layer's ``q_proj``) with one
  decomposition per stack: batched (``vmap``: one batched eigh/QR/SVD kernel) on
  GPU/TPU, a sequential ``lax.map`` (one loop body, compiled once) on CPU. On CPU
  jaxlib's batched LAPACK kernels split the batch over the intra-op thread pool and
  block on it; inside a conditional with two or more host devices
  (``--xla_force_host_platform_device_count``) that starves the pool and deadlocks
  (reproduced with jax 0.10 on 2 cores).
  """
  return jax.lax.platform_dependent(
      *args, cpu=lambda *a: jax.lax.map(lambda t: fn(*t), a), default=jax.vmap(fn))


def map_grouped(fn, items: list, *, state: bool = False, layouts=None,
                splits=None) -> list:
  """``fn`` (written for one matrix) over many stacks of matrices, one call per shape.

  ``items``: a list of argument tuples, each argument an array ``(b_i,) + shape`` (a stack
  of ``b_i`` matrices; ``b_i`` may differ between items) or ``None``. Items whose
  arguments have the same shapes are concatenated along the stack axis and served by one
  :func:`map_matrices` call (every layer's ``q_proj`` becomes one
  decomposition call, which keeps compile time flat in depth); the results are split
  back. Returns, per item, ``fn``'s output pytree with a leading axis ``b_i``.

  The results are split back with :func:`split`. ``state``: the results are optimizer
  state (new bases); under the owner layout they come back to every device
  (:func:`fisher_optax.parallel.owners.map_whole`), or split as ``layouts`` (given an
  item's arguments and split) says. ``splits``: per item, how its matrices are split
  over the owner layout's mesh where known (:meth:`fisher_optax.lifting.Lifted.splits`):
  under the owner layout each item then travels from its own split
  (:func:`fisher_optax.parallel.packed.map_packed`).
  """
  out = [None] * len(items)
  starts = group_starts(items)
  groups = _groups(items)
  # under the owner layout, every item's matrices move in one packed exchange, each
  # from the split it has
  if owners.active() is not None and groups:
    packed_res = packed.map_packed(fn, items, groups, map_matrices, splits=splits,
                                   replicate=state, layouts=layouts)
    if packed_res is not None:
      return packed_res
  cats = [[None if items[members[0]][a] is None
           else items[members[0]][a] if len(members) == 1
           else jnp.concatenate([items[j][a] for j in members], axis=0)
           for a in range(len(items[members[0]]))] for members in groups]
  for members, cat in zip(groups, cats):
    known = {None if splits is None or splits[j] is None else tuple(splits[j])
             for j in members}
    res = owners.map_whole(fn, cat, map_matrices, replicate=state, layouts=layouts,
                           split=list(known.pop()) if len(known) == 1 and None not in known
                           else None)
    if len(members) == 1:
      out[members[0]] = res
      continue
    at = [starts[j] for j in members]
    sizes = [_stack_size(items[j]) for j in members]
    leaves, treedef = jax.tree.flatten(res)
    parts = [split(leaf, at, sizes) for leaf in leaves]
    for k, j in enumerate(members):
      out[j] = jax.tree.unflatten(treedef, [p[k] for p in parts])
  return out
