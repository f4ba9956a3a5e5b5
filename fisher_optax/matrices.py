"""Matrix dimensions and views: which axes of a leaf are a matrix's rows and columns, and
the static map of a leaf to its canonical ``batch + (m, n)`` form.

Notation: a matrix parameter ``W`` and its gradient ``G`` are ``m x n``. A
leaf with more dimensions is a *stack* of independent matrices: by default every axis
but the last two is a batch axis (scanned layers ``[layers, m, n]``), each slice with its
own optimizer state; :class:`MatrixDims` chooses other axes (as ``optax.contrib.muon``'s
dimension numbers do), several axes may merge into one side.

:class:`MatrixView` / :func:`matrix_view` give a leaf's canonical form, optionally with the
smaller side as rows (``side="smaller"``, the paper's ``m <= n``: for ``m > n`` the same
math applies to the transpose) or the larger (``side="larger"``). Lifting a tree to
canonical float32 matrices and back is :mod:`fisher_optax.lifting`; serving same-shape
matrices of many leaves with one call is :mod:`fisher_optax.grouping`. Which leaves reach
a block is decided by :mod:`fisher_optax.routing` (masks).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

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


class Embedding(NotAMatrix):
  """A ``dims`` entry for the table of an embedding module (``nnx.Embed``, ``nn.Embed``,
  ``eqx.nn.Embedding``, ``hk.Embed``; also when tied as the output layer):
  :data:`EMBEDDING` is its instance. The model rules give it, so the table trains on the
  fallback, as the paper trains embeddings (Adam; App. "Experiment details"), and
  :func:`~fisher_optax.describe` labels the leaf. To train a table with the structured
  rule, give its path ``fo.MatrixDims()`` in the rule's ``overrides=``."""

  def __repr__(self):
    return "EMBEDDING"


EMBEDDING = Embedding()


class Unclassified(NotAMatrix):
  """A ``dims`` entry for a parameter whose matrix view a model rule could not tell
  (e.g. a 3-D parameter of a module :func:`~fisher_optax.flax_dims` does not know).

  It routes like :data:`NOT_A_MATRIX` (to the fallback), but
  :func:`~fisher_optax.describe` flags the leaf and prints ``reason``, so that no
  kernel goes to the fallback without a word. Give the leaf its dims with the rule's
  ``overrides=`` to route it.
  """

  def __init__(self, reason: str):
    super().__init__()
    object.__setattr__(self, "reason", str(reason))

  def __repr__(self):
    return f"Unclassified({self.reason!r})"

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


def path_to_str(path: Sequence[Any]) -> str:
  """``('layers', 0, 'attn', 'kernel')``-like key path -> ``'layers/0/attn/kernel'``."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
      continue  # the array inside a Flax ``Variable`` (nnx.State leaves)
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)



def as_axes(a: Axes) -> tuple[int, ...]:
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
    r, c = normalize_axes(len(shape), dims)
  except ValueError:
    return False
  return math.prod(shape[a] for a in r) > 1 and math.prod(shape[a] for a in c) > 1


def normalize_axes(ndim: int, dims: MatrixDims) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``dims``' row and column axes for a leaf of ``ndim`` axes, non-negative; raises a
  ``ValueError`` for an empty side, an axis out of range or one used twice."""
  r, c = as_axes(dims.rows), as_axes(dims.cols)
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
  r, c = normalize_axes(len(shape), dims or MatrixDims())
  fan_in, fan_out = math.prod(shape[a] for a in r), math.prod(shape[a] for a in c)
  if smaller_first and larger_first:
    raise ValueError("smaller_first and larger_first exclude each other")
  # square: smaller = rows, larger = columns, so the two choices always pick different sides
  transpose = (smaller_first and fan_in > fan_out) or (larger_first and fan_in <= fan_out)
  return MatrixView(shape=shape, rows=r, cols=c, transpose=transpose)


def check_prefix(given: Any, tree: Any, what: str, is_leaf: Optional[Callable] = None) -> None:
  """Raises a ``ValueError`` naming the first leaf of ``tree`` that ``given`` (a tree
  meant to be a prefix of it, e.g. a ``dims`` or ``mask`` tree) has no entry for, or the
  first entry of ``given`` that ``tree`` lacks; passes when ``given`` fits."""
  try:
    jax.tree.map(lambda *_: None, given, tree, is_leaf=is_leaf)
    return
  except (ValueError, TypeError, KeyError):
    pass
  entries = [path_to_str(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(given, is_leaf=is_leaf)[0]]
  leaves = [path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  under = lambda leaf, e: e == "" or leaf == e or leaf.startswith(e + "/")  # noqa: E731
  missing = next((leaf for leaf in leaves if not any(under(leaf, e) for e in entries)), None)
  extra = next((e for e in entries if not any(under(leaf, e) for leaf in leaves)), None)
  if missing is not None:
    raise ValueError(f"{what} does not match the params: it has no entry for the leaf "
                     f"{missing!r}" + (f" (and has {extra!r}, which the params lack)"
                                       if extra is not None else "")
                     + "; give one entry per parameter leaf, or a single value for all")
  if extra is not None:
    raise ValueError(f"{what} does not match the params: its entry {extra!r} is no "
                     "parameter leaf; give one entry per parameter leaf, or a single "
                     "value for all")
  raise ValueError(f"{what} does not have the structure of the params (its containers "
                   "differ, e.g. a tuple for a list or a dict for a Flax State): build it "
                   "with jax.tree.map over the params")
