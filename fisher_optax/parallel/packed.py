"""The owner layout's exchange for many stacks at once, packed: no padding slot travels.

:func:`fisher_optax.parallel.owners.map_whole` serves one stack of same-shape matrices:
it pads the stack to a multiple of the device count and every slot, padding included,
travels. Where a call serves several stacks (:func:`fisher_optax.grouping.map_grouped`:
every shape of a tree), and where a stack has fewer matrices than devices (an
embedding and an output layer on 8 devices), that padding was most of what a refresh
sent. :func:`map_packed` places every matrix of every stack on an owner at once
(:func:`fisher_optax.parallel.owners.placement`: larger matrices first, each to the
device with the least so far) and moves all of a call's arguments in one
``all_to_all``: each device packs the blocks it holds of the matrices device ``o`` owns
into row ``o`` of one buffer (rows as long as the most any owner receives). Each owner
runs the function on its own matrices (a device that owns none of a stack's matrices
runs none of it), and the results come back the same way, or, for results that are
optimizer state kept whole (replicated), in one ``all_gather`` of packed rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fisher_optax.parallel import owners


@dataclasses.dataclass(frozen=True)
class _Gather:
  """Where each owner puts its matrices of the results gathered to every device:
  ``off[e][s]``, the offset of slot ``s`` of entry ``e`` in its owner's row; ``length``,
  the rows' length."""
  off: list
  length: int

  @classmethod
  def make(cls, entries: list, slots: list, per: list, devices: int) -> "_Gather":
    fill = [0] * devices
    off = []
    for g, elems in entries:
      at = [0] * (per[g] * devices)
      for s in slots[g]:
        o = s // per[g]
        at[s] = fill[o]
        fill[o] += elems
      off.append(at)
    return cls(off, max(max(fill), 1))


def _arg_split(x, mesh) -> Optional[list]:
  """How an argument enters the owners: its matrices' split (exchanged), or ``None``
  (taken whole from its replicated value: scalars per matrix, random words)."""
  if x is None or x.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
    return None
  return owners._matrix_split(x.shape, mesh)


def map_packed(fn: Callable[..., Any], groups: list, local: Callable[..., Any], *,
               replicate: bool = False,
               layouts: Optional[Callable[[list], list]] = None) -> Optional[list]:
  """``local(fn, *args)`` for every ``args`` of ``groups`` (arrays ``(k_g, ...)`` or
  ``None``), each matrix on its owner, in one exchange each way; ``None`` where the
  results cannot travel packed (not floating arrays of matrices), for the caller to
  serve each stack on its own (:func:`fisher_optax.parallel.owners.map_whole`).

  The results come back split as the gradients are guessed to be
  (:func:`fisher_optax.parallel.owners._matrix_split`); with ``replicate`` (optimizer
  state) split as ``layouts(args)`` says, result by result, over every mesh axis, and
  replicated otherwise. Padding slots of an owner hold a copy of its first matrix, so
  that no slot meets a degenerate input; their results are never sent."""
  on = owners._ACTIVE.get()
  mesh, transport = on
  size = owners._mesh_size(mesh)
  axes = tuple(mesh.axis_names)
  ks = [next(a.shape[0] for a in args if a is not None) for args in groups]
  shapes = [jax.eval_shape(lambda *xs: local(fn, *xs), *args) for args in groups]
  out_leaves = [jax.tree.leaves(s) for s in shapes]
  if any(o.ndim < 2 or not jnp.issubdtype(o.dtype, jnp.floating)
         for leaves in out_leaves for o in leaves):
    return None
  # balance what each owner receives and returns
  weights = [sum(math.prod(a.shape[1:]) for a in args if a is not None)
             + sum(math.prod(o.shape[1:]) for o in leaves)
             for args, leaves in zip(groups, out_leaves)]
  slots, lengths = owners.placement(ks, weights, size)
  per = [n // size for n in lengths]

  in_splits = [[_arg_split(a, mesh) for a in args] for args in groups]
  if replicate:
    out_splits = []
    for args, leaves in zip(groups, out_leaves):
      want = list(layouts(args)) if layouts is not None else []
      want += [None] * (len(leaves) - len(want))
      out_splits.append([sp if sp is not None and len(sp) == len(axes) and o.ndim == 3
                         else None for sp, o in zip(want, leaves)])
  else:
    out_splits = [[owners._matrix_split(o.shape, mesh) if o.ndim == 3 else None
                   for o in leaves] for leaves in out_leaves]

  ins = [(g, a) for g, sps in enumerate(in_splits) for a, sp in enumerate(sps)
         if sp is not None]
  outs = [(g, j) for g, sps in enumerate(out_splits) for j, sp in enumerate(sps)
          if sp is not None]
  kept = [(g, j) for g, sps in enumerate(out_splits) for j, sp in enumerate(sps)
          if sp is None]

  def plan(entries, table, arrays):
    if not entries:
      return None
    lays = [owners._block_layout(arrays[g][a].shape, table[g][a], mesh) for g, a in entries]
    return owners._ExchangePlan.make(mesh, [slots[g] for g, _ in entries],
                                     [lengths[g] for g, _ in entries], lays, lays)

  plan_in = plan(ins, in_splits, groups)
  plan_out = plan(outs, out_splits, out_leaves)
  gather = _Gather.make([(g, math.prod(out_leaves[g][j].shape[1:])) for g, j in kept],
                        slots, per, size)
  # per group and slot: the matrix it holds, or the owner's first (padding)
  index = []
  for g in range(len(groups)):
    at = [None] * lengths[g]
    for i, s in enumerate(slots[g]):
      at[s] = i
    for d in range(size):
      mine = at[d * per[g]:(d + 1) * per[g]]
      first = next((i for i in mine if i is not None), 0)
      at[d * per[g]:(d + 1) * per[g]] = [first if i is None else i for i in mine]
    index.append(at)
  real = [[False] * n for n in lengths]
  for g, sl in enumerate(slots):
    for s in sl:
      real[g][s] = True
  send = lambda x: (x.astype(transport) if transport is not None  # noqa: E731
                    and jnp.issubdtype(x.dtype, jnp.floating) else x)
  flat = [a for args in groups for a in args if a is not None]
  flat_splits = [sp for args, sps in zip(groups, in_splits)
                 for a, sp in zip(args, sps) if a is not None]

  def body(*xs):
    me = jax.lax.axis_index(axes)
    it = iter(xs)
    given = [[None if a is None else next(it) for a in args] for args in groups]
    whole = {}
    if plan_in is not None:
      got = jax.lax.all_to_all(plan_in.rows_to_owners([send(given[g][a]) for g, a in ins]),
                               axes, 0, 0, tiled=True)  # row d: from device d
      mats = plan_in.whole_matrices(got, me, [groups[g][a].shape[1:] for g, a in ins],
                                    [groups[g][a].dtype for g, a in ins])
      for e, ((g, a), x) in enumerate(zip(ins, mats)):
        ok = plan_in._mine(e, me, plan_in.off_in)[1]
        whole[g, a] = jnp.where(ok[:, None, None], x, x[:1])  # padding: the first matrix
    results = []
    for g, args in enumerate(groups):
      mine = me * per[g] + jnp.arange(per[g])
      idx = jnp.asarray(index[g], jnp.int32)[mine]
      mats = [None if x is None else whole[g, a] if (g, a) in whole else x[idx]
              for a, x in enumerate(given[g])]
      run = lambda mats=mats: jax.tree.leaves(local(fn, *mats))  # noqa: E731
      holds = jnp.asarray([any(real[g][d * per[g]:(d + 1) * per[g]])
                           for d in range(size)])[me]
      if len({s // per[g] for s in slots[g]}) < size:  # a device owns none: it runs none
        shaped = jax.eval_shape(run)
        res = jax.lax.cond(holds, run,
                           lambda shaped=shaped: [jnp.zeros(o.shape, o.dtype) for o in shaped])
      else:
        res = run()
      results.append([send(r) for r in res])
    back = []
    if plan_out is not None:
      got = jax.lax.all_to_all(plan_out.rows_back([results[g][j] for g, j in outs], me),
                               axes, 0, 0, tiled=True)  # row o: from owner o
      back = plan_out.blocks_back(got)
    kept_out = []
    if kept:
      row = jnp.zeros((gather.length,), jnp.result_type(*[results[g][j] for g, j in kept]))
      for e, (g, j) in enumerate(kept):
        r = results[g][j]
        for t in range(per[g]):
          s = me * per[g] + t
          at = jnp.asarray(gather.off[e], jnp.int32)[s]
          ok = jnp.asarray(real[g], bool)[s]
          put = jax.lax.dynamic_update_slice_in_dim(row, r[t].reshape(-1).astype(row.dtype),
                                                    at, axis=0)
          row = jnp.where(ok, put, row)
      rows = jax.lax.all_gather(row, axes, axis=0, tiled=False)  # row o: from owner o
      for e, (g, j) in enumerate(kept):
        shape = out_leaves[g][j].shape[1:]
        n = math.prod(shape)
        parts = [jax.lax.slice_in_dim(rows[s // per[g]], gather.off[e][s],
                                      gather.off[e][s] + n).reshape(shape)
                 for s in slots[g]]
        kept_out.append(jnp.stack(parts))
    blocks = [b.reshape((b.shape[0],) + owners._block_layout(
        out_leaves[g][j].shape, out_splits[g][j], mesh)[0]) for b, (g, j) in zip(back, outs)]
    return blocks + kept_out

  out_specs = ([owners._entries(out_leaves[g][j].shape, out_splits[g][j], axes)
                for g, j in outs] + [P()] * len(kept))
  res = jax.shard_map(
      body, in_specs=tuple(P() if sp is None else owners._entries(a.shape, sp, axes)
                           for a, sp in zip(flat, flat_splits)),
      out_specs=out_specs, check_vma=False,
      **owners._mesh_argument(mesh))(*[send(a) if sp is not None else a
                                       for a, sp in zip(flat, flat_splits)])
  got = dict(zip(outs + kept, res))
  return [jax.tree.unflatten(jax.tree.structure(shapes[g]),
                             [got[g, j].astype(o.dtype) for j, o in enumerate(leaves)])
          for g, leaves in enumerate(out_leaves)]
