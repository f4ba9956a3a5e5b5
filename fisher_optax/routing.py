"""Parameter routing: which leaves get the structured rule, and the float32 wrapper.

The default mask takes only 2-D leaves as matrices (:func:`default_mask`); ``dims``
(:class:`~fisher_optax.matrices.MatrixDims`, e.g. from :func:`fisher_optax.flax_dims`)
routes stacks, attention and conv kernels; :func:`path_mask` selects by parameter path;
:func:`route` sends the selected leaves to the structured rule and the rest to the
fallback (``optax.partition``). How a routed leaf becomes ``m x n`` matrices is
:mod:`fisher_optax.matrices`.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from fisher_optax import init_records
from fisher_optax.lifting import cast_like
from fisher_optax.parallel import owners, variables
from fisher_optax.matrices import (DimsRule, DimsSpec, MatrixDims, NotAMatrix, Unclassified,
                                   check_prefix, is_matrix_shape, normalize_axes, path_to_str)
from fisher_optax.model_dims import as_dims, resolve_dims

# Last path keys of parameters that are vectors, or stacks of vectors, whatever their
# shape: norm scales and biases (Flax, Haiku, Equinox names).
VECTOR_NAMES = ("bias", "scale", "gamma", "beta", "offset")


class FallbackWarning(UserWarning):
  """Warned by ``init`` when weight kernels reach the fallback without being sent there:
  leaves with more than two axes and no ``dims`` to read them, or leaves a model rule
  could not classify. Make it an error in CI with
  ``warnings.simplefilter("error", fo.FallbackWarning)`` or pytest's
  ``-W error::fisher_optax.FallbackWarning``."""


# ----------------------------------------------------------------------------- masks


_VECTOR_RE = re.compile(r"(^|[^a-z0-9])(" + "|".join(VECTOR_NAMES) + r")$")


def is_vector_name(path: Sequence[Any]) -> bool:
  """True when the leaf's last path key names a vector parameter: it is, or ends in
  ``_``/``.``/``-`` and, one of ``VECTOR_NAMES`` (``bias``, ``ln_scale``, ...)."""
  s = path_to_str(path)
  return bool(s) and bool(_VECTOR_RE.search(s.rsplit("/", 1)[-1].lower()))


def default_mask(params: Any, dims: DimsSpec = None) -> Any:
  """Default routing: a leaf gets the structured rule when its matrix axes both have size
  > 1, its dims entry is not :data:`NOT_A_MATRIX`, and its name is not a vector's
  (``bias``, ``scale``, ``ln_scale``, ...: ``VECTOR_NAMES``), so layer-stacked norm
  scales ``[L, n]`` and attention biases ``(heads, head_dim)`` go to the fallback.

  Without ``dims`` only 2-D leaves are matrices, as ``optax.contrib.muon``'s default: a
  leaf with more dims is a layer stack ``(L, in, out)``, an attention kernel ``(in,
  heads, head_dim)`` or a conv kernel ``(kh, kw, cin, cout)`` and its shape cannot tell
  which, so it goes to the fallback (``fo.describe`` says so); ``dims`` (e.g.
  ``fo.flax_dims(model)`` or ``fo.MatrixDims()`` for stacks) routes it. Python scalars
  are never matrices. Pass an explicit ``mask`` to override."""
  check_dims(params, dims)
  dims_tree = resolve_dims(dims, params)

  def one(path, p, d):
    shape = jnp.shape(p)
    if dims is None and len(shape) > 2:
      return False
    return is_matrix_shape(shape, d) and not is_vector_name(path)

  return jax.tree_util.tree_map_with_path(one, params, dims_tree)


def _given_dims(dims: DimsSpec, params: Any) -> Any:
  """``dims`` as given per leaf of ``params`` (``None`` where a tree holds ``None``),
  without the default that :func:`resolve_dims` fills in."""
  dims = as_dims(dims)
  if isinstance(dims, DimsRule):
    dims = dims.resolve(params)
  elif callable(dims):
    dims = dims(params)
  is_dims = lambda x: x is None or isinstance(x, MatrixDims)  # noqa: E731
  check_prefix(dims, params, "`dims`", is_leaf=is_dims)
  return jax.tree.map(lambda d, sub: jax.tree.map(lambda _: d, sub), dims, params,
                      is_leaf=is_dims)


def check_dims(params: Any, dims: DimsSpec) -> None:
  """Raises a ``ValueError`` naming the leaf when ``dims`` do not fit it: axes out of
  range on a leaf of ndim >= 2, or a :class:`MatrixDims` given for that very leaf (a
  tree or rule entry, not one ``MatrixDims`` for all) of ndim < 2. ``None`` and
  :data:`NOT_A_MATRIX` entries fit every leaf."""
  dims = as_dims(dims)
  if dims is None:
    return
  per_leaf = not isinstance(dims, MatrixDims)
  given = _given_dims(dims, params) if per_leaf else jax.tree.map(lambda _: dims, params)

  def one(path, p, d):
    shape = jnp.shape(p)
    if d is None or isinstance(d, NotAMatrix):
      return
    if len(shape) < 2:
      if per_leaf:
        raise ValueError(f"`dims` for leaf {path_to_str(path)!r} of shape {tuple(shape)}: "
                         f"{d} needs a leaf with two or more axes; give it None or "
                         "fo.NOT_A_MATRIX to send it to the fallback")
      return
    try:
      normalize_axes(len(shape), d)
    except ValueError as e:
      raise ValueError(f"`dims` for leaf {path_to_str(path)!r} of shape {tuple(shape)}: "
                       f"{e}") from None

  jax.tree_util.tree_map_with_path(one, params, given)


@dataclasses.dataclass(frozen=True)
class PathMask:
  """A ``mask=`` rule from parameter-path regular expressions (built by
  :func:`path_mask`).

  Not a Python callable, so it passes through ``optax.inject_hyperparams`` (which takes
  callables for schedules) unchanged; :meth:`~fisher_optax.PathMask.resolve` evaluates it.
  """

  include: Optional[tuple] = None
  exclude: tuple = ()
  dims: DimsSpec = None
  on_unmatched: str = "raise"

  def resolve(self, params: Any, optimizer_dims: DimsSpec = None) -> Any:
    """A tree of bools over ``params``: the leaves that get the structured rule.
    Without its own ``dims``, ``optimizer_dims`` (the optimizer's) decide what is a
    matrix."""
    base = default_mask(params, self.dims if self.dims is not None else optimizer_dims)
    inc = [re.compile(p) for p in self.include] if self.include is not None else None
    exc = [re.compile(p) for p in self.exclude]
    paths = [path_to_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    unmatched = [p.pattern for p in (inc or []) + exc if not any(p.search(s) for s in paths)]
    if unmatched and paths and self.on_unmatched != "ignore":
      msg = (f"fo.path_mask: pattern(s) {unmatched} match no parameter path (paths look like "
             f"{paths[:3]}); a typo would silently route the whole model elsewhere. Pass "
             "on_unmatched='warn' or 'ignore' if this is intended.")
      if self.on_unmatched == "raise":
        raise ValueError(msg)
      warnings.warn(msg, stacklevel=2)

    def pick(path, sel):
      s = path_to_str(path)
      if inc is not None and not any(p.search(s) for p in inc):
        return False
      return bool(sel) and not any(p.search(s) for p in exc)

    return jax.tree_util.tree_map_with_path(pick, base)


def path_mask(*, exclude: Sequence[str] = (), include: Optional[Sequence[str]] = None,
              dims: DimsSpec = None, on_unmatched: str = "raise") -> PathMask:
  """Mask from parameter-path regular expressions, for the named optimizers' ``mask=``.

  A leaf is selected (gets the structured rule) when it is a matrix (see
  :func:`default_mask`), its ``/``-joined path matches one of ``include`` (if
  given), and it matches none of ``exclude``. Example: send embeddings and the
  output layer to Adam in one line::

    fo.alice(1e-2, mask=fo.path_mask(exclude=["embed", "lm_head"]))

  A pattern that matches no parameter path raises a ``ValueError`` when the mask is
  evaluated (at ``init``), or warns / passes with ``on_unmatched="warn"`` / ``"ignore"``
  (``"ignore"`` for code meant for models that may lack those parameters).
  Without ``dims`` here, the optimizer's ``dims`` decide what is a matrix.
  ``PathMask.resolve(params)`` evaluates the mask.
  """
  if on_unmatched not in ("raise", "warn", "ignore"):
    raise ValueError(f"`on_unmatched` must be 'raise', 'warn' or 'ignore', got {on_unmatched!r}")
  if isinstance(exclude, str) or isinstance(include, str):
    raise TypeError("fo.path_mask: `exclude` and `include` take a list of patterns, e.g. "
                    "exclude=['embed'], not a string")
  if not exclude and include is None and dims is None:
    raise ValueError("fo.path_mask() with no patterns selects what the default mask does: "
                     "give exclude=[...] or include=[...], or pass mask=None to the "
                     "optimizer for the default")
  for p in list(exclude) + list(include or ()):
    re.compile(p)  # a malformed pattern fails here, not at init
  return PathMask(include=None if include is None else tuple(include), exclude=tuple(exclude),
                  dims=dims, on_unmatched=on_unmatched)


def resolve_mask(mask: Any, params: Any, dims: DimsSpec = None) -> Any:
  if mask is None:
    return default_mask(params, dims)
  if isinstance(mask, PathMask):
    return mask.resolve(params, dims)  # a path_mask without dims= uses the optimizer's
  if callable(mask):
    mask = mask(params)
  check_prefix(mask, params, "`mask`")
  return mask


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


@dataclasses.dataclass(frozen=True)
class RoutedInit:
  """What one routed transformation's ``init`` saw, for :func:`fisher_optax.describe`.

  Attributes:
    routed: the transformation.
    params: the params tree it was given, as ``jax.ShapeDtypeStruct`` leaves (inside an
      ``optax.partition`` or ``optax.masked``, leaves routed elsewhere are
      ``optax.MaskedNode``).
    labels: ``"structured"``/``"fallback"`` per leaf of ``params``.
    state: its state, as ``jax.ShapeDtypeStruct`` leaves.
  """

  routed: RoutedTransformation
  params: Any
  labels: Any
  state: Any


_ROUTED_INITS = init_records.Records()


def record_routed_inits():
  """Within the block, every routed transformation's ``init`` -- however deeply it sits
  in ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
  ``optax.partition``... -- appends a :class:`RoutedInit` to the yielded list. This is
  how :func:`fisher_optax.describe` sees through wrappers whose closures hide their
  inner transformations: it traces ``tx.init`` with ``jax.eval_shape`` in this block."""
  return _ROUTED_INITS.recording()


def _shape_struct(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def route(structured: optax.GradientTransformation, *, mask: Any, dims: DimsSpec,
          fallback: optax.GradientTransformation, info: Optional[dict] = None
          ) -> optax.GradientTransformationExtraArgs:
  """Structured rule on the leaves selected by ``mask``, ``fallback`` on the rest.

  Built on ``optax.partition``; the label of a leaf is ``"structured"`` or
  ``"fallback"``. The named optimizers pass a structured rule already wrapped in
  :func:`fisher_optax.with_auto_axes`, so that it runs on ``Auto`` axes under a context
  mesh with ``Explicit`` axes.
  """

  def labels(params):
    sel = resolve_mask(mask, params, dims)
    return jax.tree.map(lambda s: "structured" if s else "fallback", sel)

  tx = optax.partition({"structured": structured, "fallback": fallback}, labels)

  def init(params):
    if variables.has_variables(params):  # nnx.Optimizer: state leaves named by their shape
      pure = variables.unwrap(params)
      # the owner layout reads each matrix's split from its box's names (mesh axes, or
      # logical names under the logical axis rules in force)
      specs, mesh = variables.box_specs(params)
      with owners.reading_boxes(pure, specs, mesh, variables.ruled_specs(specs)):
        state = init_arrays(pure, 4)
      return variables.name_state(out, state, params, pure, dims)
    specs, _ = variables.placed_specs(params)
    if specs is not None:
      # concrete arrays placed by NamedShardings (jax.device_put, a jitted function's
      # outputs): the owner layout reads each matrix's split from them, as from boxes
      with owners.reading_boxes(params, specs, None):
        return init_arrays(params, 4)
    return init_arrays(params, 4)

  def init_arrays(params, stacklevel):
    if dims is None and (mask is None or (isinstance(mask, PathMask) and mask.dims is None)):
      _warn_unrouted(params, (info or {}).get("name", "structured"), stacklevel, mask)
    _warn_unclassified(params, dims, labels(params), (info or {}).get("name", "structured"),
                       stacklevel)
    state = tx.init(params)
    _ROUTED_INITS.add(lambda: RoutedInit(out, _shape_struct(params), labels(params),
                                         _shape_struct(state)))
    return state

  name = (info or {}).get("name", "structured")

  def update(updates, state, params=None, **extra):
    if any(map(variables.has_variables, (updates, state, params))):
      # trees of nnx.Variables given by hand (nnx.Optimizer passes arrays): the update runs
      # on their values and returns updates and state wrapped as they came
      new, new_state = update(*map(variables.unwrap, (updates, state, params)), **extra)
      return variables.rewrap_like(updates, new), variables.rewrap_like(state, new_state)
    check_state(tx.init, updates, state, name)
    return tx.update(updates, state, params, **extra)

  out = RoutedTransformation(init, update)
  out.labels, out.dims, out.info = labels, dims, dict(info or {})
  return out


def _warn_unrouted(params: Any, name: str, stacklevel: int = 3,
                   mask: Optional["PathMask"] = None) -> None:
  """Warns when the default routing sends weight kernels to the fallback: leaves with more
  than two dims (not a bias's or norm scale's name) and no ``dims`` to say which axes are
  the matrix, unless a ``fo.path_mask`` excluded them by name. They then train with the
  fallback's Adam at the fallback's learning rate, by default the structured rule's,
  which is scaled for a unit-RMS direction and can be far above Adam's usable range."""
  def excluded(path: str) -> bool:  # sent to the fallback on purpose, by a pattern
    if mask is None:
      return False
    if mask.include is not None and not any(re.search(p, path) for p in mask.include):
      return True
    return any(re.search(p, path) for p in mask.exclude)

  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  kernels = [(path_to_str(p), tuple(jnp.shape(x))) for p, x in flat
             if len(jnp.shape(x)) > 2 and not is_vector_name(p)
             and not excluded(path_to_str(p))]
  if kernels:
    path, shape = kernels[0]
    warnings.warn(
        f"fo.{name}: {len(kernels)} {'leaf' if len(kernels) == 1 else 'leaves'} with more "
        f"than two dims (e.g. {path!r} of shape "
        f"{shape}) go to the fallback, since no dims= says which of their axes form the "
        "matrix (a layer stack, an attention and a conv kernel look alike). Route them "
        "with dims=fo.flax_dims(model) (NNX), fo.linen_dims(module, x) (Linen), "
        "fo.equinox_dims(model) (Equinox), fo.haiku_dims(params) (Haiku) or "
        "fo.MatrixDims(...); or pass mask= to keep "
        "them on the fallback on purpose, with fallback_learning_rate= at Adam's own rate.",
        FallbackWarning, stacklevel=stacklevel)


def _warn_unclassified(params: Any, dims: DimsSpec, labels: Any, name: str,
                       stacklevel: int = 3) -> None:
  """Warns when leaves that a model rule could not classify (``fo.Unclassified``) go to
  the fallback: they are kernels it did not know, trained with Adam at the fallback's
  learning rate. The warning names them, why, and the fix."""
  if dims is None or isinstance(dims, MatrixDims):
    return
  dims_tree = resolve_dims(dims, params)
  flat = jax.tree_util.tree_flatten_with_path(
      dims_tree, is_leaf=lambda x: isinstance(x, MatrixDims))[0]
  lab = jax.tree.leaves(labels)
  found = [(path_to_str(p), d.reason) for (p, d), l in zip(flat, lab)
           if isinstance(d, Unclassified) and l == "fallback"]
  if found:
    listed = "; ".join(f"{p!r}: {why}" for p, why in found[:5])
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    warnings.warn(
        f"fo.{name}: {len(found)} {'leaf' if len(found) == 1 else 'leaves'} the dims rule "
        f"could not classify go to the fallback: {listed}{more}. Give their dims with the "
        "rule's overrides={path regex: fo.MatrixDims(rows=..., cols=...)}, or send them to "
        "the fallback on purpose with fo.NOT_A_MATRIX there.", FallbackWarning, stacklevel=stacklevel)


_GROUP_KEY = re.compile(r" \d+x\d+$")


def _stacked_layout(flat: list) -> bool:
  """Whether flattened state paths hold a :func:`fisher_optax.stacking.stack_matrices`
  state: its arrays sit under keys named ``"<path> <fan_in>x<fan_out>"``."""
  return any(isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)
             and _GROUP_KEY.search(k.key) for path, _ in flat for k in path)


def check_state(init: Callable[[Any], Any], updates: Any, state: Any, name: str) -> None:
  """Raises a ``ValueError`` naming the first state leaf that does not fit ``updates``
  (a state saved for another tree: other shapes, other leaf count), by comparing
  ``state`` with ``jax.eval_shape(init, updates)`` when tracing (no run-time cost)."""
  masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731  (a leaf routed elsewhere)
  want = jax.tree_util.tree_flatten_with_path(jax.eval_shape(init, updates), is_leaf=masked)[0]
  got = jax.tree_util.tree_flatten_with_path(state, is_leaf=masked)[0]
  stacked_want, stacked_got = _stacked_layout(want), _stacked_layout(got)
  if stacked_want != stacked_got:
    layout = lambda st: "stacked (stack_matrices=True)" if st else "per-leaf (stack_matrices=False)"  # noqa: E731
    raise ValueError(
        f"{name}: the optimizer state is in the {layout(stacked_got)} layout, this optimizer "
        f"uses the {layout(stacked_want)} layout. The default stack_matrices='auto' stacks "
        "on GPU and TPU and not on CPU, so a state saved on one backend does not fit an "
        f"optimizer built on the other: build it with stack_matrices={stacked_got} to "
        "continue this state (same updates, either layout runs on every backend), or "
        "convert the state with fo.convert_state_layout(state, optimizer, params).")
  for (pw, w), (pg, g) in zip(want, got):
    if pw != pg or masked(w) != masked(g):
      raise ValueError(f"{name}: the optimizer state does not fit these updates: the state "
                       f"has {jax.tree_util.keystr(pg)} where the updates' tree needs "
                       f"{jax.tree_util.keystr(pw)} (a state from another parameter tree?)")
    if not masked(w) and tuple(jnp.shape(g)) != tuple(w.shape):
      raise ValueError(f"{name}: the optimizer state does not fit these updates: state leaf "
                       f"{jax.tree_util.keystr(pg)} has shape {tuple(jnp.shape(g))}, the "
                       f"updates need {tuple(w.shape)} (a state from another parameter "
                       "tree?)")
  if len(want) != len(got):
    extra = (got if len(got) > len(want) else want)[min(len(want), len(got))][0]
    raise ValueError(f"{name}: the optimizer state does not fit these updates: the state "
                     f"has {len(got)} arrays, the updates' tree needs {len(want)} (first "
                     f"unmatched: {jax.tree_util.keystr(extra)}; a state from another "
                     "parameter tree?)")
