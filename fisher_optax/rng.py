"""Every random draw of the optimizers: ``jax.random`` from keys derived by ``fold_in``.

A draw is named by integers -- the optimizer's seed, the refresh (or renewal) number and
the matrix's index in the tree (leaves in flatten order, the matrices of a stack in
order) -- and its key is ``fold_in(fold_in(PRNGKey(seed), refresh), matrix)``. Nothing
random is stored: a state holds the step counter, and any step's draws follow from it,
the same on every device and after a restore.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import jax
import jax.numpy as jnp


def draw_key(key: jax.Array, refresh: jax.Array, matrix: jax.Array) -> jax.Array:
  """The key of ``matrix``'s draw at ``refresh``: ``fold_in(fold_in(key, refresh),
  matrix)`` (``key`` a ``jax.random.PRNGKey``; integers may be traced)."""
  return matrix_key(refresh_key(key, refresh), matrix)


def refresh_key(key: jax.Array, refresh: jax.Array) -> jax.Array:
  """``fold_in(key, refresh)``: the first half of :func:`draw_key`, shared by every matrix
  of one refresh (formed once, outside the per-matrix draws)."""
  return jax.random.fold_in(key, refresh)


def matrix_key(refresh_key_: jax.Array, matrix: jax.Array) -> jax.Array:
  """``fold_in(refresh_key, matrix)``: :func:`draw_key` from :func:`refresh_key`."""
  return jax.random.fold_in(refresh_key_, matrix)


def matrix_indices(first: int, batch_shape: tuple) -> jax.Array:
  """The tree-wide indices of one leaf's matrices: ``first, first + 1, ...`` in the
  shape of the leaf's stack (``batch_shape``; ``()`` for a single matrix)."""
  size = 1
  for d in batch_shape:
    size *= d
  return (first + jnp.arange(size, dtype=jnp.uint32)).reshape(batch_shape)


def words(key: jax.Array, refresh: jax.Array, num_matrices: int, width: int,
          rows: Optional[jax.Array] = None) -> jax.Array:
  """``(num_matrices, width)`` uint32 words: row ``j`` is ``jax.random.bits`` of
  :func:`draw_key` ``(key, refresh, j)``, all rows in one vmapped draw; ``rows``: the
  matrices ``j`` to draw for (default ``0, ..., num_matrices - 1``). Threefry's draws are
  partitionable (JAX's default), so a row of fewer words is the start of a longer one."""
  if rows is None:
    rows = jnp.arange(num_matrices, dtype=jnp.uint32)
  at_refresh = refresh_key(key, refresh)
  return jax.vmap(lambda j: jax.random.bits(matrix_key(at_refresh, j), (width,),
                                            jnp.uint32))(rows)


# Per leaf of the tree a block is updating, its matrices' tree-wide indices, where a layout
# moved them out of the tree's order (None: leaves in order, stacks flattened).
_INDICES: contextvars.ContextVar = contextvars.ContextVar("fisher_optax_matrix_indices",
                                                         default=None)


@contextlib.contextmanager
def indexed(indices: list):
  """Traces a block's update of a tree whose leaf ``i`` holds the matrices ``indices[i]``
  (uint32, one per matrix, stacks flattened) of the tree the optimizer was given: a
  layout that moves matrices (``fisher_optax.owned_stacks``) keeps each matrix's draws."""
  token = _INDICES.set(list(indices))
  try:
    yield
  finally:
    _INDICES.reset(token)


def tree_indices(rows: list) -> list:
  """Per leaf of the tree being updated (``rows[i]`` matrices), its matrices' tree-wide
  indices: ``0, 1, ...`` over the leaves in order, unless :func:`indexed` names them."""
  given = _INDICES.get()
  if given is not None and len(given) == len(rows):
    return [jnp.asarray(x, jnp.uint32).reshape(-1)[:r] for x, r in zip(given, rows)]
  starts = [sum(rows[:i]) for i in range(len(rows))]
  return [s + jnp.arange(r, dtype=jnp.uint32) for s, r in zip(starts, rows)]
