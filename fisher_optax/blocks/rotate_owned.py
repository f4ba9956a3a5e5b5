"""The rotation block's state in the owner layout across steps: ``rotate(..., owners=P)``
(or ``owners="auto"``: ``P`` read from the context mesh when the optimizer is built).

Every matrix of the tree with the same canonical size is one stack of the state (``n x m``
matrices transposed into the ``m x n`` stack where the block allows it and that needs
fewer slots: :func:`owned_views`), padded to ``c P`` slots and placed over the devices
(``parallel/owners.py``: ``placement``, ``run_owned``); under the owner layout of a mesh
of ``P`` devices each device keeps its slots and updates them with no collective, the
gradients coming in and the updates going out by one ``all_to_all`` each. The
mathematics is :mod:`fisher_optax.blocks.rotate`'s ``step`` (``rot`` below, the block's
settings), run on each size's stack by itself: the updates are those of ``owners=None``
(for an inner transformation that treats matrices one by one, as Adam does; one that
couples all of them, a global-norm clip say, sees one size at a time). A device that owns
none of a size's matrices runs that size's step on no matrix, so padding costs memory,
not work. Matrices rotated on one side that send less where their shards are
(:func:`in_place`) keep a per-leaf state laid out on their unrotated side. A state of
either layout converts to the other (:func:`to_per_leaf`, :func:`to_owned`, as
``fisher_optax.convert_state_layout`` uses them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import init_records, lifting, validation
from fisher_optax.parallel import owners
from fisher_optax.parallel import slots as slots_lib


class RotateOwnedState(NamedTuple):
  """The state of ``rotate(..., owners=P)``.

  ``owned``: a dict with one entry per canonical matrix size ``"m x n"``, the
  :class:`RotateState` of a stack over every matrix of that size in the tree, padded
  to a multiple of ``P`` (``parallel/owners.py``, ``placement``); under the owner
  layout each device keeps and updates its slice of every stack, and a device that
  owns none of a size's matrices does no work for it. ``local``: a
  :class:`RotateLocalState` of the leaves rotated where their shards are (one side
  rotated, and that side at most ``1/P`` of the other or the matrix above a device's
  share: the all-reduce of its ``d x d`` statistics sends less than moving the matrix),
  the other leaves ``None``. ``load``: the numbers each of the ``P`` devices owns
  (``int32 (P,)``, the placement's balance; its length is the device count the stacks
  are padded for, which the updates read)."""
  owned: Any  # {"m x n": RotateState}
  local: "RotateLocalState"
  load: jax.Array
  # roles for parallel/sharding.py: the owned stacks are split over the mesh on their
  # leading axis
  SHARDING = {"owned": "owners", "load": "replicated"}


class RotateLocalState(NamedTuple):
  """:class:`RotateState` of the leaves ``rotate(..., owners=P)`` rotates where their
  shards are: the ``d x d`` statistics and bases whole on every device, the moments
  split on the matrices' larger (unrotated) side over every mesh axis."""
  count: jax.Array
  left: Any  # RotateSideState
  right: Any
  inner_state: optax.OptState
  SHARDING = {"left": "replicated", "right": "replicated", "inner_state": "spread"}


def in_place(rot, lifted, devices: int) -> list:
  """Per leaf, whether ``owners=P`` rotates it where its shards are: one side rotated
  (size ``d``, the other ``e``, which ``P`` divides) and either ``d P <= e`` or a
  matrix larger than a device's share ``1/P`` of all the rotated matrices. Its ``d x d``
  statistics' all-reduce then sends less than moving it: ``2 d^2`` against ``2 d e / P`` for an
  owner, and a matrix above a device's share sets the length of every device's
  exchange (``parallel/owners.py``, ``run_owned``), so it alone would cost each device
  about twice its size."""
  sizes = [v.num_matrices * v.m * v.n for v in lifted.views]
  share = sum(sizes) / devices
  out = []
  for v, size in zip(lifted.views, sizes):
    left, right = rot.active(v)
    d, e = (v.m, v.n) if left else (v.n, v.m)
    out.append(left != right and e % devices == 0
               and (d * devices <= e or size / v.num_matrices > share))
  return out


def owned_views(rot, lifted, devices: int) -> list:
  """Per leaf, the view its matrices take in the owned stacks: its own, or its transpose
  where ``rot`` commutes with transposing (``transposable``, both sides rotated) and
  the ``n x m`` matrices (``n > m``) then join the ``m x n`` ones in one stack that
  needs fewer slots per device than the two: ``ceil((a + b) / P) < ceil(a / P) +
  ceil(b / P)`` for ``a`` and ``b`` matrices. The LLaMA 60M's 16 ``512 x 1376`` and 8
  ``1376 x 512`` MLP matrices on 32 devices take one slot per device instead of two
  (SOAP's state per device 0.27x -> 0.17x of the parameter bytes, Shampoo's 0.19x ->
  0.12x); on 8 devices, 3 either way, they stay apart (one stack of three slots
  needed more temporary memory: Shampoo's update 0.16x -> 0.22x). The updates are the
  same in exact arithmetic; in float32 a transposed matrix sums its statistics in
  another order, which matters where a statistic is singular (a non-square matrix's
  larger side after one step): the basis of its null space follows the rounding, as it
  does between any two layouts that sum in different orders."""
  views = list(lifted.views)
  if not (rot.sides == "both" and rot.transposable):
    return views
  owned = [not h for h in in_place(rot, lifted, devices)]
  counts: dict = {}
  for v, o in zip(views, owned):
    if o:
      counts[v.m, v.n] = counts.get((v.m, v.n), 0) + v.num_matrices
  slots = lambda k: -(-k // devices)  # noqa: E731
  tall = {(m, n) for (m, n), a in counts.items() if m > n and (n, m) in counts
          and slots(a + counts[n, m]) < slots(a) + slots(counts[n, m])}
  return [dataclasses.replace(v, transpose=not v.transpose) if o and (v.m, v.n) in tall
          else v for v, o in zip(views, owned)]


def size_groups(rot, lifted, devices: int) -> dict:
  """``{"m x n": [leaf indices]}``: the leaves whose matrices go to owners, by their size
  in the owned stacks (:func:`owned_views`)."""
  groups: dict = {}
  here = in_place(rot, lifted, devices)
  for i, (v, h) in enumerate(zip(owned_views(rot, lifted, devices), here)):
    if not h:
      groups.setdefault(f"{v.m}x{v.n}", []).append(i)
  return groups


def local_tree(rot, tree, lifted, devices: int):
  """``tree`` with the leaves that go to owners replaced by ``None``."""
  here = in_place(rot, lifted, devices)
  return lifted.unflatten([x if h else None for x, h in zip(lifted.leaves, here)])


def owned_plan(rot, lifted, devices: int) -> tuple:
  """The owned groups' keys (sorted), members, slots, stack lengths and each device's
  load (``parallel/owners.py``, ``placement``), from the shapes alone."""
  groups = size_groups(rot, lifted, devices)
  keys = sorted(groups)
  counts = [sum(lifted.views[i].num_matrices for i in groups[k]) for k in keys]
  sizes = [lifted.views[groups[k][0]].m * lifted.views[groups[k][0]].n for k in keys]
  slots, lengths = owners.placement(counts, sizes, devices)
  return keys, groups, slots, lengths, owners.device_load(slots, lengths, sizes, devices)


def resolve(setting) -> tuple:
  """``rotate``'s ``owners`` as ``(P or None, whether P came from the context mesh)``:
  ``"auto"`` reads the context mesh when the optimizer is built
  (``parallel/owners.py``, ``build_devices``); anything else must be ``None`` or a
  positive count."""
  if isinstance(setting, str) and setting == owners.AUTO:
    return owners.build_devices(), True
  validation.check_int("owners", setting, low=1, allow_none=True)
  return setting, False


def devices_for(rot, params):
  """The device count ``init`` lays the state out for (``None``: per leaf, as
  ``owners=None``): ``owners``, except where it came from the context mesh
  (``owners="auto"``) and ``init`` sees the parameters replicated over that mesh's
  ``Explicit`` axes (``parallel/owners.py``, ``visibly_replicated``)."""
  if rot.owners_from_context and owners.visibly_replicated(params):
    return None
  return rot.owners


def init(rot, params):
  """The owned stacks (:func:`owned_plan`) and the per-leaf state of the others; the
  per-leaf state of ``owners=None`` where :func:`devices_for` says so."""
  devices = devices_for(rot, params)
  if devices is None:
    return rot.init(params)
  lifted = rot.lift(params)
  keys, groups, _, lengths, load = owned_plan(rot, lifted, devices)
  owned = {}
  views = owned_views(rot, lifted, devices)
  for key, n in zip(keys, lengths):
    v = views[groups[key][0]]
    stack = {key: jax.ShapeDtypeStruct((n, v.m, v.n), jnp.float32)}
    owned[key] = rot.init_lifted(lifting.Lifted(stack, None, what="rotate"))
  return RotateOwnedState(
      owned=owned,
      local=RotateLocalState(*rot.init(local_tree(rot, params, lifted, devices))),
      load=jnp.asarray(load, jnp.int32))


def update(rot, updates, state, params=None):
  """The owned stacks' step on their owners (``run_owned``), the others' where their
  shards are; the updates in the leaves' layouts. The state's ``load`` says the device
  count it is padded for; a per-leaf state (:func:`devices_for`) takes the per-leaf
  update of ``owners=None``."""
  if not isinstance(state, RotateOwnedState):
    return rot.update(updates, state, params)
  del params
  devices = state.load.shape[0]  # the state says which device count it is laid out for
  lifted = rot.lift(updates, canonical=True)
  keys, groups, slots, lengths, _ = owned_plan(rot, lifted, devices)
  views = owned_views(rot, lifted, devices)
  turned = [v.transpose != w.transpose for v, w in zip(lifted.views, views)]
  held = [jnp.swapaxes(g, -1, -2) if t else g for g, t in zip(lifted.canonical_grads, turned)]
  flat = [g.reshape((-1,) + g.shape[-2:]) for g in held]
  moved = [[flat[i] for i in groups[key]] for key in keys]
  leaf_splits = _splits(lifted, turned)

  def body(g, stack, st):  # the matrices of one size, with their state
    out, st = rot.step(lifting.Lifted({keys[g]: stack}, None, what="rotate",
                                      canonical=True), st)
    return out[0], st

  outs, owned = owners.run_owned(body, moved, [state.owned[k] for k in keys], slots,
                                 lengths, [[leaf_splits[i] for i in groups[key]]
                                           for key in keys])
  owned = dict(zip(keys, owned))
  res: list = [None] * len(flat)
  for key, out in zip(keys, outs):
    for i, part in zip(groups[key], out):
      part = part.reshape(held[i].shape)
      res[i] = jnp.swapaxes(part, -1, -2) if turned[i] else part
  here = rot.lift(local_tree(rot, updates, lifted, devices), canonical=True)
  # on the unrotated side over every device: the statistics' products end in one
  # all-reduce of d x d, and the rotations and the refresh are local
  # the parameter's own mesh axes on that side first, where the update knows them, as
  # fo.state_shardings lays out the state then
  first = owners.parameter_axes_first()
  majors = [owners.spread_major(g.shape, p) if first else ()
            for g, p in zip(here.canonical_grads, here.param_specs)]
  here.canonical_grads = [owners.spread(g, m) for g, m in zip(here.canonical_grads, majors)]
  with owners.using(None):
    out_here, local = rot.step(here, state.local)
  out_here = [owners.spread(o, m) for o, m in zip(out_here, majors)]
  mine = iter(out_here)
  res = [next(mine) if r is None else r for r in res]
  return lifted.to_leaves(res), RotateOwnedState(owned=owned, local=local, load=state.load)


def _splits(lifted, turned: list) -> list:
  """Per leaf, how its matrices are split as the owned stacks hold them: where a leaf is
  held transposed (``turned``), the transpose of its split where known, else of the
  split guessed for it as the leaf is (``parallel/owners.py``, ``guessed_split``), as it
  was guessed in a stack of its own: a ``32 x 16`` matrix split ``4 x 2`` is not one
  ``16 x 32`` split so."""
  splits = lifted.splits
  if owners.active() is None:
    return splits
  return [owners.transposed_split(owners.guessed_split((1, v.m, v.n)) if sp is None else sp)
          if t else sp for sp, v, t in zip(splits, lifted.views, turned)]


def transformation(rot) -> optax.GradientTransformation:
  """``rotate``'s transformation for its settings ``rot`` with ``owners`` set."""
  return optax.GradientTransformation(lambda params: init(rot, params),
                                      lambda u, s, p=None: update(rot, u, s, p))


# ------------------------------------------------- conversion to and from the per-leaf state

_INITS = init_records.Records()


def recording():
  """Within the block, every rotation's ``init`` appends ``(rot, tree)``, its settings
  and the shapes of the tree it was given, to the yielded list: what
  ``fisher_optax.convert_state_layout`` needs to take its state apart."""
  return _INITS.recording()


def recorded(tx: optax.GradientTransformation, rot) -> optax.GradientTransformation:
  """``tx`` (a rotation's transformation, ``rot`` its settings), its ``init`` recorded
  within :func:`recording`."""
  def init_fn(params):
    _INITS.add(lambda: (rot, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)))
    return tx.init(params)
  return optax.GradientTransformation(init_fn, tx.update)


class _Layout(NamedTuple):
  lifted: Any
  keys: list
  groups: dict
  slots: list
  lengths: list
  load: list
  views: list  # as the stacks hold the leaves
  turned: list  # per leaf: held transposed in its stack
  here: list
  where: dict
  local_def: Any


def _layout(rot, tree, devices: int) -> _Layout:
  lifted = rot.lift(tree)
  keys, groups, slot_lists, lengths, load = owned_plan(rot, lifted, devices)
  views = owned_views(rot, lifted, devices)
  return _Layout(lifted, keys, groups, slot_lists, lengths, load, views,
                 [v.transpose != w.transpose for v, w in zip(lifted.views, views)],
                 in_place(rot, lifted, devices),
                 slots_lib.member_slots(groups, keys, slot_lists,
                                        [v.num_matrices for v in lifted.views]),
                 jax.tree.structure(local_tree(rot, tree, lifted, devices)))


def _flip(x, turned: bool, m: int, n: int):
  """A turned member's moment ``(..., m, n)`` in its stack's orientation, or back."""
  if not turned or jnp.ndim(x) < 3 or m == n:
    return x
  if tuple(jnp.shape(x)[-2:]) not in ((m, n), (n, m)):
    raise ValueError(f"a state array of shape {jnp.shape(x)} of a matrix held transposed "
                     f"({m} x {n}) that is not one of its moments")
  return jnp.swapaxes(x, -1, -2)


def to_per_leaf(rot, state: RotateOwnedState, tree) -> Any:
  """The per-leaf state of ``owners=None`` (``rot.init(tree)``'s structure) from a state
  kept on the owners: each moved matrix's statistics, bases and moments taken from its
  slot (a matrix held transposed in its stack gets its sides swapped back and its moments
  transposed), the others and the counter from where they are. ``tree``: the parameters
  the block's ``init`` was given (shapes suffice)."""
  from fisher_optax.blocks.rotate import RotateSideState, RotateState
  lay = _layout(rot, tree, state.load.shape[0])
  if lay.keys != sorted(state.owned):
    raise ValueError(f"stacks {sorted(state.owned)} in the state, {lay.keys} for these "
                     "parameters")
  treedef, other = lay.lifted.treedef, {"left": "right", "right": "left"}

  def rows(x, i, flip=False):
    v = lay.views[i]
    r = _flip(x[jnp.asarray(lay.where[i][1], jnp.int32)], flip, v.m, v.n)
    return r.reshape(lay.lifted.views[i].batch_shape + r.shape[1:])

  def side(s):
    def field(f):
      def member(i, _):
        k = lay.keys[lay.where[i][0]]
        x = getattr(getattr(state.owned[k], other[s] if lay.turned[i] else s), f)[k]
        return None if x is None else rows(x, i)
      return slots_lib.to_leaves(getattr(getattr(state.local, s), f),
                                 [getattr(getattr(state.owned[k], s), f) for k in lay.keys],
                                 lay.keys, treedef, lay.local_def, lay.here, member)
    return RotateSideState(*[field(f) for f in RotateSideState._fields])

  def inner_member(i, owned):
    g = lay.where[i][0]
    return jax.tree.map(lambda x: rows(x, i, lay.turned[i]), owned[g][lay.keys[g]])

  inner = slots_lib.to_leaves(state.local.inner_state,
                              [state.owned[k].inner_state for k in lay.keys], lay.keys,
                              treedef, lay.local_def, lay.here, inner_member)
  return RotateState(count=state.local.count, left=side("left"), right=side("right"),
                     inner_state=inner)


def to_owned(rot, state: Any, tree, devices: int) -> RotateOwnedState:
  """The inverse of :func:`to_per_leaf`: a per-leaf state brought to the owners of
  ``devices`` devices, each moved matrix's state put in its slot, padding slots as
  ``init`` leaves them."""
  lay = _layout(rot, tree, devices)
  treedef, other = lay.lifted.treedef, {"left": "right", "right": "left"}
  template = {}
  for k, n in zip(lay.keys, lay.lengths):
    v = lay.views[lay.groups[k][0]]
    stack = {k: jax.ShapeDtypeStruct((n, v.m, v.n), jnp.float32)}
    template[k] = rot.init_lifted(lifting.Lifted(stack, None, what="rotate"))

  def put(g, t, xs, members, moments=True):
    rows = [_flip(jnp.reshape(x, (lay.lifted.views[i].num_matrices,)
                              + jnp.shape(x)[len(lay.lifted.views[i].batch_shape):]),
                  moments and lay.turned[i], lay.views[i].m, lay.views[i].n)
            for i, x in zip(members, xs)]
    rows = jnp.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]
    return t.at[jnp.asarray(lay.slots[g], jnp.int32)].set(rows.astype(t.dtype))

  sides = {}
  for s in ("left", "right"):
    local_f, owned_f = [], {k: [] for k in lay.keys}
    for f in type(state.left)._fields:
      per = {d: treedef.flatten_up_to(getattr(getattr(state, d), f)) for d in other}
      local_f.append(lay.local_def.unflatten([e for e, h in zip(per[s], lay.here) if h]))
      for g, k in enumerate(lay.keys):
        t = getattr(getattr(template[k], s), f)[k]
        members = lay.groups[k]
        xs = [per[other[s] if lay.turned[i] else s][i] for i in members]
        owned_f[k].append({k: None if t is None else put(g, t, xs, members, False)})
    sides[s] = (local_f, owned_f)

  def stack(g, t, entries):
    members = lay.groups[lay.keys[g]]
    return jax.tree.map(lambda t, *xs: put(g, t, xs, members), t,
                        *[entries[i] for i in members])

  local_inner, owned_inner = slots_lib.to_slots(
      state.inner_state, [template[k].inner_state for k in lay.keys], lay.keys, treedef,
      lay.local_def, lay.here, stack)
  side_state = type(state.left)
  owned = {k: type(state)(count=jnp.array(state.count, copy=True),  # a buffer of its own
                          left=side_state(*sides["left"][1][k]),
                          right=side_state(*sides["right"][1][k]), inner_state=inner)
           for k, inner in zip(lay.keys, owned_inner)}
  local = RotateLocalState(count=state.count, left=side_state(*sides["left"][0]),
                           right=side_state(*sides["right"][0]), inner_state=local_inner)
  return RotateOwnedState(owned=owned, local=local, load=jnp.asarray(lay.load, jnp.int32))
