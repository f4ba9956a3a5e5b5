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

Under the owner layout, a matrix split on its rows only whose coefficients' state is
split over the same mesh axes (its type on Explicit axes, or
``OwnerLayout(state_placed=True)``) has ``sigma`` summed over the rows and scattered over
its columns in one collective (:func:`fisher_optax.parallel.owners.scattered_projection`),
so Adam's step and the ratio run where the state is; the mathematics is unchanged.
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
    # under the owner layout, sigma summed and scattered where its state is split
    # (owners.scatter_rows); drawing a basis whole where the columns are split, instead
    # of XLA's split draw and gather, sent 0.026x less of the parameter bytes per step
    # but raised the temporary memory from 0.06x to 0.14x (the 60M LLaMA's shapes, FSDP
    # over 32 CPU devices: the draws' threefry temporaries)
    scatter = [owners.scatter_rows(v, k, r) for v, k, r in zip(lifted.views, lifted.keys, ranks)]
    # the draws of all leaves with the same (m, r) in one vmapped call (grouping.vmap_grouped)
    shapes = [(v.m, r) for v, r in zip(lifted.views, ranks)]
    bases = grouping.vmap_grouped(
        lambda mr: lambda i: random_basis(rng.matrix_key(renewal_key, i), *mr), indices, shapes)
    nodes = []
    project = grouping.shared(linalg.project_rows)
    for g, gc, basis, view, rows in zip(lifted.leaves, lifted.canonical_grads, bases,
                                        lifted.views, scatter):
      sigma = (owners.scattered_projection(basis, gc, rows) if rows
               else project(basis, gc))
      nodes.append(subspace.Subspace(sigma, sigma, basis, gc, view, g.dtype))
    count = optax.safe_int32_increment(state.count)
    return lifted.unflatten(nodes), RandomProjectState(count=count)

  return subspace.subspace_source(init_fn, update_fn, rank=rank, dims=dims)


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
