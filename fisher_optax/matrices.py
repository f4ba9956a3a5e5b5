"""The per-matrix lifting layer: every matrix block's way from a parameter tree to one
``m x n`` matrix at a time and back.

Notation: a matrix parameter ``W`` and its gradient ``G`` are ``m x n``. A
leaf with more dimensions is a *stack* of independent matrices: by default every axis
but the last two is a batch axis (scanned layers ``[layers, m, n]``), each slice with its
own optimizer state; :class:`MatrixDims` chooses other axes (as ``optax.contrib.muon``'s
dimension numbers do), several axes may merge into one side.

What a block gets from here, so that it holds only its per-matrix mathematics:

- :class:`MatrixView` / :func:`views_like`: the static map of a leaf to its canonical
  ``batch + (m, n)`` form, optionally with the smaller side as rows (``side="smaller"``,
  the paper's ``m <= n``: for ``m > n`` the same math applies to the transpose) or
  the larger (``side="larger"``).
- :class:`Lifted`: one tree of leaves lifted: canonical float32 matrices, per-leaf state
  arrays, a per-matrix function ``vmap``-ed over each leaf's batch axes
  (:meth:`Lifted.per_matrix`), results unzipped into trees and mapped back to each
  leaf's layout and dtype (:meth:`Lifted.to_leaves`, saturating :func:`cast_like`).
- :func:`map_grouped`: same-shape matrices of many leaves (every layer's ``q_proj``)
  concatenated so one call per shape serves them (decompositions; compile time flat in
  depth), split back.
- :func:`map_stateless`: all of the above for a stateless per-matrix function.

Which leaves reach a block is decided by :mod:`fisher_optax.routing` (masks).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import linalg


Axes = Union[int, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class MatrixDims:
  """Which axes of a leaf are the matrix rows and columns.

  Attributes:
    rows: axis (or axes, merged in order) of the rows (``m``); negative values count
      from the end. Several axes form one row axis of their product's size, e.g. an
      attention output kernel ``(heads, head_dim, out)`` with ``rows=(0, 1), cols=2`` is
      one ``heads * head_dim x out`` matrix.
    cols: axis (or axes) of the columns (``n``).

  All other axes are batch axes: each index into them is an independent matrix
  (``optax.contrib.muon``'s dimension numbers follow the same convention: reduction
  axes = rows, output axes = columns).
  """

  rows: Axes = -2
  cols: Axes = -1


class NotAMatrix(MatrixDims):
  """A ``dims`` entry that routes its leaf to the fallback (e.g. a stack of norm scales);
  :data:`NOT_A_MATRIX` is its instance. :func:`flax_dims` uses it for every parameter
  that is no matrix of a matrix product."""

  def __init__(self):
    super().__init__(rows=(), cols=())

  def __repr__(self):
    return "NOT_A_MATRIX"


NOT_A_MATRIX = NotAMatrix()

class DimsRule(abc.ABC):
  """A ``dims=`` rule computed from the parameter tree, such as
  :func:`fisher_optax.flax_dims`'s.

  A rule is deliberately not a Python callable: ``optax.inject_hyperparams`` takes every
  callable argument of the factory for a schedule and calls it with the step count, so
  a rule passes through it untouched. Subclasses implement :meth:`~fisher_optax.DimsRule.resolve`.
  """

  @abc.abstractmethod
  def resolve(self, tree: Any) -> Any:
    """The tree of :class:`MatrixDims` (structure of ``tree``, or a prefix of it)."""


DimsSpec = Union[None, MatrixDims, DimsRule, Any, Callable[[Any], Any]]

def _as_axes(a: Axes) -> tuple[int, ...]:
  if isinstance(a, (int, np.integer)):
    return (int(a),)
  return tuple(int(x) for x in a)


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """Static description of how a leaf maps to its canonical ``batch + (m, n)`` form."""

  shape: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]
  transpose: bool

  @property
  def batch_axes(self) -> tuple[int, ...]:
    return tuple(a for a in range(len(self.shape)) if a not in self.rows + self.cols)

  @property
  def batch_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.batch_axes)

  @property
  def num_matrices(self) -> int:
    return math.prod(self.batch_shape)

  @property
  def fan_in(self) -> int:
    """Size of the (merged) row axes of the leaf."""
    return math.prod(self.shape[a] for a in self.rows)

  @property
  def fan_out(self) -> int:
    """Size of the (merged) column axes of the leaf."""
    return math.prod(self.shape[a] for a in self.cols)

  @property
  def m(self) -> int:
    """Rows of the canonical matrix (the smaller side when ``transpose`` was asked)."""
    return self.fan_out if self.transpose else self.fan_in

  @property
  def n(self) -> int:
    return self.fan_in if self.transpose else self.fan_out

  def _perm(self) -> tuple[int, ...]:
    return self.batch_axes + self.rows + self.cols

  def to_canonical(self, x: jax.Array) -> jax.Array:
    """Leaf layout -> ``batch + (m, n)``."""
    x = jnp.transpose(x, self._perm()).reshape(self.batch_shape + (self.fan_in, self.fan_out))
    return jnp.swapaxes(x, -1, -2) if self.transpose else x

  def expand_batch(self, x: jax.Array) -> jax.Array:
    """A per-matrix array of shape ``batch_shape`` -> broadcastable against the leaf."""
    shape = [1] * len(self.shape)
    for a in self.batch_axes:
      shape[a] = self.shape[a]
    return jnp.reshape(x, shape)

  def from_canonical(self, x: jax.Array) -> jax.Array:
    """``batch + (m, n)`` -> leaf layout (inverse of :meth:`to_canonical`)."""
    if self.transpose:
      x = jnp.swapaxes(x, -1, -2)
    perm = self._perm()
    x = x.reshape(tuple(self.shape[a] for a in perm))
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
      inv[p] = i
    return jnp.transpose(x, inv)


def is_matrix_shape(shape: Sequence[int], dims: Optional[MatrixDims] = None) -> bool:
  """True when ``shape`` has matrix axes ``dims`` with both sizes > 1 (the default mask's rule)."""
  dims = dims or MatrixDims()
  if isinstance(dims, NotAMatrix) or len(shape) < 2:
    return False
  try:
    r, c = _normalize_axes(len(shape), dims)
  except ValueError:
    return False
  return math.prod(shape[a] for a in r) > 1 and math.prod(shape[a] for a in c) > 1


def _normalize_axes(ndim: int, dims: MatrixDims) -> tuple[tuple[int, ...], tuple[int, ...]]:
  r, c = _as_axes(dims.rows), _as_axes(dims.cols)
  if not r or not c:
    raise ValueError(f"{dims}: rows and cols each need at least one axis")
  for a in r + c:
    if not -ndim <= a < ndim:
      raise ValueError(f"{dims} out of range for a leaf with {ndim} dims")
  r, c = tuple(a % ndim for a in r), tuple(a % ndim for a in c)
  if len(set(r + c)) != len(r + c):
    raise ValueError(f"MatrixDims rows and cols must differ (no axis twice), got {dims}")
  return r, c


def matrix_view(shape: Sequence[int], dims: Optional[MatrixDims] = None, *,
                smaller_first: bool = False, larger_first: bool = False,
                what: str = "this block") -> MatrixView:
  """Builds the :class:`MatrixView` of a leaf, or raises a clear ``ValueError``.

  Args:
    shape: the leaf's shape.
    dims: its matrix axes (default: the last two).
    smaller_first: transpose tall matrices so the canonical ``m <= n``.
    larger_first: transpose wide and square matrices so the canonical ``m >= n`` and its
      rows are the other side than ``smaller_first``'s (a low-rank block
      acting on the larger side, e.g. the right basis of :func:`fisher_optax.alice_soap`).
    what: name used in the error message.
  """
  shape = tuple(int(s) for s in shape)
  if isinstance(dims, NotAMatrix):
    raise ValueError(f"{what} got a leaf of shape {shape} whose dims say NOT_A_MATRIX; "
                     "route it to the fallback with `mask=` (the named optimizers do).")
  if len(shape) < 2:
    raise ValueError(
        f"{what} works on matrices (ndim >= 2) but got a leaf of shape {shape}. "
        "Route vectors and scalars elsewhere with `mask=` (the named optimizers "
        "send them to Adam by default).")
  r, c = _normalize_axes(len(shape), dims or MatrixDims())
  fan_in, fan_out = math.prod(shape[a] for a in r), math.prod(shape[a] for a in c)
  if smaller_first and larger_first:
    raise ValueError("smaller_first and larger_first exclude each other")
  # square: smaller = rows, larger = columns, so the two choices always pick different sides
  transpose = (smaller_first and fan_in > fan_out) or (larger_first and fan_in <= fan_out)
  return MatrixView(shape=shape, rows=r, cols=c, transpose=transpose)


def resolve_dims(dims: DimsSpec, tree: Any) -> Any:
  """Returns a tree (structure of ``tree``) of :class:`MatrixDims` or ``None`` leaves."""
  if dims is None or isinstance(dims, MatrixDims):
    d = dims or MatrixDims()
    return jax.tree.map(lambda _: d, tree)
  if isinstance(dims, DimsRule):
    dims = dims.resolve(tree)
  elif callable(dims):
    dims = dims(tree)
  # ``dims`` is a prefix of ``tree``: inside ``optax.partition`` the leaves routed elsewhere
  # are ``MaskedNode``s (no leaves), while ``dims`` may hold ``None`` for them.
  return jax.tree.map(lambda d, sub: jax.tree.map(lambda _: d or MatrixDims(), sub), dims, tree,
                      is_leaf=lambda x: x is None or isinstance(x, MatrixDims))


def views_like(tree: Any, dims: DimsSpec, *, smaller_first: bool, what: str,
               larger_first: bool = False) -> Any:
  """A tree of :class:`MatrixView` (as static python objects) for every array leaf."""
  dims_tree = resolve_dims(dims, tree)
  return jax.tree.map(
      lambda x, d: matrix_view(x.shape, d, smaller_first=smaller_first,
                               larger_first=larger_first, what=what),
      tree, dims_tree)


def vmap_batch(fn: Callable[..., Any], nbatch: int) -> Callable[..., Any]:
  """Maps ``fn`` (written for one matrix) over ``nbatch`` leading batch axes."""
  for _ in range(nbatch):
    fn = jax.vmap(fn)
  return fn



def _members(groups: Sequence[Any]) -> dict:
  """``{key: [indices with that key]}`` for a list of static keys, in first-seen order."""
  members: dict = {}
  for i, key in enumerate(groups):
    members.setdefault(key, []).append(i)
  return members


def vmap_grouped_starts(shapes: Sequence[Sequence[int]], groups: Sequence[Any]) -> list:
  """Per leaf of :func:`vmap_grouped` (its argument's shape), the offset of its elements
  in its group's concatenation (static ints)."""
  starts = [0] * len(shapes)
  for idx in _members(groups).values():
    offset = 0
    for i in idx:
      starts[i] = offset
      offset += math.prod(shapes[i])
  return starts


def vmap_grouped(fn: Callable[[Any], Callable[[jax.Array], Any]], args: Sequence[jax.Array],
                 groups: Sequence[Any]) -> list:
  """``fn(group)`` (a function of one element) over every element of every ``args[i]``,
  one ``vmap`` call per distinct static ``groups[i]`` (e.g. an output shape).

  Returns, per leaf, an array of shape ``args[i].shape + out_shape``, equal to
  ``vmap``-ing ``fn(groups[i])`` over that leaf alone. For per-matrix random draws:
  a threefry hash compiles into one large kernel (~0.2 s of XLA:CPU compile each), so
  drawing leaf by leaf makes compile time grow with depth; grouped, it grows with the
  number of distinct shapes.

  The results are split with static slices (see :func:`map_grouped`).
  """
  out: list = [None] * len(args)
  starts = vmap_grouped_starts([jnp.shape(a) for a in args], groups)
  for key, idx in _members(groups).items():
    flat = jnp.concatenate([jnp.reshape(args[i], (-1,)) for i in idx])
    res = jax.vmap(fn(key))(flat)
    for i in idx:
      size = math.prod(jnp.shape(args[i]))
      part = res if len(idx) == 1 else res[starts[i]:starts[i] + size]
      out[i] = jnp.reshape(part, jnp.shape(args[i]) + res.shape[1:])
  return out


def shared(fn: Callable[..., Any], static_argnums=()) -> Callable[..., Any]:
  """``fn`` (one leaf's or one matrix's computation) under ``jax.jit``, for a block to
  call on every leaf of a tree: JAX traces and lowers it once per distinct argument
  shape (the 130M LLaMA's 84 matrices have 4 shapes) and emits a call per leaf, where
  calling ``fn`` itself traced it again for every leaf, so tracing, lowering and XLA's
  passes grew with depth. XLA inlines the calls: the computation is the same.
  Closures over traced values (``optax.inject_hyperparams``) are allowed;
  ``static_argnums`` as for ``jax.jit`` (e.g. a :class:`MatrixView`)."""
  return jax.jit(fn, static_argnums=static_argnums)


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
    gcs: with ``canonical=True``, the leaves as canonical ``batch + (m, n)`` float32
      arrays.
    views: one :class:`MatrixView` per leaf (``None`` for a leaf of ndim < 2 when
      ``vectors=True``).

  Args:
    tree: the parameters (at ``init``) or updates (at ``update``).
    dims: matrix axes per leaf (:data:`DimsSpec`).
    side: ``None`` (rows/cols as ``dims`` say), ``"smaller"`` or ``"larger"`` first.
    what: the block's name, for error messages.
    canonical: compute :attr:`gcs` (at ``update``; at ``init`` the parameters need no
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
    self.gcs = ([_canonical_f32(g, v) for g, v in zip(self.leaves, self.views)]
                if canonical else None)

  def flat(self, tree: Any) -> list:
    """A tree of the same structure (e.g. a state field) -> its leaves in order."""
    return self.treedef.flatten_up_to(tree)

  def un(self, leaves: Sequence[Any]) -> Any:
    """Per-leaf values -> a tree of the lifted tree's structure."""
    return self.treedef.unflatten(list(leaves))

  def per_view(self, fn: Callable[["MatrixView"], Any]) -> Any:
    """A tree of ``fn(view)`` per leaf (state arrays at ``init``; ``fn`` may return
    ``None`` for an unused field)."""
    return self.un([fn(v) for v in self.views])

  def per_matrix(self, fn: Callable[..., Any], *cols: Sequence[Any]) -> list:
    """``fn`` (written for one matrix) on every leaf, ``vmap``-ed over its batch axes;
    ``cols`` are per-leaf argument lists (e.g. :attr:`gcs`, ``flat(state.s)``). ``fn`` is
    traced once per distinct argument shape (:func:`shared`)."""
    fn = shared(fn)
    return [vmap_batch(fn, len(v.batch_shape))(*xs) for v, *xs in zip(self.views, *cols)]

  def to_leaves(self, canonical: Sequence[jax.Array]) -> Any:
    """Canonical per-leaf arrays -> a tree in the leaves' layouts and dtypes."""
    return self.un([from_canonical_as(o, v, jnp.dtype(g.dtype))
                    for o, v, g in zip(canonical, self.views, self.leaves)])


def _groups(items: list) -> list:
  """Indices of ``items`` (argument tuples of arrays or shape-dtype structs) grouped by
  the shapes of their arguments after the stack axis, in first-seen order."""
  return list(_members([tuple(None if a is None else tuple(a.shape[1:]) for a in args)
                        for args in items]).values())


def _stack_size(args) -> int:
  return next(a.shape[0] for a in args if a is not None)


def group_starts(items: list) -> list:
  """Per item of :func:`map_grouped`'s ``items`` (arrays or ``jax.ShapeDtypeStruct``), its
  offset in its group's concatenation (static ints)."""
  starts = [0] * len(items)
  for members in _groups(items):
    offset = 0
    for j in members:
      starts[j] = offset
      offset += _stack_size(items[j])
  return starts


def map_grouped(fn, items: list) -> list:
  """``fn`` (written for one matrix) over many stacks of matrices, one call per shape.

  ``items``: a list of argument tuples, each argument an array ``(b_i,) + shape`` (a stack
  of ``b_i`` matrices; ``b_i`` may differ between items) or ``None``. Items whose
  arguments have the same shapes are concatenated along the stack axis and served by one
  :func:`fisher_optax.linalg.map_matrices` call (every layer's ``q_proj`` becomes one
  decomposition call, which keeps compile time flat in depth); the results are split
  back. Returns, per item, ``fn``'s output pytree with a leading axis ``b_i``.

  The results are split back with static slices.
  """
  # XLA:CPU note. A slice at a constant offset, fused with its neighbours, becomes a
  # kernel of its own per offset; dynamic_slice at offsets that are run-time parameters
  # shares one kernel per size. Offsets formed inside the step (constants behind
  # lax.optimization_barrier, or built from the step count) are folded back into
  # constants: only offsets held in the optimizer state avoided the per-offset kernels,
  # and the state holds statistics only. Measured effect of dropping the state-held
  # offsets, 60M LLaMA tree, `benchmarks/step_time.py --compile-only`, two rounds of two
  # each against the previous code on the same machine: Alice's update compiles in
  # 5.9-7.0 s instead of 4.2-4.6 s (optax.adam: ~1 s), APOLLO-mini's in 3.5-4.2 s instead
  # of 3.3-3.5 s. A CPU code-generation cost only; step time and the mathematics are
  # unchanged.
  out = [None] * len(items)
  starts = group_starts(items)
  for members in _groups(items):
    cat = [None if items[members[0]][a] is None
           else items[members[0]][a] if len(members) == 1
           else jnp.concatenate([items[j][a] for j in members], axis=0)
           for a in range(len(items[members[0]]))]
    res = linalg.map_matrices(fn, *cat)
    if len(members) == 1:
      out[members[0]] = res
      continue
    for j in members:
      size = _stack_size(items[j])
      out[j] = jax.tree.map(lambda o, s=starts[j], z=size: o[s:s + z], res)
  return out


def map_stateless(fn: Callable[[jax.Array, MatrixView], jax.Array], tree: Any, dims: DimsSpec,
                  *, side: Optional[str] = None, what: str) -> Any:
  """Applies ``fn(matrix_f32, view)`` (written for one canonical ``m x n`` matrix) to every
  leaf: canonical float32 layout, ``vmap`` over batch axes, back to the leaf's layout,
  cast (saturating) to the leaf's dtype. For stateless per-matrix blocks."""
  lv = Lifted(tree, dims, side=side, what=what, canonical=True)
  one = shared(lambda m, v: vmap_batch(lambda x: fn(x, v), len(v.batch_shape))(m),
               static_argnums=1)
  return lv.to_leaves([one(g, v) for v, g in zip(lv.views, lv.gcs)])
