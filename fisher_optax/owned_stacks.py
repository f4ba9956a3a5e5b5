"""A matrix transformation's whole state on the matrices' owner devices across steps.

:func:`owned_stacks` runs a chain of matrix blocks (the low-rank family's tracking, the
optimizer on the coefficients, compensation) on stacks of same-size matrices kept in the
owner layout of a mesh of ``P`` devices (:mod:`fisher_optax.parallel.owners`:
``placement``, ``run_owned``): every matrix of the tree with the same sides is one
stack, its smaller side first (an ``n x m`` matrix held transposed, as the low-rank
blocks hold it: they work on the smaller side), padded to ``c P`` slots; each device
keeps the state of its slots, the gradients come to their owners and the updates go
back by one ``all_to_all`` each, and the chain's mathematics, refreshes included, runs
on whole local matrices with no collective. Each device then sends about ``2/P`` of the
moved matrices' bytes per update, where on the parameters' layout a low-rank method
sums ``U^T G`` over a split side at every step, or moves the gradient to its columns and
gathers its basis ``U`` (``m r`` values per matrix and device, whatever ``P``).

The matrices that move are those split on their smaller side, where a low-rank method's
update communicates at every step, up to the size where a model of what each way sends
says moving costs more (:func:`_moving_sizes`: a matrix far above a device's share would
alone set the length of every device's exchange); the others stay where their shards are,
their state laid out as the parameters, as without this layout. The split is the one
given when the optimizer is built, else the one ``init`` reads from the parameters' types
(``Explicit`` axes) or from the boxes they come in (``Auto`` axes), else, where allowed,
a guess from the shapes.

Per matrix the update is the chain's (its blocks map their per-matrix equations over a
stack), random draws included: each matrix keeps the index its draws are named by
(:mod:`fisher_optax.rng`, its place in the tree), wherever its slot is. What changes is
the state's layout. Padding slots hold zero matrices, which every block takes as a zero
gradient. A state of either layout converts to the other (:func:`to_per_leaf`,
:func:`to_owned`, as ``fisher_optax.convert_state_layout`` uses them).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from fisher_optax import lifting, matrices, model_dims, rng
from fisher_optax.parallel import owners, slots


class OwnedStacksState(NamedTuple):
  """The state of ``fisher_optax.owned_stacks`` (the low-rank family's state on the
  owners).

  ``owned``: one entry per matrix size ``"m x n"`` (``m <= n``), the blocks' state
  over a stack of ``c P`` slots (``parallel/owners.py``, ``placement``), split over the
  mesh on its leading axis (role ``owners``). ``local``: the blocks' state of the
  leaves that stay where their shards are (the others ``None``), laid out as the
  parameters. ``tail``: the state of the transformations after the blocks (decay, the
  step size). ``load``: the elements each of the ``P`` devices owns (``int32 (P,)``);
  its length is the device count the stacks are padded for, which the update reads, so
  a state restored onto another mesh continues in its own layout."""
  owned: Any
  local: Any
  tail: Any
  load: jax.Array
  SHARDING = {"owned": "owners", "load": "replicated"}  # roles for parallel/sharding.py


class _Plan(NamedTuple):
  leaves: list
  treedef: Any
  views: list
  here: list  # per leaf: stays where its shards are
  keys: list  # the owned groups, sorted
  groups: dict  # key -> member leaf indices
  slots: list
  lengths: list
  load: list


def _key(view: matrices.MatrixView) -> str:
  """The group of a leaf's matrices: ``"m x n"``, the smaller side first."""
  return f"{min(view.fan_in, view.fan_out)}x{max(view.fan_in, view.fan_out)}"


def _turned(view: matrices.MatrixView) -> bool:
  """Whether the stacks hold the leaf's matrices transposed (its rows the larger side)."""
  return view.fan_in > view.fan_out


def _plan(tree: Any, dims: matrices.DimsSpec, devices: int, moving,
          rank: Optional[int] = None, summed: float = 3.0) -> _Plan:
  """The groups of ``tree``'s matrices by size and the placement of those that move:
  ``moving`` names their groups (a state's ``owned`` keys), or gives per leaf the
  devices over its sides where its smaller side is split (:func:`_split_smaller`), from
  which :func:`_moving_sizes` chooses."""
  leaves, treedef = jax.tree.flatten(tree)
  dims_leaves = treedef.flatten_up_to(model_dims.resolve_dims(dims, tree))
  views = [matrices.matrix_view(jnp.shape(x), d, what="owned_stacks")
           for x, d in zip(leaves, dims_leaves)]
  if not isinstance(moving, (set, frozenset)):
    moving = _moving_sizes(views, moving, devices, rank, summed)
  here = [_key(v) not in moving for v in views]
  groups: dict = {}
  for i, (v, h) in enumerate(zip(views, here)):
    if not h:
      groups.setdefault(_key(v), []).append(i)
  keys = sorted(groups)
  counts = [sum(views[i].num_matrices for i in groups[k]) for k in keys]
  per = [views[groups[k][0]].fan_in * views[groups[k][0]].fan_out for k in keys]
  slots, lengths = owners.placement(counts, per, devices)
  return _Plan(leaves, treedef, views, here, keys, groups, slots, lengths,
               owners.device_load(slots, lengths, per, devices))


def _moving_sizes(views: list, splits: list, devices: int, rank: Optional[int],
                  summed: float = 3.0) -> set:
  """The sizes whose matrices move: of those split on their smaller side (``splits``:
  per leaf ``(R, C)``, the devices over its smaller and its larger side, ``None`` where
  the smaller side is whole: a low-rank update then sends nothing for it), the smallest
  ones up to the threshold that sends least by the model below.

  Moved, the matrices make one exchange each way whose rows are as long as the most one
  device owns, ``L`` (``parallel/owners.py``, ``placement``): ``2 L (P - 1) / P``
  values per device. Left where their shards are, an ``m x n`` matrix (``m <= n``, rank
  ``r``) sends what the cheaper of a low-rank update's two ways sends
  (``parallel/owners.py``, ``relay_split``), each over rings of ``R`` devices
  (``(R - 1) / R`` of it): ``U^T G`` summed and scattered and the coefficients gathered,
  ``summed r n / C`` (``summed``: 2 for GaLore, 3 where ``sigma`` is gathered again, as
  ``relay_split`` counts it), or the gradient moved to its columns and back and the
  basis gathered, ``2 m n / (R C) + m r``. A matrix far above a device's share (the
  embedding and output layer of a small model) would alone set ``L`` and stays.

  Against the programs XLA compiled (the LLaMA example's shapes, split given, CPU
  devices), the model errs on the side of moving under tensor parallelism: at ``tiny``
  under FSDP 4 x TP 2 it puts what GaLore sends where its shards are at 0.19x of the
  parameter bytes, measured 0.14x; so GaLore keeps its layout there, which sends the
  least, and Fira, Alice and Alice-0 move their layers' matrices, which sends less
  than they did before."""
  cand: dict = {}
  for v, sp in zip(views, splits):
    if sp is None:
      continue
    m, n = sorted((v.fan_in, v.fan_out))
    r = m if rank is None else min(rank, m)
    big, small = sp
    stay = (min(summed * r * n / small, 2 * m * n / (big * small) + m * r)
            * (big - 1) / big * v.num_matrices)
    size, count, cost = cand.get(_key(v), (m * n, 0, 0.0))
    cand[_key(v)] = (size, count + v.num_matrices, cost + stay)
  order = sorted(cand, key=lambda k: cand[k][0])
  best, best_cost = 0, sum(c for _, _, c in cand.values())
  for t in range(1, len(order) + 1):
    moved = order[:t]
    sizes = [cand[k][0] for k in moved]
    load = owners.device_load(*owners.placement([cand[k][1] for k in moved], sizes, devices),
                              sizes, devices)
    cost = (2 * max(load) * (devices - 1) / devices
            + sum(cand[k][2] for k in order[t:]))
    if cost < best_cost:
      best, best_cost = t, cost
  return set(order[:best])


def _split_smaller(view: matrices.MatrixView, spec: Optional[P], devices: int,
                   sizes: Optional[dict], mesh: Any = None) -> Optional[tuple]:
  """``(R, C)``: the devices over a leaf's smaller side (either side of a square one) and
  over its larger side, where the smaller side is split; else ``None``. Read from
  ``spec`` (mesh axes of size one split nothing; an axis of unknown size, where
  ``sizes`` does not give the mesh's, counts as ``P``), else guessed as the owner layout
  guesses it on ``mesh`` (``parallel/owners.py``, ``_matrix_split``: FSDP's split on a
  mesh of one axis, Megatron's on one of several), or without one as FSDP over
  ``devices`` splits it (the larger side where the devices divide it, else the
  other)."""
  small, large = sorted((view.fan_in, view.fan_out))
  if spec is None:
    guess = None if mesh is None else owners._matrix_split((1, view.fan_in, view.fan_out),
                                                           mesh)
    if guess is None:
      if small == large or large % devices:
        return (devices, 1) if small % devices == 0 else None
      return None
    names = {1: [], 2: []}
    for a, name in guess:
      names[a].append(name)
    spec = P(tuple(names[1]) or None, tuple(names[2]) or None)
    view = matrices.matrix_view((view.fan_in, view.fan_out), None, what="owned_stacks")
  entries = list(spec) + [None] * (len(view.shape) - len(spec))

  def split(axes) -> int:
    names = [n for a in axes if entries[a] is not None
             for n in (entries[a] if isinstance(entries[a], tuple) else (entries[a],))]
    count = 1
    for name in names:
      count *= devices if sizes is None else sizes.get(name, devices)
    return count

  rows, cols = split(view.rows), split(view.cols)
  if view.fan_in == view.fan_out:
    rows, cols = max(rows, cols), min(rows, cols)
  elif view.fan_in > view.fan_out:
    rows, cols = cols, rows
  return (rows, cols) if rows > 1 else None


def _local(p: _Plan, leaves: Optional[list] = None) -> Any:
  """The tree with the moved leaves replaced by ``None``."""
  leaves = p.leaves if leaves is None else leaves
  return p.treedef.unflatten([x if h else None for x, h in zip(leaves, p.here)])


def _stack_part(state: Any, length: int) -> tuple:
  """The leaves of a group's state that the owners keep (scalars, and arrays whose
  leading axis is the group's slots), and the others (constants such as a PRNG key),
  which every device holds whole."""
  leaves, treedef = jax.tree.flatten(state)
  kept = [jnp.ndim(x) == 0 or jnp.shape(x)[0] == length for x in leaves]
  return leaves, treedef, kept


def _slot_indices(p: _Plan, g: int, firsts: list) -> jax.Array:
  """Per slot of group ``g``'s stack, the tree-wide index of the matrix it holds (leaves
  in order, stacks flattened: the index its random draws are named by,
  :mod:`fisher_optax.rng`); padding slots get indices past the tree's."""
  members = [firsts[i] + j for i in p.groups[p.keys[g]]
             for j in range(p.views[i].num_matrices)]
  table = list(range(firsts[-1], firsts[-1] + p.lengths[g]))
  for slot, index in zip(p.slots[g], members):
    table[slot] = index
  return jnp.asarray(table, jnp.uint32)


def _init_splits(params: Any, dims: matrices.DimsSpec, devices: int, given: dict,
                 sizes: Optional[dict], mesh: Any) -> list:
  """Per leaf of ``params``, :func:`_split_smaller` from the specs known (``given``,
  ``{path: PartitionSpec}``), else the split guessed on ``mesh``."""
  leaves, treedef = jax.tree.flatten(params)
  views = [matrices.matrix_view(jnp.shape(x), d, what="owned_stacks") for x, d in zip(
      leaves, treedef.flatten_up_to(model_dims.resolve_dims(dims, params)))]
  return [_split_smaller(v, given.get(k), devices, sizes, mesh)
          for v, k in zip(views, owners.leaf_keys(params))]


def _known_specs(params: Any, param_specs: Any, guess: bool, mesh: Any,
                 learned: list) -> Optional[dict]:
  """``{path: PartitionSpec}`` of the split ``init`` knows: as given when the optimizer
  was built, else as the parameters' types show it on ``Explicit`` axes; else, where it
  may be guessed, ``{}`` (:func:`_split_smaller` guesses each leaf); else as the boxes
  the parameters came in name it on ``mesh``, recorded in ``learned`` for later inits of
  plain arrays (a leaf they did not name is whole: it stays, never guessed); else
  ``None``."""
  specs = owners.typed_specs(params) if param_specs is None else param_specs
  if specs is not None:
    return owners.path_specs(specs)
  if guess:
    return {}
  boxed = owners.boxed_specs(params, mesh)
  if boxed is not None:
    learned[:] = [owners.path_specs(boxed)]
  if not learned:
    return None
  return {k: learned[0].get(k, P()) for k in owners.leaf_keys(params)}


def _to_stacks(p: _Plan, specs: list) -> tuple:
  """Per owned group, its members' matrices ``(k, m, n)`` (smaller side first) in the
  members' promoted dtype (bfloat16 and float32 matrices of a size travel as float32,
  and come back in each leaf's own dtype); per leaf, the split of those matrices
  where known (``parallel/owners.py``, ``view_split``)."""
  canonical = [v.to_canonical(x).reshape((v.num_matrices, v.fan_in, v.fan_out))
               for x, v in zip(p.leaves, p.views)]
  canonical = [jnp.swapaxes(x, -1, -2) if _turned(v) else x
               for x, v in zip(canonical, p.views)]
  splits = [owners.view_split(v, s) for v, s in zip(p.views, specs)]
  splits = [owners.transposed_split(sp) if _turned(v) else sp
            for sp, v in zip(splits, p.views)]
  moved = [[canonical[i] for i in p.groups[k]] for k in p.keys]
  return [[x.astype(jnp.result_type(*xs)) for x in xs] for xs in moved], splits


def _from_stacks(p: _Plan, outs: list) -> list:
  """Per leaf, its moved matrices' updates (``outs``: per group, per member) in the
  leaf's layout and dtype; ``None`` for the leaves that stay."""
  res: list = [None] * len(p.leaves)
  for k, out in zip(p.keys, outs):
    for i, part in zip(p.groups[k], out):
      v = p.views[i]
      part = jnp.swapaxes(part, -1, -2) if _turned(v) else part
      part = v.from_canonical(part.reshape(v.batch_shape + (v.fan_in, v.fan_out)))
      res[i] = lifting.cast_like(part, p.leaves[i].dtype)
  return res


def _merged(part: tuple, new: list) -> Any:
  """A group's state from :func:`_stack_part`'s ``part`` with its kept leaves ``new``."""
  leaves, treedef, kept = part
  mine = iter(new)
  return treedef.unflatten([next(mine) if k else x for x, k in zip(leaves, kept)])


def _owner_body(stacked, p: _Plan, parts: list, tables: list, extra: dict):
  """``parallel/owners.py``'s ``run_owned`` body: the blocks (``stacked``) on one size's
  matrices on their owners, each matrix drawing as its index in the tree says
  (``tables``, :func:`_slot_indices`); the state's constants (a PRNG key) taken whole
  from the old state."""
  def body(g, stack, kept_leaves):
    leaves, _, kept = parts[g]
    at = owners.running_slots()
    ids = tables[g] if at is None else tables[g][at]
    with rng.indexed([ids[:stack.shape[0]]]):  # each matrix keeps its draws
      out, st = stacked.update({p.keys[g]: stack}, _merged(parts[g], kept_leaves), **extra)
    new = jax.tree.leaves(st)
    for x, old, k in zip(new, leaves, kept):
      if not k and x is not old:
        raise NotImplementedError(
            "owned_stacks: the chain changes a state array that is not per matrix "
            f"(shape {jnp.shape(old)}), which the owners cannot keep.")
    return out[p.keys[g]], [x for x, k in zip(new, kept) if k]

  return body


def _where(p: _Plan) -> dict:
  """Per moved leaf, its group and its matrices' slots (``parallel/slots.py``)."""
  return slots.member_slots(p.groups, p.keys, p.slots, [v.num_matrices for v in p.views])


def to_per_leaf(state: OwnedStacksState, tree: Any, dims: matrices.DimsSpec) -> tuple:
  """A state kept on the owners laid out as the parameters: the structure
  :func:`owned_stacks` gives where no matrix moves (``optax.chain(*blocks(dims), *tail)``
  over ``tree``). Each moved matrix's statistics are taken from its slot (a leaf of ``b``
  matrices gets its ``b`` slots, reshaped to its batch axes), the others and the counters,
  keys and ``tail`` from where they are; padding slots are dropped. ``tree``: the
  parameters the optimizer was initialised with (shapes suffice), ``dims`` their matrix
  axes. Used by ``fisher_optax.convert_state_layout``."""
  p = _plan(tree, dims, state.load.shape[0], frozenset(state.owned))
  if p.keys != sorted(state.owned):
    raise ValueError(f"stacks {sorted(state.owned)} in the state, {p.keys} for these "
                     "parameters")
  where = _where(p)

  def member(i, owned):
    g, at = where[i]
    take, batch = jnp.asarray(at, jnp.int32), p.views[i].batch_shape
    return jax.tree.map(lambda x: x[take].reshape(batch + x.shape[1:]), owned[g][p.keys[g]])

  blocks = slots.to_leaves(state.local, [state.owned[k] for k in p.keys], p.keys, p.treedef,
                           jax.tree.structure(_local(p)), p.here, member)
  return tuple(blocks) + tuple(state.tail)


def to_owned(state: tuple, template: OwnedStacksState, tree: Any,
             dims: matrices.DimsSpec) -> OwnedStacksState:
  """The inverse of :func:`to_per_leaf`: a state laid out as the parameters brought to
  the owners' layout of ``template`` (the abstract state, ``jax.eval_shape`` of the
  target optimizer's ``init``), each moved matrix's statistics put in its slot, padding
  slots zero (as ``init`` leaves them), the counters and keys copied."""
  p = _plan(tree, dims, template.load.shape[0], frozenset(template.owned))
  blocks, tail = tuple(state[:len(template.local)]), tuple(state[len(template.local):])

  def stack(g, t, entries):
    members, put = p.groups[p.keys[g]], jnp.asarray(p.slots[g], jnp.int32)

    def one(t, *xs):
      rows = jnp.concatenate([jnp.reshape(x, (p.views[i].num_matrices,) + t.shape[1:])
                              for i, x in zip(members, xs)], axis=0)
      return jnp.zeros(t.shape, t.dtype).at[put].set(rows.astype(t.dtype))

    return jax.tree.map(one, t, *[entries[i] for i in members])

  local, owned = slots.to_slots(blocks, [template.owned[k] for k in p.keys], p.keys,
                                p.treedef, jax.tree.structure(_local(p)), p.here, stack)
  return OwnedStacksState(owned=dict(zip(p.keys, owned)), local=local, tail=tail,
                          load=jnp.asarray(p.load, jnp.int32))


def owned_stacks(blocks: Callable[[matrices.DimsSpec], list], *, tail: list = (),
                 devices: int, dims: matrices.DimsSpec = None, param_specs: Any = None,
                 mesh: Any = None, rank: Optional[int] = None, summed: float = 3.0,
                 asked: bool = True, guess: bool = True
                 ) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(*blocks(dims), *tail)`` with the blocks' state on the owners of
  ``devices`` devices (module docstring).

  Args:
    blocks: the blocks for matrix axes ``dims``: called with ``None`` for the owned
      stacks ``(c P, m, n)`` and with the leaves' own ``dims`` for the leaves that stay
      where their shards are. Matrix blocks that treat matrices one by one, work on
      their smaller side and need no parameters.
    tail: transformations after the blocks, run where the updates' shards are (decay,
      which reads the parameters, and the step size).
    devices: ``P``, the device count the stacks are padded for.
    dims: the leaves' matrix axes.
    param_specs: the parameters' ``PartitionSpec`` s where known when the optimizer is
      built (``OwnerLayout(param_specs=...)``); elsewhere ``init`` reads the split from
      the parameters' types on a mesh with ``Explicit`` axes (``fo.state_shardings``
      traces its abstract ``init`` with those types), else guesses it from the shapes
      (:func:`_split_smaller`) where ``guess``. What the optimizer was built with, the
      shapes and that split decide the state's structure.
    mesh: the mesh the optimizer is built for, if known (its axes' sizes).
    rank: the chain's rank ``r`` (``None``: full), for the model of what each matrix
      sends where its shards are (:func:`_moving_sizes`).
    summed: that model's count of ``r x n`` coefficients sent where ``U^T G`` is summed
      over a split side (2 for GaLore; 3 where a compensation gathers ``sigma`` again).
    asked: kept on the owners because asked for (``OwnerLayout(state_on_owners=True)``),
      also for parameters ``init`` sees replicated.
    guess: where neither ``param_specs`` nor the parameters' types at ``init`` give the
      split, guess it. ``False``: read it from the names of the boxes the parameters
      came to ``init`` in (the first such ``init``'s, for later ones of plain arrays),
      else lay the state out as the parameters.

  ``init`` decides which sizes move (:func:`_moving_sizes`) and the state says it (the
  keys of ``owned``), so that every update follows the layout its state has. Where
  none moves, or (unless ``asked``) ``init`` sees the parameters replicated over
  ``Explicit`` mesh axes (data parallelism), the state is the whole chain's own, laid out
  as the parameters (the state of the optimizer built without a mesh, so that one
  checkpoint fits both), and so is the update.

  The update follows the state it is given (its ``load`` says ``P``): on a mesh of ``P``
  devices (the owner layout active, ``fisher_optax.owner_layout``) the gradients travel
  to their owners and back; elsewhere (one device, another mesh) each group's real
  matrices are updated from their slots, laid out by XLA, with the same results.
  """
  stacked = optax.with_extra_args_support(optax.chain(*blocks(None)))
  per_leaf = optax.with_extra_args_support(optax.chain(*blocks(dims)))
  after = optax.with_extra_args_support(optax.chain(*tail))
  whole = optax.with_extra_args_support(optax.chain(*blocks(dims), *tail))

  sizes = None if mesh is None or not getattr(mesh, "shape", None) else dict(mesh.shape)
  # the mesh whose split is guessed where no specs are given: the one built for, where
  # it has P devices
  known = mesh if sizes and owners._mesh_size(mesh) == devices else None

  # the split the boxes of a first init named (Flax's recipes on Auto axes), for the
  # inits that see plain arrays (the update's check of its state, fo.state_shardings),
  # as the owner layout keeps those boxes for the update
  learned: list = []

  def init_fn(params):
    given = _known_specs(params, param_specs, guess, mesh, learned)
    if given is None:  # not known, and not to be guessed: the state as the parameters
      return whole.init(params)
    split = _init_splits(params, dims, devices, given, sizes, known)
    p = _plan(params, dims, devices, split, rank, summed)
    if not p.keys or (not asked and owners.visibly_replicated(params)):
      # nothing moves (or data parallelism on Explicit axes): the state as the parameters
      return whole.init(params)
    owned = {}
    for k, n in zip(p.keys, p.lengths):
      v = p.views[p.groups[k][0]]
      owned[k] = stacked.init({k: jnp.zeros((n,) + tuple(sorted((v.fan_in, v.fan_out))),
                                            jnp.float32)})
    return OwnedStacksState(owned=owned, local=per_leaf.init(_local(p)),
                            tail=after.init(params), load=jnp.asarray(p.load, jnp.int32))

  def update_fn(updates, state, params=None, **extra):
    if not isinstance(state, OwnedStacksState):  # laid out as the parameters (init)
      return whole.update(updates, state, params, **extra)
    p = _plan(updates, dims, state.load.shape[0], frozenset(state.owned))
    moved, splits = _to_stacks(p, owners.leaf_specs(updates))
    parts = [_stack_part(state.owned[k], n) for k, n in zip(p.keys, p.lengths)]
    firsts = list(itertools.accumulate([0] + [v.num_matrices for v in p.views]))
    body = _owner_body(stacked, p, parts, [_slot_indices(p, g, firsts)
                                           for g in range(len(p.keys))], extra)
    outs, kept_new = owners.run_owned(
        body, moved, [[x for x, k in zip(lv, kept) if k] for lv, _, kept in parts],
        p.slots, p.lengths, [[splits[i] for i in p.groups[k]] for k in p.keys])
    owned = {k: _merged(part, new) for k, part, new in zip(p.keys, parts, kept_new)}
    res = _from_stacks(p, outs)
    local_params = None if params is None else _local(p, p.treedef.flatten_up_to(params))
    with rng.indexed([firsts[i] + jnp.arange(v.num_matrices, dtype=jnp.uint32)
                      for i, (v, h) in enumerate(zip(p.views, p.here)) if h]):
      out_here, local = per_leaf.update(_local(p), state.local, local_params, **extra)
    here = iter(jax.tree.leaves(out_here))
    res = [next(here) if h else r for r, h in zip(res, p.here)]
    out, tail_state = after.update(p.treedef.unflatten(res), state.tail, params, **extra)
    return out, OwnedStacksState(owned=owned, local=local, tail=tail_state, load=state.load)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
