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

Each leaf's matrices travel from the split they have: same-shape leaves split differently
(tensor parallelism's column-parallel ``q_proj`` and row-parallel ``o_proj``) are packed
leaf by leaf, never concatenated into one stack first, which would make XLA move all but
one of them into a common layout on the way.
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
class _Entry:
  """The arrays at one argument or result position ``pos`` of group ``g`` of the leaves
  ``items`` that share one split: their matrices are the group's ``at`` (indices in the
  group's order), in the order of ``items``, whose stack sizes are ``ks``."""
  g: int
  pos: int
  items: tuple
  ks: tuple
  at: tuple


def _entries_of(g: int, pos: int, found: list) -> list:
  """``found``: ``(split, item, k, start)`` per leaf of group ``g`` at ``pos``; one
  :class:`_Entry` per distinct split (leaves of one split travel together: their
  stacks concatenate where they are), with the splits."""
  by: dict = {}
  for sp, j, k, start in found:
    by.setdefault(None if sp is None else tuple(sp), []).append((j, k, start))
  return [(_Entry(g, pos, tuple(j for j, _, _ in ms), tuple(k for _, k, _ in ms),
                  tuple(i for _, k, st in ms for i in range(st, st + k))),
           None if key is None else list(key)) for key, ms in by.items()]


def _sorted(found: dict) -> tuple:
  """The entries of ``found`` (``{(g, pos): [(split, item, k, start), ...]}``) that travel
  split (with their splits) and those that do not (taken from, or gathered to, every
  device)."""
  split, splits, whole = [], [], []
  for (g, pos), leaves in found.items():
    for e, sp in _entries_of(g, pos, leaves):
      if sp is None:
        whole.append(e)
      else:
        split.append(e)
        splits.append(sp)
  return split, splits, whole


@dataclasses.dataclass(frozen=True)
class _Gather:
  """Where each owner puts its matrices of the results gathered to every device:
  ``off[e][s]``, the offset of slot ``s`` of entry ``e`` in its owner's row; ``length``,
  the rows' length."""
  off: list
  length: int

  @classmethod
  def make(cls, entries: list, slots: list, lengths: list, devices: int) -> "_Gather":
    fill = [0] * devices
    off = []
    for (sl, n), elems in zip(zip(slots, lengths), entries):
      per = n // devices
      at = [0] * n
      for s in sl:
        o = s // per
        at[s] = fill[o]
        fill[o] += elems
      off.append(at)
    return cls(off, max(max(fill), 1))


def _split_of(x, given: Any, matrix: tuple, mesh) -> Optional[list]:
  """How an array ``(k, ...)`` of one leaf travels: its matrices' split (exchanged), or
  ``None`` (taken whole from its replicated value: scalars per matrix, random words, a
  replicated leaf). ``given``: the leaf's split where known (``[]``: replicated), which
  holds for the arrays of its matrices' shape ``matrix``; elsewhere a guess from the
  shape (:func:`fisher_optax.parallel.owners._matrix_split`)."""
  if x is None or len(x.shape) != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
    return None
  if given is not None and tuple(x.shape[1:]) == tuple(matrix):
    return list(given) or None
  return owners._matrix_split(tuple(x.shape), mesh)


def _scan(mesh, items, groups, out_leaves, splits, replicate, layouts) -> tuple:
  """Per (group, argument position) and per (group, result position), every leaf's
  ``(split, item, k, start)``: how its arrays travel (:func:`_split_of`; results kept
  as state: as ``layouts(args, split)`` says where that splits them over every axis of
  the exchange, :func:`fisher_optax.parallel.owners.covers`), which item it is, its
  stack size and its offset in the group."""
  found_in: dict = {}
  found_out: dict = {}
  for g, members in enumerate(groups):
    start = 0
    for j in members:
      args = items[j]
      k = next(a.shape[0] for a in args if a is not None)
      matrix = next(tuple(a.shape[1:]) for a in args if a is not None)
      given = splits[j] if splits is not None else None
      for pos, x in enumerate(args):
        if x is not None:
          found_in.setdefault((g, pos), []).append(
              (_split_of(x, given, matrix, mesh), j, k, start))
      want = list(layouts(list(args), given)) if replicate and layouts is not None else []
      for r, o in enumerate(out_leaves[g]):
        shape = (k,) + tuple(o.shape[1:])
        if replicate:
          sp = want[r] if r < len(want) else None
          sp = sp if owners.covers(sp, mesh) else None
        else:
          sp = _split_of(jax.ShapeDtypeStruct(shape, o.dtype), given, matrix, mesh)
        found_out.setdefault((g, r), []).append((sp if len(shape) == 3 else None, j, k, start))
      start += k
  return found_in, found_out


@dataclasses.dataclass(frozen=True)
class _Packing:
  """The static tables of one :func:`map_packed` call: ``slots``/``lengths``/``per`` per
  group as :func:`fisher_optax.parallel.owners.placement` gives them; ``real[g][s]``,
  whether slot ``s`` holds a matrix; ``ins`` / ``outs`` / ``kept``: the :class:`_Entry`
  s of the arguments exchanged in, the results exchanged back and the results gathered,
  with their splits and plans; ``local``: the arguments taken from their replicated
  values."""
  mesh: Any
  slots: list
  lengths: list
  per: list
  real: list
  ins: list
  in_splits: list
  outs: list
  out_splits: list
  kept: list
  local: list
  plan_in: Any
  plan_out: Any
  gather: _Gather

  @classmethod
  def make(cls, mesh, items, groups, templates, out_leaves, splits, replicate,
           layouts) -> "_Packing":
    size = owners._mesh_size(mesh)
    ks = [next(a.shape[0] for a in args if a is not None) for args in templates]
    # balance what each owner receives and returns
    weights = [sum(math.prod(a.shape[1:]) for a in args if a is not None)
               + sum(math.prod(o.shape[1:]) for o in leaves)
               for args, leaves in zip(templates, out_leaves)]
    slots, lengths = owners.placement(ks, weights, size)
    real = [[s in held for s in range(n)] for held, n in zip(map(set, slots), lengths)]
    found_in, found_out = _scan(mesh, items, groups, out_leaves, splits, replicate, layouts)
    (ins, in_splits, local), (outs, out_splits, kept) = _sorted(found_in), _sorted(found_out)

    def plan(entries, entry_splits, leaves):
      if not entries:
        return None
      lays = [owners._block_layout((len(e.at),) + tuple(leaves[e.g][e.pos].shape[1:]), sp,
                                   mesh) for e, sp in zip(entries, entry_splits)]
      return owners._ExchangePlan.make(
          mesh, [[slots[e.g][a] for a in e.at] for e in entries],
          [lengths[e.g] for e in entries], lays, lays)

    gather = _Gather.make(
        [math.prod(out_leaves[e.g][e.pos].shape[1:]) for e in kept],
        [[slots[e.g][a] for a in e.at] for e in kept], [lengths[e.g] for e in kept], size)
    return cls(mesh, slots, lengths, [n // size for n in lengths], real, ins, in_splits,
               outs, out_splits, kept, local, plan(ins, in_splits, templates),
               plan(outs, out_splits, out_leaves), gather)

  def mine(self, e: _Entry, me) -> tuple:
    """This owner's slots of group ``e.g``: the index of each in entry ``e``'s matrices
    (clipped) and whether it is one of them (run-time values)."""
    per = self.per[e.g]
    table = [0] * self.lengths[e.g]
    ok = [False] * self.lengths[e.g]
    for i, a in enumerate(e.at):
      s = self.slots[e.g][a]
      table[s], ok[s] = i, True
    at = me * per + jnp.arange(per)
    return jnp.asarray(table, jnp.int32)[at], jnp.asarray(ok)[at]

  def whole(self, given: dict, templates, me, send) -> dict:
    """Inside ``shard_map``: the arguments of this owner's slots, whole, by (group,
    position): exchanged ones put together from the rows of one ``all_to_all``,
    replicated ones taken locally; padding slots hold a copy of the owner's first
    matrix."""
    parts: dict = {}
    if self.plan_in is not None:
      axes = tuple(self.mesh.axis_names)
      got = jax.lax.all_to_all(self.plan_in.rows_to_owners([send(given[e]) for e in self.ins]),
                               axes, 0, 0, tiled=True)  # row d: from device d
      mats = self.plan_in.whole_matrices(
          got, me, [templates[e.g][e.pos].shape[1:] for e in self.ins],
          [templates[e.g][e.pos].dtype for e in self.ins])
      for i, (e, x) in enumerate(zip(self.ins, mats)):
        parts.setdefault((e.g, e.pos), []).append(
            (self.plan_in._mine(i, me, self.plan_in.off_in)[1], x))
    for e in self.local:
      idx, ok = self.mine(e, me)
      parts.setdefault((e.g, e.pos), []).append((ok, given[e][idx]))
    out = {}
    for (g, pos), found in parts.items():
      x = found[0][1]
      for ok, y in found[1:]:
        x = jnp.where(ok.reshape((-1,) + (1,) * (y.ndim - 1)), y, x)
      per = self.per[g]
      real = jnp.asarray(self.real[g])[me * per + jnp.arange(per)]
      out[g, pos] = jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), x, x[:1])
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
    """The results kept whole, per entry, from every owner's packed row (one
    ``all_gather``)."""
    if not self.kept:
      return []
    row = jnp.zeros((self.gather.length,),
                    jnp.result_type(*[results[e.g][e.pos] for e in self.kept]))
    for i, e in enumerate(self.kept):
      _, ok = self.mine(e, me)
      for t in range(self.per[e.g]):
        s = me * self.per[e.g] + t
        put = jax.lax.dynamic_update_slice_in_dim(
            row, results[e.g][e.pos][t].reshape(-1).astype(row.dtype),
            jnp.asarray(self.gather.off[i], jnp.int32)[s], axis=0)
        row = jnp.where(ok[t], put, row)
    rows = jax.lax.all_gather(row, tuple(self.mesh.axis_names), axis=0,
                              tiled=False)  # row o: from owner o
    out = []
    for i, e in enumerate(self.kept):
      shape = out_leaves[e.g][e.pos].shape[1:]
      n, per = math.prod(shape), self.per[e.g]
      out.append(jnp.stack([jax.lax.slice_in_dim(
          rows[s // per], self.gather.off[i][s], self.gather.off[i][s] + n).reshape(shape)
          for s in (self.slots[e.g][a] for a in e.at)]))
    return out


  def step(self, xs, templates, out_leaves, fn, local, send) -> list:
    """Inside ``shard_map``, on every device: the arguments in (``xs``: the exchanged
    entries', then the replicated ones'), each group's function on this owner's slots,
    the results back (exchanged, then gathered)."""
    axes = tuple(self.mesh.axis_names)
    me = jax.lax.axis_index(axes)
    whole = self.whole(dict(zip(self.ins + self.local, xs)), templates, me, send)
    results = []
    for g, args in enumerate(templates):
      mats = [None if a is None else whole[g, pos] for pos, a in enumerate(args)]
      res = self.run(g, lambda mats=mats: jax.tree.leaves(local(fn, *mats)), me)
      results.append([send(r) for r in res])
    back = []
    if self.plan_out is not None:
      back = self.plan_out.blocks_back(jax.lax.all_to_all(
          self.plan_out.rows_back([results[e.g][e.pos] for e in self.outs], me), axes, 0, 0,
          tiled=True))  # row o: from owner o
    blocks = [b.reshape((len(e.at),) + owners._block_layout(
        (len(e.at),) + out_leaves[e.g][e.pos].shape[1:], sp, self.mesh)[0])
        for b, e, sp in zip(back, self.outs, self.out_splits)]
    return blocks + self.gathered(results, out_leaves, me)

def _template(items: list, members: list) -> list:
  """The arguments of one group (``members`` of ``items``) as if concatenated: shapes
  ``(sum of k_i, ...)``, ``None`` where absent."""
  k = sum(next(a.shape[0] for a in items[j] if a is not None) for j in members)
  return [None if a is None else jax.ShapeDtypeStruct((k,) + a.shape[1:], a.dtype)
          for a in items[members[0]]]


def map_packed(fn: Callable[..., Any], items: list, groups: list, local: Callable[..., Any],
               *, splits: Optional[list] = None, replicate: bool = False,
               layouts: Optional[Callable[[list, Any], list]] = None) -> Optional[list]:
  """``local(fn, *args)`` for every ``args`` of ``items`` (arrays ``(k_i, ...)`` or
  ``None``; ``groups``: the items of one shape, lists of indices), each matrix on its
  owner, in one exchange each way; per item, its results (``fn``'s output tree with a
  leading axis ``k_i``); ``None`` where the results cannot travel packed (not floating
  arrays of matrices), for the caller to serve each stack on its own
  (:func:`fisher_optax.parallel.owners.map_whole`).

  ``splits``: per item, the split of its matrices where known
  (:func:`fisher_optax.parallel.owners.view_split`; ``[]``: replicated), for its
  arrays of its matrices' shape (the first argument's), in and out; elsewhere, and
  for ``None``, a guess from the shape (:func:`fisher_optax.parallel.owners._matrix_split`).
  With ``replicate`` (optimizer state) the results come back split as
  ``layouts(args, split)`` says, item by item and result by result, where that splits
  them over every axis of the exchange, and replicated otherwise. Padding slots of an
  owner hold a copy of its first matrix, so that no slot meets a degenerate input; their
  results are never sent."""
  on = owners._ACTIVE.get()
  mesh, send = owners.exchange_mesh(), owners.sender(on.transport_dtype)
  axes = tuple(mesh.axis_names)
  templates = [_template(items, members) for members in groups]
  shapes = [jax.eval_shape(lambda *xs: local(fn, *xs), *args) for args in templates]
  out_leaves = [jax.tree.leaves(s) for s in shapes]
  if any(o.ndim < 2 or not jnp.issubdtype(o.dtype, jnp.floating)
         for leaves in out_leaves for o in leaves):
    return None
  pk = _Packing.make(mesh, items, groups, templates, out_leaves, splits, replicate, layouts)

  def joined(e):  # the leaves of one entry, one stack (they share a split)
    parts = [items[j][e.pos] for j in e.items]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

  res = jax.shard_map(
      lambda *xs: pk.step(xs, templates, out_leaves, fn, local, send),
      in_specs=tuple([owners._entries((len(e.at),) + templates[e.g][e.pos].shape[1:], sp,
                                      axes) for e, sp in zip(pk.ins, pk.in_splits)]
                     + [P()] * len(pk.local)),
      out_specs=([owners._entries((len(e.at),) + out_leaves[e.g][e.pos].shape[1:], sp, axes)
                  for e, sp in zip(pk.outs, pk.out_splits)] + [P()] * len(pk.kept)),
      check_vma=False, **owners._mesh_argument(on.mesh))(
          *[send(joined(e)) for e in pk.ins], *[joined(e) for e in pk.local])
  got = {}
  for e, y in zip(pk.outs + pk.kept, res):  # each entry's stack back to its leaves
    start = 0
    for j, k in zip(e.items, e.ks):
      got[j, e.pos] = y if k == y.shape[0] else jax.lax.slice_in_dim(y, start, start + k)
      start += k
  out = [None] * len(items)
  for g, members in enumerate(groups):
    for j in members:
      out[j] = jax.tree.unflatten(jax.tree.structure(shapes[g]), [
          got[j, r].astype(o.dtype) for r, o in enumerate(out_leaves[g])])
  return out
