"""Lifting: a tree of (stacks of) matrices to canonical float32 matrices and back.

What a matrix block gets from here, so that it holds only its per-matrix mathematics:

- :class:`Lifted`: one tree of leaves lifted: canonical float32 matrices, per-leaf state
  arrays, a per-matrix function ``vmap``-ed over each leaf's batch axes
  (:meth:`Lifted.per_matrix`, traced once per shape), results mapped back to each
  leaf's layout and dtype (:meth:`Lifted.to_leaves`, saturating :func:`cast_like`).
- :func:`map_stateless`: all of the above for a stateless per-matrix function.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from fisher_optax.parallel import owners
from fisher_optax.grouping import map_grouped, shared, vmap_batch
from fisher_optax.matrices import DimsSpec, MatrixView, matrix_view
from fisher_optax.model_dims import resolve_dims


def cast_like(x: jax.Array, dtype) -> jax.Array:
  """``x.astype(dtype)``, saturating at the finite range of a narrower float dtype.

  An update beyond float16's range (65504) is lost either way; saturating keeps it from
  becoming ``inf`` and poisoning the parameters. NaN stays NaN (visible).
  """
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max:
    big = float(jnp.finfo(dtype).max)
    x = jnp.clip(x, -big, big)
  return x.astype(dtype)


def side_flags(side: Optional[str]) -> dict:
  """``side`` (``None``: the leaf's own rows/cols, ``"smaller"``, ``"larger"``) as
  :func:`matrix_view`'s keywords."""
  if side not in (None, "smaller", "larger"):
    raise ValueError(f"`side` must be 'smaller' or 'larger', got {side!r}")
  return dict(smaller_first=side == "smaller", larger_first=side == "larger")


@functools.partial(jax.jit, static_argnums=1)
def _canonical_f32(x: jax.Array, view: MatrixView) -> jax.Array:
  """A leaf -> its canonical float32 ``batch + (m, n)`` array (traced once per view)."""
  return view.to_canonical(x).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def from_canonical_as(x: jax.Array, view: MatrixView, dtype) -> jax.Array:
  """A canonical array -> the leaf's layout, cast (saturating, :func:`cast_like`) to
  ``dtype``; traced once per view and dtype (:func:`shared`)."""
  return cast_like(view.from_canonical(x), dtype)


class Lifted:
  """One tree of (stacks of) matrices lifted to per-matrix form, for one ``init`` or
  ``update`` of a matrix block.

  Attributes:
    leaves, treedef: the flattened tree.
    canonical_grads: with ``canonical=True``, the leaves as canonical ``batch + (m, n)`` float32
      arrays.
    views: one :class:`MatrixView` per leaf (``None`` for a leaf of ndim < 2 when
      ``vectors=True``).

  Args:
    tree: the parameters (at ``init``) or updates (at ``update``).
    dims: matrix axes per leaf (:data:`DimsSpec`).
    side: ``None`` (rows/cols as ``dims`` say), ``"smaller"`` or ``"larger"`` first.
    what: the block's name, for error messages.
    canonical: compute :attr:`canonical_grads` (at ``update``; at ``init`` the parameters need no
      copy). Done here, not lazily, so that it is traced outside any ``lax.cond`` a block
      builds.
    vectors: accept leaves of ndim < 2 (view ``None``; e.g. the norm-growth limiter,
      which treats a vector as one whole tensor); otherwise they raise.
  """

  def __init__(self, tree: Any, dims: "DimsSpec", *, side: Optional[str] = None,
               what: str, canonical: bool = False, vectors: bool = False):
    self.leaves, self.treedef = jax.tree.flatten(tree)
    flags = side_flags(side)
    dims_leaves = self.treedef.flatten_up_to(resolve_dims(dims, tree))
    self.views = [None if vectors and jnp.ndim(x) < 2
                  else matrix_view(jnp.shape(x), d, what=what, **flags)
                  for x, d in zip(self.leaves, dims_leaves)]
    self.specs = owners.leaf_specs(tree)
    if canonical:  # where the owners' exchange slices them further, kept as they are
      self.leaves = owners.held_where_replicated(self.leaves, self.views, self.specs)
    self.canonical_grads = ([_canonical_f32(g, v) for g, v in zip(self.leaves, self.views)]
                if canonical else None)
    self.param_specs = owners.leaf_param_specs(tree)
    self.keys = owners.leaf_keys(tree)

  @property
  def splits(self) -> list:
    """Per leaf, how its canonical matrices (``[matrices, m, n]``) are split over the
    owner layout's mesh, where the update knows the gradients' split
    (:func:`fisher_optax.parallel.owners.view_split`); ``None`` elsewhere."""
    return [owners.view_split(v, s) for v, s in zip(self.views, self.specs)]

  @property
  def held_splits(self) -> list:
    """Per leaf, the split its canonical matrices have where known (:attr:`splits`
    without the mesh axes they are replicated over)."""
    return [owners.view_split(v, s, spread=False) for v, s in zip(self.views, self.specs)]

  def leaves_of(self, tree: Any) -> list:
    """A tree of the same structure (e.g. a state field) -> its leaves in order."""
    return self.treedef.flatten_up_to(tree)

  def unflatten(self, leaves: Sequence[Any]) -> Any:
    """Per-leaf values -> a tree of the lifted tree's structure."""
    return self.treedef.unflatten(list(leaves))

  def per_view(self, fn: Callable[["MatrixView"], Any]) -> Any:
    """A tree of ``fn(view)`` per leaf (state arrays at ``init``; ``fn`` may return
    ``None`` for an unused field)."""
    return self.unflatten([fn(v) for v in self.views])

  def per_matrix(self, fn: Callable[..., Any], *cols: Sequence[Any]) -> list:
    """``fn`` (written for one matrix) on every leaf, ``vmap``-ed over its batch axes;
    ``cols`` are per-leaf argument lists (e.g. :attr:`canonical_grads`,
    ``leaves_of(state.s)``). ``fn`` is traced once per distinct argument shape
    (:func:`shared`)."""
    fn = shared(fn)
    return [vmap_batch(fn, len(v.batch_shape))(*xs) for v, *xs in zip(self.views, *cols)]

  def to_leaves(self, canonical: Sequence[jax.Array]) -> Any:
    """Canonical per-leaf arrays -> a tree in the leaves' layouts and dtypes."""
    return self.unflatten([from_canonical_as(o, v, jnp.dtype(g.dtype))
                    for o, v, g in zip(canonical, self.views, self.leaves)])


def map_stateless(fn: Callable[[jax.Array, MatrixView], jax.Array], tree: Any, dims: DimsSpec,
                  *, side: Optional[str] = None, what: str, whole: bool = False) -> Any:
  """Applies ``fn(matrix_f32, view)`` (written for one canonical ``m x n`` matrix) to every
  leaf: canonical float32 layout, ``vmap`` over batch axes, back to the leaf's layout,
  cast (saturating) to the leaf's dtype. For stateless per-matrix blocks.

  ``whole``: ``fn`` is whole-matrix work that does not read its view (whitening); under
  the owner layout (:mod:`fisher_optax.parallel.owners`) the matrices of every leaf of one shape
  run together, each on its owner (:func:`fisher_optax.grouping.map_grouped`)."""
  lifted = Lifted(tree, dims, side=side, what=what, canonical=True)
  if whole and owners.active() is not None:
    flat = [g.reshape((-1,) + g.shape[-2:]) for g in lifted.canonical_grads]
    outs = map_grouped(lambda x: fn(x, None), [(g,) for g in flat], splits=lifted.splits)
    return lifted.to_leaves([o.reshape(g.shape)
                             for o, g in zip(outs, lifted.canonical_grads)])
  one = shared(lambda m, v: vmap_batch(lambda x: fn(x, v), len(v.batch_shape))(m),
               static_argnums=1)
  return lifted.to_leaves([one(g, v) for v, g in zip(lifted.views, lifted.canonical_grads)])
