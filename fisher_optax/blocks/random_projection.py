"""Random projections and norm-ratio gradient scaling: the APOLLO blocks (paper App.
Alg. "Apollo"; the APOLLO release).

:func:`random_project` emits :class:`~fisher_optax.blocks.subspace.Subspace` nodes
with ``sigma = U^T G`` for a Gaussian ``U`` (``m x r``, entries ``N(0, 1/r)``,
smaller side) that is *regenerated* every step from the key
``fold_in(fold_in(PRNGKey(seed), renewal), matrix)`` (:mod:`fisher_optax.rng`), where
``renewal = count // interval`` grows at every refresh and ``matrix`` is the matrix's
index in the tree. Nothing per matrix is stored: the state is the step counter.

:func:`scale_by_subspace_ratio` maps each node to a dense update that scales the
*raw* gradient::

    channel: out = G diag(s),  s_j = ||coeffs_{:,j}|| / (||sigma_{:,j}|| + 1e-8)
    tensor:  out = s G,        s   = ||coeffs||_F / (||sigma||_F + 1e-8)

where ``coeffs`` is what :func:`on_coefficients` made of ``sigma`` (Adam's output).

Under the owner layout, where a matrix's split is known, ``sigma`` is formed where its
state is (the mathematics is unchanged): a matrix split on its columns only has every
device draw each ``U`` whole and project its columns
(:func:`fisher_optax.parallel.owners.drawn_projections`: no basis crosses between
devices). A matrix split on its rows only whose coefficients' state is split over the
same mesh axes (its type on Explicit axes, or ``OwnerLayout(state_placed=True)``) moves
to its columns where that sends less than summing ``sigma`` over the rows (``2 m n / R <
r n`` over ``R`` devices) and is projected there, or else has ``sigma`` summed over the
rows and scattered over its columns in one collective
(:func:`fisher_optax.parallel.owners.scattered_projection`), so Adam's step and the
ratio run where the state is.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import grouping, lifting, linalg, matrices, rng, validation
from fisher_optax.blocks import subspace
from fisher_optax.parallel import owners


def random_basis(key: jax.Array, m: int, r: int) -> jax.Array:
  """The ``m x r`` Gaussian projection ``N(0, 1/r)`` of one matrix for a PRNG key."""
  return jax.random.normal(key, (m, r), jnp.float32) / jnp.sqrt(jnp.float32(r))


class RandomProjectState(NamedTuple):
  """``count``: the step counter, from which every projection is drawn again."""
  count: jax.Array


def random_project(*, rank: int, interval: int = 200, seed: int = 0,
                   dims: matrices.DimsSpec = None) -> subspace.SubspaceSource:
  """Projects each matrix gradient with a seeded Gaussian ``U`` (APOLLO); emits ``Subspace``.

  Args:
    rank: ``r >= 1``, clipped per matrix to ``min(m, n)``.
    interval: seed renewal period ``K >= 1``.
    seed: base seed; matrix ``i`` of the tree (flattened, stacks included) draws from
      ``fold_in(fold_in(PRNGKey(seed), count // interval), i)``.
    dims: matrix axes per leaf.
  """
  validation.check_int("rank", rank, low=1)
  rank = validation.static_int("rank", rank)
  validation.check_int("interval", interval, low=1)
  what = "random_project"

  def init_fn(params):
    lifting.Lifted(params, dims, side="smaller", what=what)  # checks the dims
    return RandomProjectState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    lifted = lifting.Lifted(updates, dims, side="smaller", what=what, canonical=True)
    renewal_key = rng.refresh_key(jax.random.PRNGKey(seed), state.count // interval)
    firsts = [0]
    for v in lifted.views:
      firsts.append(firsts[-1] + v.num_matrices)
    indices = [rng.matrix_indices(f, v.batch_shape) for f, v in zip(firsts, lifted.views)]
    ranks = [subspace.clipped_rank(rank, v) for v in lifted.views]
    nodes = _projected(lifted, indices, ranks, renewal_key)
    count = optax.safe_int32_increment(state.count)
    return lifted.unflatten(nodes), RandomProjectState(count=count)

  return subspace.subspace_source(init_fn, update_fn, rank=rank, dims=dims)


def _projected(lifted: lifting.Lifted, indices: list, ranks: list,
               renewal_key: jax.Array) -> list:
  """Per leaf, the :class:`~fisher_optax.blocks.subspace.Subspace` of ``sigma = U^T G``
  for the bases ``U`` drawn from ``renewal_key`` (matrix ``i``: ``random_basis(
  fold_in(renewal_key, i))``).

  Under the owner layout, where a gradient's split is known: split on its columns (or
  moved there from its rows, ``owners.relay_split``, where that sends less than summing
  ``sigma`` over the rows), each device draws every basis whole and projects its
  columns, one basis at a time (``owners.drawn_projections``); else, where the state is
  split as the rows, ``sigma`` is summed and scattered (``owners.scatter_rows``).
  Measured at the 60M LLaMA's shapes, FSDP over 32 CPU devices: left to XLA, which drew
  each basis split over its rows and gathered it (every basis held at once), and with
  the rows summed, 0.061x of the parameter bytes sent per step and 0.064x temporary
  memory; drawn where the columns are, 0.009x and 0.013x (8 devices: 0.056x and 0.038x
  -> 0.032x and 0.032x)."""
  views, keys = lifted.views, lifted.keys
  relays = [owners.relay_split(v, k, r, stay=1.0, basis_sent=False)
            for v, k, r in zip(views, keys, ranks)]
  drawn = [() if not v.num_matrices else tuple(n for _, n in m) if m
           else owners.columns_only(v, k) for v, k, m in zip(views, keys, relays)]
  scatter = [() if d else owners.scatter_rows(v, k, r)
             for v, k, r, d in zip(views, keys, ranks, drawn)]
  # the draws of all leaves with the same (m, r) in one vmapped call (grouping.vmap_grouped)
  bases = grouping.vmap_grouped(
      lambda mr: lambda i: random_basis(rng.matrix_key(renewal_key, i), *mr), indices,
      [(v.m, r) for v, r in zip(views, ranks)])
  gcs = [owners.relaid(gc, m) if m else gc for gc, m in zip(lifted.canonical_grads, relays)]
  local = [i for i, d in enumerate(drawn) if d]
  sigmas = dict(zip(local, owners.drawn_projections(
      lambda key, i, m, r: random_basis(rng.matrix_key(key, i), m, r), renewal_key,
      [(indices[i].reshape(-1), gcs[i].reshape((-1,) + gcs[i].shape[-2:]), drawn[i],
        ranks[i]) for i in local]) if local else []))
  nodes = []
  project = grouping.shared(linalg.project_rows)
  for i, (g, gc, basis, view, key, rows, relay) in enumerate(zip(
      lifted.leaves, gcs, bases, views, keys, scatter, relays)):
    if i in sigmas:
      sigma = sigmas[i].reshape(view.batch_shape + sigmas[i].shape[-2:])
    elif rows:
      sigma = owners.scattered_projection(basis, gc, rows, owners.split_columns(view, key))
    else:
      sigma = project(basis, gc)
    nodes.append(subspace.Subspace(sigma, sigma, basis, gc, view, g.dtype,
                                   None if relay is None else tuple(relay)))
  return nodes


def scale_by_subspace_ratio(kind: str = "channel") -> optax.GradientTransformation:
  """``Subspace`` -> ``G * s`` with APOLLO's channel- or tensor-wise ratio (module docstring)."""
  if kind not in ("channel", "tensor"):
    raise ValueError(f"`kind` must be 'channel' or 'tensor', got {kind!r}")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params

    scaled = grouping.shared(lambda g, coeffs, sigma: g * linalg.norm_ratio(coeffs, sigma, kind))

    def one(s):
      return subspace.to_leaf(s, scaled(s.grad, s.coeffs, s.sigma))

    return jax.tree.map(one, updates, is_leaf=subspace.is_subspace), state

  return optax.GradientTransformation(init_fn, update_fn)
