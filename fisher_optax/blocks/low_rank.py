"""Low-rank tracking (paper Sec. 5.1, Eq. "tracking step").

:func:`low_rank_track` replaces every matrix gradient by a
:class:`~fisher_optax.blocks.subspace.Subspace` carrying ``sigma = U^T G`` (``r x n``),
the basis ``U`` (``m x r``) and the canonical gradient ``G`` (``m x n``, ``m <= n``:
tall matrices are transposed); :mod:`fisher_optax.blocks.subspace` has the message,
:func:`~fisher_optax.on_coefficients` and the ends.

Tracking (Alice): ``Q~_t = b3 Q~_{t-1} + (1 - b3) sigma_t sigma_t^T`` (``r x r``),
re-expressed at a refresh as ``Q~ <- U^T (U_old Q~ U_old^T) U``. ``b3=0``
(Alice-0, GaLore) stores no ``r x r`` state.

Refresh: when ``(t - 1) mod interval == 0`` (steps 1, K+1, 2K+1, ...),
inside the compiled step, with the policy given as ``refresh=``
(:mod:`fisher_optax.refresh`). A refresh that produces a non-finite basis
keeps the previous one.

Cost (what makes the hot path fast): an ordinary step is two batched matmuls per
matrix (``U^T G``, and ``sigma sigma^T`` when tracking), ``O(mnr)``. All refreshes of
the tree sit in one ``lax.cond`` (keep / refresh; the first refresh and the later ones
are a ``lax.cond`` per matrix inside it), so ordinary steps run none of their code;
inside it, same-shape matrices (every layer's ``q_proj``,
stack entries) are concatenated and served by one decomposition call per shape
(:func:`fisher_optax.grouping.map_grouped`), which also keeps compile time flat in
the number of layers. ``Q`` is never formed: the switching policy reads the Gram
``C = G G^T`` (``m x m``, formed once per refresh, so matrices of one ``m`` share one
compiled refresh) and applies ``Q`` as ``b3 U_old (Q~ (U_old^T U)) + (1 - b3) C U``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fisher_optax import grouping, linalg, matrices, rng, validation
from fisher_optax.blocks import subspace
from fisher_optax.parallel import owners
from fisher_optax import refresh as refresh_lib


class LowRankTrackState(NamedTuple):
  """``basis``: ``batch + (m, r)``; ``tracked``: ``batch + (r, r)`` or ``None``
  (no tracking); ``key``: PRNG key (``None`` for deterministic policies)."""
  count: jax.Array
  basis: optax.Updates
  tracked: Optional[optax.Updates]
  key: Optional[jax.Array]
  SHARDING = {"tracked": "replicated", "key": "replicated"}  # roles for parallel/sharding.py


class LowRankTrackLargerState(LowRankTrackState):
  """:class:`LowRankTrackState` of a tracker of the larger side (``side="larger"``,
  Alice-SOAP's right basis ``V``, ``n x k``): the same fields, its basis laid out by
  ``fo.state_shardings`` as the matrices' columns where they are split, also where a
  square parameter's two sides have one size (role ``columns``). Laid out as the rows
  there, the right basis of every column-parallel attention matrix was moved between
  devices at every step (Alice-SOAP at the tiny LLaMA's shapes, FSDP 4 x TP 2 on 8 CPU
  devices: 0.32x of the parameter bytes per ordinary step, 0.23x laid out as the
  columns)."""
  SHARDING = {"basis": "columns", "tracked": "replicated", "key": "replicated"}


def low_rank_track(*, rank: int, interval: int = 200, b3: float = 0.0,
                   refresh: Optional[Any] = None, dims: matrices.DimsSpec = None,
                   state_dtype: Optional[jnp.dtype] = None,
                   side: str = "smaller") -> subspace.SubspaceSource:
  """Projects each matrix gradient on a tracked rank-``r`` basis (paper Eq. "tracking step").

  Every step: ``sigma = U^T G``; if ``b3 > 0``:
  ``Q~ <- b3 Q~ + (1 - b3) sigma sigma^T``. Emits
  :class:`~fisher_optax.blocks.subspace.Subspace` nodes.

  Args:
    rank: ``r >= 1``; clipped per matrix to ``min(m, n)``.
    interval: refresh period ``K >= 1``.
    b3: tracking decay in [0, 1); 0 disables the ``r x r`` state (Alice-0, GaLore).
    refresh: a policy, :func:`~fisher_optax.switch` or :func:`~fisher_optax.svd_refresh`
      (default ``switch(leading=None)``: subspace iteration, no switching).
    dims: matrix axes per leaf (default: the last two).
    state_dtype: dtype of ``U`` and ``Q~`` in the state (default float32; all
      decompositions run in float32 regardless).
    side: which side ``U`` spans: ``"smaller"`` (the paper's ``m <= n``) or ``"larger"``
      (the canonical matrix is then ``m >= n``; :func:`fisher_optax.alice_soap` uses it
      for the right basis of its ``r x n`` coefficients).
  """
  subspace.check_side(side)
  validation.check_int("rank", rank, low=1)
  rank = validation.static_int("rank", rank)
  validation.check_int("interval", interval, low=1)
  validation.check_range("b3", b3, low=0.0, high=1.0)
  policy = refresh if refresh is not None else refresh_lib.switch()
  leading = getattr(policy, "leading", None)
  if isinstance(leading, int) and leading > rank:
    raise ValueError(f"`leading` must be an integer [0, {rank}] (at most `rank`), got {leading}")
  tracker = _Tracker(rank=rank, interval=interval, b3=b3, policy=policy, dims=dims,
                     side=side, sdtype=state_dtype or jnp.float32,
                     has_tracking=not (isinstance(b3, (int, float)) and b3 == 0))
  return subspace.subspace_source(tracker.init, tracker.update, rank=rank, dims=dims, side=side)


@dataclasses.dataclass(frozen=True, eq=False)
class _Tracker:
  """The static settings of one :func:`low_rank_track` and its ``init`` / ``update``."""

  rank: int
  interval: Any
  b3: Any
  policy: Any
  dims: matrices.DimsSpec
  side: str
  sdtype: Any
  has_tracking: bool

  @property
  def state_type(self):
    """The state's class: :class:`LowRankTrackLargerState` for the larger side."""
    return LowRankTrackLargerState if self.side == "larger" else LowRankTrackState

  def lift(self, tree, canonical: bool = False):
    return subspace.lift(tree, self.dims, "low_rank_track", self.side, canonical)

  def init(self, params):
    lifted, r = self.lift(params), lambda v: subspace.clipped_rank(self.rank, v)  # noqa: E731
    basis = lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (v.m, r(v)), self.sdtype))
    tracked = None
    if self.has_tracking:
      tracked = lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (r(v),) * 2, self.sdtype))
    key = jax.random.PRNGKey(self.policy.seed) if self.policy.random else None
    return self.state_type(count=jnp.zeros([], jnp.int32), basis=basis, tracked=tracked,
                             key=key)

  def update(self, updates, state, params=None):
    del params
    lifted = self.lift(updates, canonical=True)
    leaves, v_leaves, gcs = lifted.leaves, lifted.views, lifted.canonical_grads
    u_leaves = lifted.leaves_of(state.basis)
    q_leaves = lifted.leaves_of(state.tracked) if self.has_tracking else [None] * len(leaves)
    new_flat_u, new_flat_q = self.refresh_all(state, gcs, u_leaves, q_leaves, lifted.splits,
                                              self.basis_splits(lifted), lifted.held_splits)
    out, new_u, new_q = [], [], []
    step = grouping.shared(self.project)  # traced once per leaf shape
    track = grouping.shared(self.track)
    for g, gc, u_old, view, u, q, key in zip(leaves, gcs, u_leaves, v_leaves, new_flat_u,
                                             new_flat_q, lifted.keys):
      u = u.reshape(u_old.shape)
      if q is not None:
        q = q.reshape(view.batch_shape + q.shape[-2:])
      # summed on r instead, sigma is gathered only where it is tracked
      relay = (owners.relay_split(view, key, u.shape[-1],
                                  stay_on_r=3.0 if self.has_tracking else 2.0)
               if self.side == "smaller" else None)
      # where the move does not pay, sigma summed over the split rows and scattered where
      # its state is (owners.scatter_rows): half the bytes of an all-reduce
      rows = (owners.scatter_rows(view, key, u.shape[-1])
              if relay is None and self.side == "smaller" else ())
      u_p = u
      if relay is not None:  # sigma = U^T G where the columns are (owners.relay_split)
        gc, u_p = owners.relaid(gc, relay), owners.relaid(u, [])
      if rows:
        cols = owners.split_columns(view, key)
        coeffs = sigma = owners.scattered_projection(u, gc, rows, cols)
        if owners.coefficient_axis(view.n, rows, cols) == -2:
          # split on r, as their state is: gathered once (on r; n stays where the
          # columns are) for the tracking and any ``U sigma`` downstream
          sigma = owners.relaid(sigma, [(2, n) for n in cols])
        q = track(sigma, q)
      else:
        sigma, q, _ = step(gc, u_p, q)
        coeffs = sigma
      if q is not None:
        new_q.append(q)
      new_u.append(u.astype(self.sdtype))
      out.append(subspace.Subspace(coeffs, sigma, u_p, gc, view, g.dtype,
                                   None if relay is None else tuple(relay)))
    return lifted.unflatten(out), self.state_type(
        count=optax.safe_int32_increment(state.count), basis=lifted.unflatten(new_u),
        tracked=lifted.unflatten(new_q) if self.has_tracking else None, key=state.key)

  def project(self, gc, u, q):
    """One leaf's step after the refresh: ``sigma = U^T G`` and, with tracking, paper Eq.
    "tracking step" ``Q~ <- b3 Q~ + (1 - b3) sigma sigma^T``; returns ``sigma``, ``Q~``
    and ``U`` in the state dtype."""
    sigma = linalg.matmul(jnp.swapaxes(u, -1, -2), gc)
    return sigma, self.track(sigma, q), u.astype(self.sdtype)

  def track(self, sigma, q):
    """Paper Eq. "tracking step" ``Q~ <- b3 Q~ + (1 - b3) sigma sigma^T`` in the state
    dtype (``q`` ``None``: no tracking)."""
    if q is None:
      return None
    return linalg.ema(self.b3, q, linalg.matmul(sigma, jnp.swapaxes(sigma, -1, -2))
                      ).astype(self.sdtype)

  def basis_splits(self, lifted):
    """Per leaf, where the state keeps its basis' rows over the owner layout's mesh, where
    known: split as the matrices' rows are (their own split, without the mesh axes the
    owners' exchange adds where the matrices are replicated: a basis pinned there was
    gathered back to the state's layout at every step; tiny LLaMA, data 2 x FSDP 4 on 8
    CPU devices: GaLore's ordinary step 0.207x -> 0.068x of the parameter bytes), or
    for a basis of the larger side (whose matrices are coefficients, not the parameter)
    as ``fo.state_shardings`` splits it, by its parameter's axis of that size."""
    if self.side != "larger":  # the split the rows have, not the exchange's spread one
      return lifted.held_splits
    return [owners.sized_split(v.m, p, last=True)
            for v, p in zip(lifted.views, lifted.param_specs)]

  def refresh_all(self, state, gcs, u_leaves, q_leaves, splits, basis_splits,
                  held_splits=None):
    """Bases (and tracked states, re-expressed) after this step's refresh, per leaf as
    ``[matrices, ...]`` arrays. One lax.cond (keep / refresh) holds every refresh of the
    tree, so an ordinary step runs none of this; inside it the policy's operand
    (switching: ``G G^T``) is formed per leaf, a batched matmul over its stack
    (concatenating same-shape gradients first copied them and compiled more kernels), and
    the refresh runs once per operand shape (grouping.map_grouped: every layer's q_proj,
    and with the Gram every matrix of one ``m``, share one decomposition call). The first
    refresh (step 1) and the later ones differ only in the policy's per-matrix
    ``basis_from``, so they share the operands, grouping, non-finite guard and
    re-expression (one compiled copy instead of one per branch). ``splits``: per leaf,
    its matrices' split over the owner layout's mesh where known (``Lifted.splits``);
    ``basis_splits``: where the state keeps its basis (:meth:`basis_splits`);
    ``held_splits``: the split the matrices have, where known
    (:attr:`fisher_optax.lifting.Lifted.held_splits`)."""
    flat_g = [gc.reshape((-1,) + gc.shape[-2:]) for gc in gcs]
    flat_u, flat_q = self.as_stacks(u_leaves), self.as_stacks(q_leaves)
    count = state.count
    first = count == 0

    # Under the owner layout the owners form the operand from whole gradients: formed
    # where the gradients are split, the Gram ``G G^T`` of every matrix was summed over
    # the devices (the tiny LLaMA's GaLore refresh, 8 CPU devices: 0.28x of the
    # parameter bytes sent per device in those sums alone).
    on_owners = owners.active() is not None

    def refresh(operands):
      gs, us, qs, key = operands
      args = self.refresh_arguments(gs, us, qs, key, count, operand=not on_owners)
      outs = self.refresh_stacks(args, first, on_owners, splits, held)
      return [o[0] for o in outs], [o[1] for o in outs]

    def keep(operands):
      _, us, qs, _ = operands
      return us, qs

    def pinned(us_qs):  # both branches' layout, so that the conditional's is not XLA's
      us, qs = us_qs
      return ([owners.pinned_basis(u, g.shape, self.side == "larger", sp)
               for u, g, sp in zip(us, flat_g, basis_splits)], owners.pinned(qs))

    # the operands pinned too: left to XLA, they took the refresh's layout before the
    # conditional, and every ordinary step moved the bases there and back
    flat_u, flat_q = pinned((flat_u, flat_q))
    held = held_splits or [None] * len(flat_g)
    flat_g = [owners.pinned_stack(g, sp) for g, sp in zip(flat_g, held)]
    return jax.lax.cond((count % self.interval) == 0, lambda ops: pinned(refresh(ops)),
                        lambda ops: pinned(keep(ops)), (flat_g, flat_u, flat_q, state.key))

  def refresh_stacks(self, args, first, on_owners, splits, held):
    """Per leaf, ``(new basis, re-expressed tracked state)`` of a refresh from its
    arguments (:meth:`refresh_arguments`). Under the owner layout the owners form the
    operand from whole gradients and run :meth:`refresh_matrix`, except for a wide
    matrix larger than a device's share of their work (an output layer): its Gram is
    summed where its columns are and every device refreshes its basis
    (``owners.gram_in_place``, ``summed_in_place``, ``everywhere``), and for a larger
    side's basis of tall coefficients larger than that share: it is refreshed where its
    rows are, the reductions over rows summed over the devices (``owners.rows_in_place``,
    ``on_rows``); the same operand and the same refresh either way. ``splits`` / ``held``: per leaf, its matrices'
    split for the exchange and the split they have, where known."""
    form = self.policy.operand if on_owners else (lambda x: x)

    def fn(x1, u1, q1, n1, form=form):
      return self.refresh_matrix(form(x1), u1, q1, n1, first)

    local = (owners.gram_in_place([a[0].shape for a in args], held)
             if on_owners and self.policy.reads_gram else [False] * len(args))
    outs = [None] * len(args)
    tall = []
    if on_owners and self.side == "larger" and type(self.policy) is refresh_lib.Switch:
      # a tall operand (coefficients sigma^T, a larger side's rows) refreshed where its
      # rows are (owners.rows_in_place): only r x k products cross the devices
      here = owners.rows_in_place([a[0].shape for a in args], [a[1].shape[-1] for a in args])
      tall = [j for j, h in enumerate(here) if h]
      # (the operand of a tall matrix is itself: a block of its rows may not be tall)
      whole = functools.partial(fn, form=lambda x: x.astype(jnp.float32))
      for j, o in zip(tall, owners.on_rows(
          lambda items: grouping.map_grouped(whole, items, state=True),
          [args[j] for j in tall], [held[j] for j in tall])):
        outs[j] = o
    owned = [j for j, here in enumerate(local) if not here and j not in tall]
    for j, o in zip(owned, grouping.map_grouped(
        fn, [args[j] for j in owned], state=True, layouts=self.layouts,
        splits=[splits[j] for j in owned])):
      outs[j] = o
    placed = [j for j, here in enumerate(local) if here]
    if placed:
      grams = [(owners.summed_in_place(args[j][0], self.policy.operand, held[j]),)
               + args[j][1:] for j in placed]

      def here(items):  # every device refreshes the m x m Gram's basis
        with owners.using(None):
          return grouping.map_grouped(functools.partial(fn, form=lambda x: x), items,
                                      state=True)

      for j, o in zip(placed, owners.everywhere(here, grams)):
        outs[j] = o
    return outs

  def layouts(self, args, split=None):
    """Under the owner layout, where a refresh's results come back (``args``: a leaf's
    gradients, bases, ...; ``split``: its matrices' split where known): the basis as
    ``owners.exchange_split`` says, the tracked state gathered to every device."""
    return [owners.exchange_split(args[1].shape, args[0].shape, self.side == "larger",
                                  split=split), None]

  def as_stacks(self, leaves):
    """State arrays per leaf -> float32 ``[matrices, ...]`` stacks (``None`` stays)."""
    return [None if x is None else x.astype(jnp.float32).reshape((-1,) + x.shape[-2:])
            for x in leaves]

  def flat_abstract(self, lifted):
    """The canonical gradients' ``[matrices, m, n]`` float32 shapes, from the views."""
    return [jax.ShapeDtypeStruct((v.num_matrices, v.m, v.n), jnp.float32) for v in lifted.views]

  def refresh_arguments(self, gs, us, qs, key, count, operand: bool = True):
    """The refresh's per-leaf arguments: the policy's operand (``operand=False``: the
    gradient itself), the basis, the tracked state and the random words
    (:func:`fisher_optax.grouping.map_grouped` items)."""
    xs = [grouping.shared(self.policy.operand)(g) for g in gs] if operand else list(gs)
    noise = (self.noise(key, count, gs, us) if self.policy.random else [None] * len(gs))
    return list(zip(xs, us, qs, noise))

  def noise(self, key, count, gs, us):
    """Per leaf, the ``[matrices, width]`` random words of this refresh: the rows of one
    ``rng.words`` draw (as ``refresh.refresh_noise``), matrix ``j`` of the tree (leaves
    in order, stacks flattened) taking row ``j``."""
    if not gs:  # no matrices (e.g. every leaf routed to the fallback)
      return []
    sizes = [max(self.policy.noise_size(g.shape[-2], u.shape[-1]), 1)
             for g, u in zip(gs, us)]
    rows = [g.shape[0] for g in gs]
    tree = rng.tree_indices(rows)
    # one draw per width, each matrix's row as long as it reads: drawn at the widest,
    # the output layer's coefficients (32000 rows at the 60M LLaMA's shapes) made every
    # matrix's row 31872 words, 7.3 MB on every device under FSDP over 32 devices, four
    # such arrays the peak of Alice-SOAP's temporary memory
    out: list = [None] * len(gs)
    for width in sorted(set(sizes)):
      members = [i for i, z in enumerate(sizes) if z == width]
      ids = jnp.concatenate([tree[i] for i in members])
      words = rng.words(key, count, len(ids), width, rows=ids)
      local = list(itertools.accumulate([0] + [rows[i] for i in members]))
      parts = grouping.split(words, local[:-1], [rows[i] for i in members])
      for i, part in zip(members, parts):
        out[i] = part
    return out

  def refresh_matrix(self, x1, u1, q1, n1, first):
    u_new = self.policy.basis_from(x1, u1, q1, self.b3, n1, first)
    return _keep_finite(u_new, u1, q1)


def _keep_finite(u_new, u1, q1):
  """A non-finite new basis keeps the old one; ``Q~ <- U^T (U_old Q~ U_old^T) U``."""
  bad = linalg.rows_sum(jnp.sum(~jnp.isfinite(u_new)))  # over every block of rows
  u_new = jnp.where(bad == 0, u_new, u1)
  if q1 is None:
    return u_new, None
  rot = linalg.tdot(u_new, u1)
  return u_new, linalg.matmul(linalg.matmul(rot, q1), rot.T)
