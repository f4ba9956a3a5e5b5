"""Parameter routing: which leaves are matrices, how they are laid out, and masks.

SPEC.md ("Notation"): a matrix parameter ``W`` and its gradient ``G`` are ``m x n``.
The default mask takes only 2-D leaves as matrices (:func:`default_mask`); a leaf with
more dimensions that a mask or ``dims`` routes to a block is a *stack* of independent
matrices: by default every axis but the last two is a batch axis (scanned layers
``[layers, m, n]``), each slice with its own optimizer state. :class:`MatrixDims`
chooses other axes (as ``optax.contrib.muon``'s dimension numbers do).

Every structured block works on a *canonical view* of a leaf: an array of shape
``batch + (m, n)``. One-sided and low-rank blocks ask for ``smaller_first=True``,
which transposes tall matrices so that ``m <= n`` (the paper assumes ``m <= n``;
SPEC.md: "for m > n apply the same math to the transpose").
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax


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

DimsSpec = Union[None, MatrixDims, Any, Callable[[Any], Any]]

# Last path keys of parameters that are vectors, or stacks of vectors, whatever their
# shape: norm scales and biases (Flax, Haiku, Equinox names).
VECTOR_NAMES = ("bias", "scale", "gamma", "beta", "offset")


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
  """True when ``shape`` has matrix axes ``dims`` with both sizes > 1 (SPEC default mask)."""
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
  if callable(dims):
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


# ----------------------------------------------------------------------------- masks


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


_VECTOR_RE = re.compile(r"(^|[^a-z0-9])(" + "|".join(VECTOR_NAMES) + r")$")


def is_vector_name(path: Sequence[Any]) -> bool:
  """True when the leaf's last path key names a vector parameter: it is, or ends in
  ``_``/``.``/``-`` and, one of :data:`VECTOR_NAMES` (``bias``, ``ln_scale``, ...)."""
  s = path_to_str(path)
  return bool(s) and bool(_VECTOR_RE.search(s.rsplit("/", 1)[-1].lower()))


def default_mask(params: Any, dims: DimsSpec = None) -> Any:
  """Default routing: a leaf gets the structured rule when its matrix axes both have size
  > 1, its dims entry is not :data:`NOT_A_MATRIX`, and its name is not a vector's
  (``bias``, ``scale``, ``ln_scale``, ...: :data:`VECTOR_NAMES`), so layer-stacked norm
  scales ``[L, n]`` and attention biases ``(heads, head_dim)`` go to the fallback.

  Without ``dims`` only 2-D leaves are matrices, as ``optax.contrib.muon``'s default: a
  leaf with more dims is a layer stack ``(L, in, out)``, an attention kernel ``(in,
  heads, head_dim)`` or a conv kernel ``(kh, kw, cin, cout)`` and its shape cannot tell
  which, so it goes to the fallback (``fo.describe`` says so); ``dims`` (e.g.
  ``fo.flax_dims(model)`` or ``fo.MatrixDims()`` for stacks) routes it. Python scalars
  are never matrices. Pass an explicit ``mask`` to override."""
  dims_tree = resolve_dims(dims, params)
  check_dims(params, dims_tree, explicit=dims is not None)

  def one(path, p, d):
    shape = jnp.shape(p)
    if dims is None and len(shape) > 2:
      return False
    return is_matrix_shape(shape, d) and not is_vector_name(path)

  return jax.tree_util.tree_map_with_path(one, params, dims_tree)


def check_dims(params: Any, dims_tree: Any, *, explicit: bool = True) -> None:
  """Raises a ``ValueError`` naming the leaf when ``dims`` do not fit a leaf of ndim >= 2
  (a single ``MatrixDims`` is checked on every such leaf, a tree or callable per leaf)."""
  if not explicit:
    return

  def one(path, p, d):
    shape = jnp.shape(p)
    if len(shape) < 2 or isinstance(d, NotAMatrix):
      return
    try:
      _normalize_axes(len(shape), d)
    except ValueError as e:
      raise ValueError(f"`dims` for leaf {path_to_str(path)!r} of shape {tuple(shape)}: "
                       f"{e}") from None

  jax.tree_util.tree_map_with_path(one, params, dims_tree)


def path_mask(*, exclude: Sequence[str] = (), include: Optional[Sequence[str]] = None,
              dims: DimsSpec = None, on_unmatched: str = "raise") -> Callable[[Any], Any]:
  """Mask from parameter-path regular expressions, for the named optimizers' ``mask=``.

  A leaf is selected (gets the structured rule) when it is a matrix (see
  :func:`default_mask`), its ``/``-joined path matches one of ``include`` (if
  given), and it matches none of ``exclude``. Example: send embeddings and the
  output layer to Adam in one line::

    fo.alice(1e-2, mask=fo.path_mask(exclude=["embed", "lm_head"]))

  A pattern that matches no parameter path raises a ``ValueError`` when the mask is
  evaluated (at ``init``), or warns / passes with ``on_unmatched="warn"`` / ``"ignore"``.
  Without ``dims`` here, the optimizer's ``dims`` decide what is a matrix.
  """
  if on_unmatched not in ("raise", "warn", "ignore"):
    raise ValueError(f"`on_unmatched` must be 'raise', 'warn' or 'ignore', got {on_unmatched!r}")
  inc = [re.compile(p) for p in include] if include is not None else None
  exc = [re.compile(p) for p in exclude]

  def mask_fn(params, optimizer_dims: DimsSpec = None):
    base = default_mask(params, dims if dims is not None else optimizer_dims)
    paths = [path_to_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    unmatched = [p.pattern for p in (inc or []) + exc if not any(p.search(s) for s in paths)]
    if unmatched and paths and on_unmatched != "ignore":
      msg = (f"fo.path_mask: pattern(s) {unmatched} match no parameter path (paths look like "
             f"{paths[:3]}); a typo would silently route the whole model elsewhere. Pass "
             "on_unmatched='warn' or 'ignore' if this is intended.")
      if on_unmatched == "raise":
        raise ValueError(msg)
      warnings.warn(msg, stacklevel=2)

    def pick(path, sel):
      s = path_to_str(path)
      if inc is not None and not any(p.search(s) for p in inc):
        return False
      return bool(sel) and not any(p.search(s) for p in exc)

    return jax.tree_util.tree_map_with_path(pick, base)

  mask_fn.takes_optimizer_dims = True
  return mask_fn


def resolve_mask(mask: Any, params: Any, dims: DimsSpec = None) -> Any:
  if mask is None:
    return default_mask(params, dims)
  if getattr(mask, "takes_optimizer_dims", False):
    return mask(params, dims)  # a path_mask without dims= uses the optimizer's
  if callable(mask):
    return mask(params)
  return mask


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


class InFloat32State(NamedTuple):
  inner_state: Any


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs ``inner`` in float32: its state is built from float32 copies of the params,
  updates (and params) are cast to float32 on the way in and back to their own dtype on
  the way out. ``optax.adam`` on float16 params otherwise keeps its second moment and
  ``eps = 1e-8`` in float16, where a zero gradient gives 0/0 and ``g^2`` overflows."""
  def to32(t):
    def one(x):
      x = jnp.asarray(x)  # Python scalars too, as optax.adam accepts them
      return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(one, t)

  def init_fn(params):
    return InFloat32State(inner.init(to32(params)))

  def update_fn(updates, state, params=None, **extra):
    new, inner_state = optax.with_extra_args_support(inner).update(
        to32(updates), state.inner_state, None if params is None else to32(params), **extra)
    new = jax.tree.map(lambda n, u: cast_like(n, jnp.result_type(u)), new, updates)
    return new, InFloat32State(inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class RoutedTransformation(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` that remembers its routing (``mask``,
  ``dims``, ``info``: the structured rule's name and rank) for :func:`fisher_optax.describe`.
  """


def route(structured: optax.GradientTransformation, *, mask: Any, dims: DimsSpec,
          fallback: optax.GradientTransformation, info: Optional[dict] = None
          ) -> optax.GradientTransformationExtraArgs:
  """Structured rule on the leaves selected by ``mask``, ``fallback`` on the rest.

  Built on ``optax.partition``; the label of a leaf is ``"structured"`` or
  ``"fallback"``.
  """

  def labels(params):
    sel = resolve_mask(mask, params, dims)
    return jax.tree.map(lambda s: "structured" if s else "fallback", sel)

  tx = optax.partition({"structured": structured, "fallback": fallback}, labels)
  out = RoutedTransformation(tx.init, tx.update)
  out.labels, out.dims, out.info = labels, dims, dict(info or {})
  return out


def map_stateless(fn: Callable[[jax.Array, MatrixView], jax.Array], tree: Any, dims: DimsSpec,
                  *, smaller_first: bool, what: str) -> Any:
  """Applies ``fn(matrix_f32, view)`` (written for one canonical ``m x n`` matrix) to every
  leaf: canonical float32 layout, ``vmap`` over batch axes, back to the leaf's layout,
  cast (saturating) to the leaf's dtype. For stateless per-matrix blocks."""
  views = views_like(tree, dims, smaller_first=smaller_first, what=what)

  def one(x, view):
    f = vmap_batch(lambda m: fn(m.astype(jnp.float32), view), len(view.batch_shape))
    return cast_like(view.from_canonical(f(view.to_canonical(x))), x.dtype)

  return jax.tree.map(one, tree, views)
