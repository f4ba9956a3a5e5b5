"""Random projections and norm-ratio gradient scaling: the APOLLO blocks (paper App.
Alg. "Apollo"; the APOLLO release).

:func:`random_project` emits :class:`~fisher_optax.blocks.low_rank.Subspace` nodes
with ``sigma = U^T G`` for a Gaussian ``U`` (``m x r``, entries ``N(0, 1/r)``,
smaller side) that is *regenerated* every step from a per-matrix seed kept in the
state; the seed is renewed at every refresh (``(t - 1) mod interval == 0``, t > 1).
No basis is stored: per matrix the state is one seed (and per leaf one int32 offset into
the grouped draw, :class:`RandomProjectState`).

:func:`scale_by_subspace_ratio` maps each node to a dense update that scales the
*raw* gradient::

    channel: out = G diag(s),  s_j = ||coeffs_{:,j}|| / (||sigma_{:,j}|| + 1e-8)
    tensor:  out = s G,        s   = ||coeffs||_F / (||sigma||_F + 1e-8)

where ``coeffs`` is what :func:`on_coefficients` made of ``sigma`` (Adam's output).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import hashing, matrices, validation
from fisher_optax.blocks import low_rank


def random_basis(seed: jax.Array, m: int, r: int) -> jax.Array:
  """The ``m x r`` Gaussian projection ``N(0, 1/r)`` of one matrix for a uint32 seed."""
  key = jax.random.PRNGKey(seed)
  return jax.random.normal(key, (m, r), jnp.float32) / jnp.sqrt(jnp.float32(r))


def _project(basis: jax.Array, g: jax.Array) -> jax.Array:
  """``sigma = U^T G``. For ``r = 1`` (APOLLO-mini) as multiply-reduce: XLA:CPU compiles
  each ``1 x m`` by ``m x n`` dot into an LLVM kernel of its own, one per matrix (84 for
  the 130M LLaMA), where identical reduce fusions are compiled once."""
  if basis.shape[-1] == 1:
    return jnp.sum(basis * g, axis=-2, keepdims=True)
  return jnp.swapaxes(basis, -1, -2) @ g


def next_seed(seed: jax.Array) -> jax.Array:
  """The seed after ``seed`` (uint32): :func:`fisher_optax.hashing.mix32`, a bijection of
  uint32 with full avalanche, so renewed seeds never collide and look unrelated; where a
  threefry hash compiles into large XLA:CPU kernels (~0.1 s) on every refresh path."""
  return hashing.mix32(seed)


class RandomProjectState(NamedTuple):
  """``seed``: per matrix, uint32, shape = the leaf's batch shape; ``starts``: per leaf,
  the offset of its draws in the grouped draw of its shape
  (``matrices.vmap_grouped_starts``) as an int32 scalar, read at run
  time to split the draws (fixed by the tree; a state with other values gives NaN
  projections)."""
  count: jax.Array
  seed: optax.Updates
  starts: tuple = ()
  SHARDING = {"starts": "replicated"}  # sharding.py roles


def random_project(*, rank: int, interval: int = 200, seed: int = 0,
                   dims: matrices.DimsSpec = None) -> low_rank.SubspaceSource:
  """Projects each matrix gradient with a seeded Gaussian ``U`` (APOLLO); emits ``Subspace``.

  Args:
    rank: ``r >= 1``, clipped per matrix to ``min(m, n)``.
    interval: seed renewal period ``K >= 1``.
    seed: base seed; matrix ``i`` of the tree (flattened, stacks included) starts
      from ``fold_in(seed, i)``.
    dims: matrix axes per leaf.
  """
  validation.check_int("rank", rank, low=1)
  rank = validation.static_int("rank", rank)
  validation.check_int("interval", interval, low=1)
  what = "random_project"

  def plan(lv):
    """The grouping of the draws: per leaf its ``(m, r)`` and its split offset."""
    shapes = [(v.m, low_rank.clipped_rank(rank, v)) for v in lv.views]
    return shapes, matrices.vmap_grouped_starts([v.batch_shape for v in lv.views], shapes)

  def init_fn(params):
    lv = matrices.Lifted(params, dims, side="smaller", what=what)
    seeds = [jax.random.bits(jax.random.fold_in(jax.random.PRNGKey(seed), i), v.batch_shape,
                             jnp.uint32) for i, v in enumerate(lv.views)]
    starts = tuple(jnp.asarray(x, jnp.int32) for x in plan(lv)[1])
    return RandomProjectState(count=jnp.zeros([], jnp.int32), seed=lv.un(seeds),
                              starts=starts)

  def update_fn(updates, state, params=None):
    del params
    lv = matrices.Lifted(updates, dims, side="smaller", what=what, canonical=True)
    renew = (state.count > 0) & ((state.count % interval) == 0)
    seeds = [jnp.where(renew, next_seed(o), o) for o in lv.flat(state.seed)]  # elementwise
    # the draws of all leaves with the same (m, r) in one vmapped call (matrices.vmap_grouped),
    # split at the offsets the state holds: constant offsets compiled into one XLA:CPU slice
    # kernel each (84 for the 130M LLaMA)
    shapes, offsets = plan(lv)
    if len(state.starts) != len(offsets):
      raise ValueError(f"random_project: the state holds {len(state.starts)} split offsets, "
                       f"the updates' tree needs {len(offsets)}: a state from another tree?")
    bases = matrices.vmap_grouped(lambda mr: lambda s: random_basis(s, *mr), seeds, shapes,
                                  starts=state.starts)
    if offsets:
      intact = jnp.all(jnp.stack(state.starts) == jnp.asarray(offsets, jnp.int32))
      bases = [jnp.where(intact, b, jnp.nan) for b in bases]
    nodes = []
    project = matrices.shared(_project)
    for g, gc, basis, view in zip(lv.leaves, lv.gcs, bases, lv.views):
      sigma = project(basis, gc)
      nodes.append(low_rank.Subspace(coeffs=sigma, sigma=sigma, basis=basis, grad=gc, view=view,
                                     dtype=g.dtype))
    return lv.un(nodes), RandomProjectState(count=optax.safe_int32_increment(state.count),
                                            seed=lv.un(seeds), starts=state.starts)

  return low_rank.subspace_source(init_fn, update_fn, rank=rank, dims=dims)


def norm_ratio(coeffs: jax.Array, sigma: jax.Array, kind: str) -> jax.Array:
  """``||coeffs|| / (||sigma|| + 1e-8)`` per column (``channel``, shape ``batch + (1, n)``)
  or per matrix (``tensor``, shape ``batch + (1, 1)``)."""
  axes = (-2,) if kind == "channel" else (-2, -1)
  num = jnp.sqrt(jnp.sum(jnp.square(coeffs), axis=axes, keepdims=True))
  den = jnp.sqrt(jnp.sum(jnp.square(sigma), axis=axes, keepdims=True)) + 1e-8
  return num / den


def scale_by_subspace_ratio(kind: str = "channel") -> optax.GradientTransformation:
  """``Subspace`` -> ``G * s`` with APOLLO's channel- or tensor-wise ratio (module docstring)."""
  if kind not in ("channel", "tensor"):
    raise ValueError(f"`kind` must be 'channel' or 'tensor', got {kind!r}")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params

    scaled = matrices.shared(lambda g, coeffs, sigma: g * norm_ratio(coeffs, sigma, kind))

    def one(s):
      return low_rank.to_leaf(s, scaled(s.grad, s.coeffs, s.sigma))

    return jax.tree.map(one, updates, is_leaf=low_rank.is_subspace), state

  return optax.GradientTransformation(init_fn, update_fn)
