"""Eigen-space rotation: run any optax transformation in the eigenbasis of ``E[G G^T]``
and/or ``E[G^T G]`` (paper Sec. 3.4 "Eigen-Adam", Sec. 3.5 "SOAP", App. Algs. Shampoo,
SOAP, Eigen-Adam/AdaDiag/one-side SOAP).

Per matrix (canonical ``m x n``) with left statistics ``L`` (m x m) and right ``R``
(n x n)::

    L <- b3 L + (1 - b3) G G^T,   R <- b3 R + (1 - b3) G^T G     (b3=None: L <- L + G G^T)
    U_L, U_R: eigenbases of L, R, refreshed every ``interval`` steps
    G~ = U_L^T G U_R                      [Shampoo: G~ *= (lam_L lam_R^T)^power]
    out = U_L  inner(G~)  U_R^T

A disabled side (``sides`` excludes it, or its size exceeds ``max_precond_dim``)
is the identity and stores nothing: a 32000 x 2048 embedding with
``max_precond_dim=10000`` is rotated on its 2048 side only, and no 32000 x 32000
matrix is ever built.

Two schedules:

* ``statistics="before"`` (paper Algs. Eigen-Adam, Shampoo): statistics include the
  current gradient; refresh by float32 ``eigh`` when ``(t - 1) mod interval == 0``
  (steps 1, K+1, ...), then the update.
* ``statistics="after"`` (SOAP reference optimizer): step 1 only initialises the
  statistics and the basis (``eigh``) and returns a zero update; later steps update
  with the current basis, then add the gradient to the statistics, and refresh
  when the number of real updates is a multiple of ``interval``.

Refresh methods: ``"eigh"`` (exact, descending) or ``"power_qr"`` (SOAP: sort the
old basis by the estimated eigenvalues ``diag(U^T L U)``, one power iteration
``QR(L U)``). The first refresh is always ``eigh``.

Cost: an ordinary step is the statistics update (``G G^T``/``G^T G``) and the two
rotations per side, all batched matmuls. Every refresh of the tree sits in one
``lax.switch`` (keep / eigh / power-QR), together with the re-expression and
permutation of the inner state, so ordinary steps do no basis arithmetic; inside
it the statistics of equal size (across leaves, stack entries and sides) are
stacked and served by one decomposition call per size
(:func:`fisher_optax.linalg.map_matrices`).

State of ``inner`` on a basis change (explicit, by field name):

* ``reexpress=("mu",)``: those fields are rotated into the new basis,
  ``mu <- (U_L'^T U_L) mu (U_R^T U_R')``. For a full-rank basis this equals keeping
  the first moment in the original space and rotating it every step (Eigen-Adam's
  listing) and SOAP's project-back / project.
* ``permute=("nu",)``: those fields follow the power-QR sort order (SOAP's
  second moment), without rotation.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from fisher_optax import linalg, routing

_SIDES = ("left", "right", "both", "smaller")


class RotateState(NamedTuple):
  """Per leaf: statistics, bases and (Shampoo) eigenvalues per side; a disabled side
  (and unused eigenvalues) hold ``None``. ``inner_state`` is the state of the rotated
  transformation."""
  count: jax.Array
  stats_left: optax.Updates
  stats_right: optax.Updates
  basis_left: optax.Updates
  basis_right: optax.Updates
  eig_left: optax.Updates
  eig_right: optax.Updates
  inner_state: optax.OptState


def _active(view: routing.MatrixView, sides: str, max_dim: Optional[int]) -> tuple[bool, bool]:
  left = sides in ("left", "both", "smaller")
  right = sides in ("right", "both")
  ok = lambda d: max_dim is None or d <= max_dim
  return left and ok(view.m), right and ok(view.n)


def _power_qr(stat, basis):
  est = jnp.diagonal(basis.T @ stat @ basis)
  idx = jnp.argsort(-est)
  q = linalg.orthonormalize(stat @ basis[:, idx])
  return q, idx


def rotate(inner: optax.GradientTransformation, *, sides: str = "both", interval: int = 10,
           b3: Optional[float] = 0.95, statistics: str = "before", refresh: str = "eigh",
           reexpress: Sequence[str] = (), permute: Sequence[str] = (),
           eigenvalue_power: Optional[float] = None, stats_eps: float = 0.0,
           max_precond_dim: Optional[int] = 10000, dims: routing.DimsSpec = None
           ) -> optax.GradientTransformation:
  """Runs ``inner`` in the eigenbasis of the gradient statistics (module docstring).

  Args:
    inner: transformation applied to the rotated gradients ``U_L^T G U_R`` (must
      not need ``params``).
    sides: ``"left"``, ``"right"``, ``"both"`` (leaf orientation) or ``"smaller"``
      (the smaller side; tall matrices are transposed).
    interval: refresh period ``K >= 1``.
    b3: EMA decay of the statistics in [0, 1), or ``None`` to accumulate sums
      (Shampoo).
    statistics: ``"before"`` (paper) or ``"after"`` (SOAP reference).
    refresh: ``"eigh"`` or ``"power_qr"`` for refreshes after the first.
    reexpress: names of ``inner``-state fields rotated into a new basis.
    permute: names of ``inner``-state fields permuted with the power-QR sort.
    eigenvalue_power: if set, scale ``G~`` by ``(lam_L,i lam_R,j)^power``
      (Shampoo: -1/4); eigenvalues floored at ``max(stats_eps, d eps_f32 max(lam))``,
      the resolution of a float32 eigh.
    stats_eps: statistics start at ``stats_eps * I`` (Shampoo's ``eps``), >= 0.
    max_precond_dim: sides larger than this are not rotated (``None``: no limit).
    dims: matrix axes per leaf.
  """
  if sides not in _SIDES:
    raise ValueError(f"`sides` must be one of {_SIDES}, got {sides!r}")
  if statistics not in ("before", "after"):
    raise ValueError(f"`statistics` must be 'before' or 'after', got {statistics!r}")
  if refresh not in ("eigh", "power_qr"):
    raise ValueError(f"`refresh` must be 'eigh' or 'power_qr', got {refresh!r}")
  routing.check_int("interval", interval, low=1)
  routing.check_range("b3", b3, low=0.0, high=1.0, allow_none=True)
  routing.check_range("stats_eps", stats_eps, low=0.0, high=float("inf"))
  routing.check_int("max_precond_dim", max_precond_dim, low=1, allow_none=True)
  max_dim = routing.static_int("max_precond_dim", max_precond_dim)
  smaller = sides == "smaller"
  what = "rotate"

  def _views(tree):
    return routing.views_like(tree, dims, smaller_first=smaller, what=what)

  def init_fn(params):
    views = _views(params)

    def side_arrays(p, v, side, kind):
      act = _active(v, sides, max_dim)[0 if side == "left" else 1]
      d = v.m if side == "left" else v.n
      if not act:
        return None
      if kind == "stats":
        return jnp.broadcast_to(stats_eps * jnp.eye(d, dtype=jnp.float32), v.batch_shape + (d, d))
      if kind == "basis":
        return jnp.zeros(v.batch_shape + (d, d), jnp.float32)
      if eigenvalue_power is None:
        return None
      return jnp.ones(v.batch_shape + (d,), jnp.float32)

    mk = lambda side, kind: jax.tree.map(lambda p, v: side_arrays(p, v, side, kind), params, views)
    coeff_like = jax.tree.map(lambda p, v: jnp.zeros(v.batch_shape + (v.m, v.n), jnp.float32),
                              params, views)
    return RotateState(count=jnp.zeros([], jnp.int32),
                       stats_left=mk("left", "stats"), stats_right=mk("right", "stats"),
                       basis_left=mk("left", "basis"), basis_right=mk("right", "basis"),
                       eig_left=mk("left", "eig"), eig_right=mk("right", "eig"),
                       inner_state=inner.init(coeff_like))

  # ---------------------------------------------------------------- per matrix

  def stats_update(stat, g, side):
    if stat is None:
      return None
    outer = g @ g.T if side == "left" else g.T @ g
    return stat + outer if b3 is None else b3 * stat + (1 - b3) * outer

  def side_refresh(stat, basis, use_eigh):
    """One side of one matrix -> (new basis, eigenvalues, permutation, new^T old, ok).

    ``ok`` is False when the decomposition returned non-finite values: the previous
    basis (and, by the caller, the previous eigenvalues) are kept."""
    d = stat.shape[-1]
    if use_eigh:
      w, new = linalg.eigh_desc(stat)
      idx = jnp.arange(d)
    else:
      new, idx = _power_qr(stat, basis)
      w = jnp.diagonal(new.T @ stat @ new)
    ok = jnp.all(jnp.isfinite(new))
    new = jnp.where(ok, new, basis)
    idx = jnp.where(ok, idx, jnp.arange(d))
    return new, w, idx, new.T @ basis, ok

  def rot(x, bl, br):
    if bl is not None:
      x = bl.T @ x
    if br is not None:
      x = x @ br
    return x

  def unrot(x, bl, br):
    if bl is not None:
      x = bl @ x
    if br is not None:
      x = x @ br.T
    return x

  def eig_floor(w):
    """``max(stats_eps, d * eps_f32 * max(w))``: float32 eigh cannot resolve eigenvalues
    below ~``d eps ||L||``; flooring them there makes the powers well defined (the same on
    the whole unresolved subspace, whatever basis eigh picked for it)."""
    rel = w.shape[-1] * jnp.finfo(jnp.float32).eps * jnp.max(w)
    return jnp.maximum(w, jnp.maximum(jnp.maximum(jnp.asarray(stats_eps, jnp.float32), rel),
                                      jnp.finfo(jnp.float32).tiny))

  def eig_scale(x, el, er):
    if eigenvalue_power is None:
      return x
    if el is not None:
      x = x * eig_floor(el)[:, None] ** eigenvalue_power
    if er is not None:
      x = x * eig_floor(er)[None, :] ** eigenvalue_power
    return x

  def update_fn(updates, state, params=None):
    del params
    views = _views(updates)
    c = state.count
    leaves, treedef = jax.tree.flatten(updates)
    flat = lambda t: treedef.flatten_up_to(t)
    cols = [flat(x) for x in (state.stats_left, state.stats_right, state.basis_left,
                               state.basis_right, state.eig_left, state.eig_right)]
    v_leaves = flat(views)

    def stats_all(gcs, sls, srs, nbs):
      out_l, out_r = [], []
      for gc, sl, sr, nb in zip(gcs, sls, srs, nbs):
        out_l.append(routing.vmap_batch(lambda s, g: stats_update(s, g, "left"), nb)(sl, gc))
        out_r.append(routing.vmap_batch(lambda s, g: stats_update(s, g, "right"), nb)(sr, gc))
      return out_l, out_r

    def refresh_all(sls, srs, bls, brs, els, ers, nbs, first, do_refresh, inner_state):
      """Statistics are already updated -> new bases, eigenvalues and inner state.

      Every active side of every leaf is a ``d x d`` statistic; those of equal ``d``
      (across leaves, stack entries and sides) are stacked so that one decomposition
      call (:func:`fisher_optax.linalg.map_matrices`) serves them, and all refreshes of
      the tree sit in one ``lax.switch`` (keep / eigh / power-QR). The inner state is
      re-expressed and permuted inside the refresh branches: ordinary steps do no
      basis arithmetic at all.
      """
      groups: dict = {}
      for i in range(len(sls)):
        for side, st in (("l", sls[i]), ("r", srs[i])):
          if st is not None:
            groups.setdefault(st.shape[-1], []).append((i, side))

      def refreshed(use_eigh, ops):
        sls, srs, bls, brs, els, ers, inner_state = ops
        res = {"l": [None] * len(sls), "r": [None] * len(sls)}  # side_refresh's outputs
        for d, members in groups.items():
          stat = lambda i, side: (sls if side == "l" else srs)[i]
          basis = lambda i, side: (bls if side == "l" else brs)[i]
          outs = linalg.map_matrices(
              lambda st, b: side_refresh(st, b, use_eigh),
              jnp.concatenate([stat(*k).reshape(-1, d, d) for k in members]),
              jnp.concatenate([basis(*k).reshape(-1, d, d) for k in members]))
          start = 0
          for i, side in members:
            batch = stat(i, side).shape[:-2]
            size = int(np.prod(batch, dtype=int))
            res[side][i] = tuple(o[start:start + size].reshape(batch + o.shape[1:]) for o in outs)
            start += size
        pick = lambda side, j, old: [old[i] if r is None else r[j]
                                     for i, r in enumerate(res[side])]
        bls, brs = pick("l", 0, bls), pick("r", 0, brs)
        if eigenvalue_power is not None:
          keep = lambda side, old: [o if r is None else jnp.where(r[4][..., None], r[1], o)
                                    for o, r in zip(old, res[side])]
          els, ers = keep("l", els), keep("r", ers)
        ils = [None if r is None else r[2] for r in res["l"]]
        irs = [None if r is None else r[2] for r in res["r"]]
        rls = [None if r is None else r[3] for r in res["l"]]
        rrs = [None if r is None else r[3] for r in res["r"]]
        # inner state on basis change: rotate / permute the named fields
        for name in reexpress:
          fl = flat(otu.tree_get(inner_state, name))
          new = [routing.vmap_batch(
              lambda x1, a, b: rot(x1, None if a is None else a.T, None if b is None else b.T),
              nb)(x, rl, rr).astype(x.dtype) for x, rl, rr, nb in zip(fl, rls, rrs, nbs)]
          inner_state = otu.tree_set(inner_state, **{name: treedef.unflatten(new)})
        if not use_eigh:
          for name in permute:
            fl = flat(otu.tree_get(inner_state, name))
            def perm(x1, i1, i2):
              if i1 is not None:
                x1 = x1[i1, :]
              if i2 is not None:
                x1 = x1[:, i2]
              return x1
            new = [routing.vmap_batch(perm, nb)(x, il, ir)
                   for x, il, ir, nb in zip(fl, ils, irs, nbs)]
            inner_state = otu.tree_set(inner_state, **{name: treedef.unflatten(new)})
        return bls, brs, els, ers, inner_state

      branches = [lambda ops: tuple(ops[2:]), lambda ops: refreshed(True, ops)]
      which = jnp.where(do_refresh, 1, 0)
      if refresh == "power_qr":
        branches.append(lambda ops: refreshed(False, ops))
        which = jnp.where(do_refresh, jnp.where(first, 1, 2), 0)
      return jax.lax.switch(which, branches, (sls, srs, bls, brs, els, ers, inner_state))

    gcs = [v.to_canonical(g).astype(jnp.float32) for g, v in zip(leaves, v_leaves)]
    nbs = [len(v.batch_shape) for v in v_leaves]
    sls, srs, bls, brs, els, ers = cols
    inner_state = state.inner_state

    def rotated_update(bls, brs, els, ers, inner_state):
      gr = [routing.vmap_batch(lambda g, a, b, ea, eb: eig_scale(rot(g, a, b), ea, eb), nb)(
          gc, bl, br, el, er) for gc, bl, br, el, er, nb in zip(gcs, bls, brs, els, ers, nbs)]
      out_r, inner_state = inner.update(treedef.unflatten(gr), inner_state, None)
      out = [routing.vmap_batch(unrot, nb)(o.astype(jnp.float32), bl, br)
             for o, bl, br, nb in zip(flat(out_r), bls, brs, nbs)]
      return out, inner_state

    if statistics == "before":
      sls, srs = stats_all(gcs, sls, srs, nbs)
      bls, brs, els, ers, inner_state = refresh_all(
          sls, srs, bls, brs, els, ers, nbs, c == 0, (c % interval) == 0, inner_state)
      out, inner_state = rotated_update(bls, brs, els, ers, inner_state)
    else:
      def first_step():
        sl2, sr2 = stats_all(gcs, sls, srs, nbs)
        bl2, br2, el2, er2, ist = refresh_all(sl2, sr2, bls, brs, els, ers, nbs,
                                              jnp.bool_(True), jnp.bool_(True), inner_state)
        zeros = [jnp.zeros_like(gc) for gc in gcs]
        return zeros, sl2, sr2, bl2, br2, el2, er2, ist

      def later_step():
        out, ist = rotated_update(bls, brs, els, ers, inner_state)
        sl2, sr2 = stats_all(gcs, sls, srs, nbs)
        bl2, br2, el2, er2, ist = refresh_all(sl2, sr2, bls, brs, els, ers, nbs,
                                              jnp.bool_(False), (c % interval) == 0, ist)
        return out, sl2, sr2, bl2, br2, el2, er2, ist

      out, sls, srs, bls, brs, els, ers, inner_state = jax.lax.cond(c == 0, first_step,
                                                                    later_step)

    dense = [routing.cast_like(v.from_canonical(o), g.dtype)
             for o, v, g in zip(out, v_leaves, leaves)]
    un = treedef.unflatten
    return un(dense), RotateState(count=optax.safe_int32_increment(c), stats_left=un(sls),
                                  stats_right=un(srs), basis_left=un(bls), basis_right=un(brs),
                                  eig_left=un(els), eig_right=un(ers), inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)
