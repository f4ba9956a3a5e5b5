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


def _result_splits(groups, out_leaves, mesh, replicate, layouts) -> list:
  """Per group and result, how it leaves the owners: exchanged back split as the
  gradients are guessed to be, or (``replicate``) as ``layouts`` says where that splits
  it over every mesh axis; ``None``: gathered to every device."""
  if not replicate:
    return [[owners._matrix_split(o.shape, mesh) if o.ndim == 3 else None for o in leaves]
            for leaves in out_leaves]
  out = []
  for args, leaves in zip(groups, out_leaves):
    want = list(layouts(args)) if layouts is not None else []
    want += [None] * (len(leaves) - len(want))
    out.append([sp if sp is not None and len(sp) == len(mesh.axis_names) and o.ndim == 3
                else None for sp, o in zip(want, leaves)])
  return out


@dataclasses.dataclass(frozen=True)
class _Packing:
  """The static tables of one :func:`map_packed` call: ``slots``/``lengths``/``per`` as
  :func:`fisher_optax.parallel.owners.placement` gives them; ``index[g][s]``, the matrix
  slot ``s`` holds (a padding slot: its owner's first); ``real[g][s]``, whether it holds
  one; ``ins``/``outs``/``kept``, the (group, position) of the arguments exchanged in, the
  results exchanged back and the results gathered; their plans."""
  mesh: Any
  slots: list
  lengths: list
  per: list
  index: list
  real: list
  ins: list
  outs: list
  kept: list
  plan_in: Any
  plan_out: Any
  gather: _Gather

  @classmethod
  def make(cls, mesh, groups, out_leaves, in_splits, out_splits) -> "_Packing":
    size = owners._mesh_size(mesh)
    ks = [next(a.shape[0] for a in args if a is not None) for args in groups]
    # balance what each owner receives and returns
    weights = [sum(math.prod(a.shape[1:]) for a in args if a is not None)
               + sum(math.prod(o.shape[1:]) for o in leaves)
               for args, leaves in zip(groups, out_leaves)]
    slots, lengths = owners.placement(ks, weights, size)
    per = [n // size for n in lengths]
    index, real = [], []
    for g in range(len(groups)):
      at = [None] * lengths[g]
      for i, s in enumerate(slots[g]):
        at[s] = i
      real.append([i is not None for i in at])
      for d in range(size):
        mine = at[d * per[g]:(d + 1) * per[g]]
        first = next((i for i in mine if i is not None), 0)
        at[d * per[g]:(d + 1) * per[g]] = [first if i is None else i for i in mine]
      index.append(at)
    ins = [(g, a) for g, sps in enumerate(in_splits) for a, sp in enumerate(sps)
           if sp is not None]
    outs = [(g, j) for g, sps in enumerate(out_splits) for j, sp in enumerate(sps)
            if sp is not None]
    kept = [(g, j) for g, sps in enumerate(out_splits) for j, sp in enumerate(sps)
            if sp is None]

    def plan(entries, table, arrays):
      if not entries:
        return None
      lays = [owners._block_layout(arrays[g][a].shape, table[g][a], mesh)
              for g, a in entries]
      return owners._ExchangePlan.make(mesh, [slots[g] for g, _ in entries],
                                       [lengths[g] for g, _ in entries], lays, lays)

    gather = _Gather.make([(g, math.prod(out_leaves[g][j].shape[1:])) for g, j in kept],
                          slots, per, size)
    return cls(mesh, slots, lengths, per, index, real, ins, outs, kept,
               plan(ins, in_splits, groups), plan(outs, out_splits, out_leaves), gather)

  def whole(self, given, groups, me, send) -> dict:
    """Inside ``shard_map``: the exchanged arguments of this owner's slots, whole
    (padding slots: a copy of the owner's first matrix), by (group, position)."""
    if self.plan_in is None:
      return {}
    axes = tuple(self.mesh.axis_names)
    got = jax.lax.all_to_all(
        self.plan_in.rows_to_owners([send(given[g][a]) for g, a in self.ins]),
        axes, 0, 0, tiled=True)  # row d: from device d
    mats = self.plan_in.whole_matrices(got, me, [groups[g][a].shape[1:] for g, a in self.ins],
                                       [groups[g][a].dtype for g, a in self.ins])
    out = {}
    for e, ((g, a), x) in enumerate(zip(self.ins, mats)):
      ok = self.plan_in._mine(e, me, self.plan_in.off_in)[1]
      out[g, a] = jnp.where(ok[:, None, None], x, x[:1])
    return out

  def run(self, g: int, run: Callable[[], list], me) -> list:
    """Group ``g``'s results on this owner's slots; a device that owns none of its
    matrices runs none of it (zeros, never sent)."""
    size = owners._mesh_size(self.mesh)
    per = self.per[g]
    if len({s // per for s in self.slots[g]}) == size:
      return run()
    holds = jnp.asarray([any(self.real[g][d * per:(d + 1) * per]) for d in range(size)])[me]
    shaped = jax.eval_shape(run)
    return jax.lax.cond(holds, run, lambda: [jnp.zeros(o.shape, o.dtype) for o in shaped])

  def gathered(self, results, out_leaves, me) -> list:
    """The results kept whole, from every owner's packed row (one ``all_gather``)."""
    if not self.kept:
      return []
    row = jnp.zeros((self.gather.length,),
                    jnp.result_type(*[results[g][j] for g, j in self.kept]))
    for e, (g, j) in enumerate(self.kept):
      for t in range(self.per[g]):
        s = me * self.per[g] + t
        put = jax.lax.dynamic_update_slice_in_dim(
            row, results[g][j][t].reshape(-1).astype(row.dtype),
            jnp.asarray(self.gather.off[e], jnp.int32)[s], axis=0)
        row = jnp.where(jnp.asarray(self.real[g], bool)[s], put, row)
    rows = jax.lax.all_gather(row, tuple(self.mesh.axis_names), axis=0,
                              tiled=False)  # row o: from owner o
    out = []
    for e, (g, j) in enumerate(self.kept):
      shape = out_leaves[g][j].shape[1:]
      n = math.prod(shape)
      out.append(jnp.stack([jax.lax.slice_in_dim(
          rows[s // self.per[g]], self.gather.off[e][s], self.gather.off[e][s] + n)
          .reshape(shape) for s in self.slots[g]]))
    return out


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
  mesh, transport = owners._ACTIVE.get()
  axes = tuple(mesh.axis_names)
  shapes = [jax.eval_shape(lambda *xs: local(fn, *xs), *args) for args in groups]
  out_leaves = [jax.tree.leaves(s) for s in shapes]
  if any(o.ndim < 2 or not jnp.issubdtype(o.dtype, jnp.floating)
         for leaves in out_leaves for o in leaves):
    return None
  in_splits = [[_arg_split(a, mesh) for a in args] for args in groups]
  out_splits = _result_splits(groups, out_leaves, mesh, replicate, layouts)
  pk = _Packing.make(mesh, groups, out_leaves, in_splits, out_splits)
  send = owners.sender(transport)
  flat = [(a, sp) for args, sps in zip(groups, in_splits)
          for a, sp in zip(args, sps) if a is not None]

  def body(*xs):
    me = jax.lax.axis_index(axes)
    it = iter(xs)
    given = [[None if a is None else next(it) for a in args] for args in groups]
    whole = pk.whole(given, groups, me, send)
    results = []
    for g, args in enumerate(groups):
      idx = jnp.asarray(pk.index[g], jnp.int32)[me * pk.per[g] + jnp.arange(pk.per[g])]
      mats = [None if x is None else whole[g, a] if (g, a) in whole else x[idx]
              for a, x in enumerate(given[g])]
      res = pk.run(g, lambda mats=mats: jax.tree.leaves(local(fn, *mats)), me)
      results.append([send(r) for r in res])
    back = []
    if pk.plan_out is not None:
      back = pk.plan_out.blocks_back(jax.lax.all_to_all(
          pk.plan_out.rows_back([results[g][j] for g, j in pk.outs], me), axes, 0, 0,
          tiled=True))  # row o: from owner o
    blocks = [b.reshape((b.shape[0],) + owners._block_layout(
        out_leaves[g][j].shape, out_splits[g][j], mesh)[0]) for b, (g, j) in zip(back, pk.outs)]
    return blocks + pk.gathered(results, out_leaves, me)

  res = jax.shard_map(
      body, in_specs=tuple(P() if sp is None else owners._entries(a.shape, sp, axes)
                           for a, sp in flat),
      out_specs=([owners._entries(out_leaves[g][j].shape, out_splits[g][j], axes)
                  for g, j in pk.outs] + [P()] * len(pk.kept)),
      check_vma=False, **owners._mesh_argument(mesh))(
          *[a if sp is None else send(a) for a, sp in flat])
  got = dict(zip(pk.outs + pk.kept, res))
  return [jax.tree.unflatten(jax.tree.structure(shapes[g]),
                             [got[g, j].astype(o.dtype) for j, o in enumerate(leaves)])
          for g, leaves in enumerate(out_leaves)]
