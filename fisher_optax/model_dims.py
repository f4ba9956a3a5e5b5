"""``dims=`` rules read from a model or from another library: :class:`ModelDims` (a
table by parameter path, the base of :func:`~fisher_optax.flax_dims`,
:func:`~fisher_optax.linen_dims`, :func:`~fisher_optax.equinox_dims` and
:func:`~fisher_optax.haiku_dims`), their ``overrides`` (:func:`apply_overrides`), the
matrix view of an einsum weight (:func:`einsum_dims`), and trees of
``optax.contrib.MuonDimensionNumbers`` (:func:`as_dims`, :class:`MuonDims`); and
:func:`resolve_dims`, which turns any ``dims=`` into a tree of
:class:`~fisher_optax.MatrixDims`."""

from __future__ import annotations

import re
from typing import Any, Optional

import jax

from fisher_optax.matrices import (NOT_A_MATRIX, DimsRule, DimsSpec, MatrixDims, NotAMatrix,
                                   Unclassified, check_prefix, normalize_axes, path_to_str)


class ModelDims(DimsRule):
  """A ``dims=`` rule read from a model: a table ``{"/"-joined parameter path: dims}``
  (built by :func:`~fisher_optax.flax_dims`, :func:`~fisher_optax.linen_dims` or
  :func:`~fisher_optax.equinox_dims`).

  :meth:`resolve` maps any tree whose paths are the model's parameter paths -- the
  parameter tree itself, its pure-dict form, a Linen ``{"params": ...}`` variables
  dict, or the masked trees inside ``optax.partition`` -- to the dims of its leaves.

  Attributes:
    table: ``{path: MatrixDims, NOT_A_MATRIX or Unclassified}``.
  """

  helper = "the model rule"

  def __init__(self, table: dict):
    self.table = dict(table)

  def lookup(self, key: str):
    """The dims of the parameter at path ``key``, or a ``ValueError`` naming it."""
    if key in self.table:
      return self.table[key]
    if key.startswith("params/") and key[len("params/"):] in self.table:
      return self.table[key[len("params/"):]]  # a Linen variables dict
    raise ValueError(f"{self.helper}: leaf {key!r} is not a parameter of the model it "
                     f"was built from (its parameters look like {sorted(self.table)[:3]}); "
                     "build the rule from the model whose parameters you optimize")

  def resolve(self, tree: Any) -> Any:
    """The dims of every leaf of ``tree`` (a ``ValueError`` names an unknown leaf)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: self.lookup(path_to_str(p)), tree)

  @property
  def unclassified(self) -> dict:
    """``{path: reason}`` of the parameters the rule could not classify."""
    return {k: v.reason for k, v in self.table.items() if isinstance(v, Unclassified)}

  def __repr__(self):
    return f"{type(self).__name__}({len(self.table)} parameters)"


def apply_overrides(table: dict, overrides: Optional[dict], helper: str,
                    ndims: Optional[dict] = None, on_unmatched: str = "raise") -> dict:
  """``table`` with ``overrides`` (``{path regex: MatrixDims or NOT_A_MATRIX}``, the first
  pattern that ``re.search``-es a path wins) applied.

  A pattern that matches no path raises a ``ValueError`` (a typo would silently leave the
  rule unchanged), or warns / passes with ``on_unmatched="warn"`` / ``"ignore"`` (one
  overrides dict for several models). With ``ndims`` (``{path: number of axes}``), an
  override that does not fit a leaf it matches -- axes out of range, or an
  :class:`Unclassified` such as :func:`einsum_dims` gives for a spec of another rank --
  raises a ``ValueError`` naming the leaf."""
  if on_unmatched not in ("raise", "warn", "ignore"):
    raise ValueError(f"{helper}: `on_unmatched` must be 'raise', 'warn' or 'ignore', got "
                     f"{on_unmatched!r}")
  if not overrides:
    return dict(table)
  out = dict(table)
  compiled = [(re.compile(p), d) for p, d in overrides.items()]
  for pat, d in compiled:
    if not isinstance(d, MatrixDims):
      raise TypeError(f"{helper}: overrides[{pat.pattern!r}] must be a fo.MatrixDims or "
                      f"fo.NOT_A_MATRIX, got {d!r}")
    if not any(pat.search(k) for k in table) and on_unmatched != "ignore":
      msg = (f"{helper}: overrides pattern {pat.pattern!r} matches no parameter path "
             f"(paths look like {sorted(table)[:3]})")
      if on_unmatched == "raise":
        raise ValueError(msg + "; pass on_unmatched='warn' or 'ignore' if this is intended")
      import warnings
      warnings.warn(msg, UserWarning, stacklevel=3)
  for k in table:
    for pat, d in compiled:
      if pat.search(k):
        _check_override(k, d, pat.pattern, helper, None if ndims is None else ndims.get(k))
        out[k] = d
        break
  return out


def _check_override(path: str, d: MatrixDims, pattern: str, helper: str,
                    ndim: Optional[int]) -> None:
  where = f"{helper}: overrides[{pattern!r}] for leaf {path!r}"
  if isinstance(d, Unclassified):
    raise ValueError(f"{where} does not fit it: {d.reason}")
  if ndim is None or isinstance(d, NotAMatrix):
    return
  if ndim < 2:
    raise ValueError(f"{where}: {d} needs a leaf with two or more axes, this one has {ndim}")
  try:
    normalize_axes(ndim, d)
  except ValueError as e:
    raise ValueError(f"{where} of {ndim} axes: {e}") from None


def _muon_dims_type() -> Optional[type]:
  import optax.contrib
  return getattr(optax.contrib, "MuonDimensionNumbers", None)


def _from_muon(d: Any, mdn: type) -> MatrixDims:
  """One ``optax.contrib.MuonDimensionNumbers`` (or ``None``) as a ``dims`` entry."""
  if d is None:
    return NOT_A_MATRIX
  if isinstance(d, mdn):
    return MatrixDims(rows=d.reduction_axis, cols=d.output_axis)
  return d


class MuonDims(ModelDims):
  """A ``dims=`` rule from a tree of ``optax.contrib.MuonDimensionNumbers`` (as
  ``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` and MaxText give it):
  reduction axes are the rows, output axes the columns, every other axis a batch axis
  (a layer axis in the middle, experts), and a ``None`` entry a leaf that is no matrix
  (:data:`NOT_A_MATRIX`, the fallback), as in optax. Built by :func:`as_dims`; keyed by
  parameter path like :class:`ModelDims`, so the tree may be a ``dict``, an
  ``nnx.State`` or a Linen ``{"params": ...}`` dict whatever the container of the
  parameters is."""

  helper = "dims from optax.contrib.MuonDimensionNumbers"


def as_dims(dims: Any) -> Any:
  """``dims`` with ``optax.contrib.MuonDimensionNumbers`` read as :class:`MatrixDims`: a
  tree of them (``None`` for the leaves that are no matrices) becomes a :class:`MuonDims`
  rule; a callable returning one returns the converted tree; one
  ``MuonDimensionNumbers`` for all leaves is one :class:`MatrixDims`. Every other
  ``dims`` is returned as it is."""
  mdn = _muon_dims_type()
  if mdn is None or dims is None or isinstance(dims, (MatrixDims, DimsRule)):
    return dims
  if isinstance(dims, mdn):
    return _from_muon(dims, mdn)
  if callable(dims):
    if getattr(dims, "_fo_muon_dims", False):
      return dims

    def converted(params):
      return _convert_muon_tree(dims(params), mdn)

    converted._fo_muon_dims = True  # type: ignore[attr-defined]
    return converted
  is_entry = lambda x: x is None or isinstance(x, (mdn, MatrixDims))  # noqa: E731
  flat = jax.tree_util.tree_flatten_with_path(dims, is_leaf=is_entry)[0]
  if not any(isinstance(d, mdn) for _, d in flat):
    return dims
  return MuonDims({path_to_str(p): _from_muon(d, mdn) for p, d in flat})


def _convert_muon_tree(tree: Any, mdn: type) -> Any:
  is_entry = lambda x: x is None or isinstance(x, (mdn, MatrixDims))  # noqa: E731
  if not any(isinstance(d, mdn) for d in jax.tree.leaves(tree, is_leaf=is_entry)):
    return tree
  return jax.tree.map(lambda d: _from_muon(d, mdn), tree, is_leaf=is_entry)


def einsum_dims(spec: str, ndim: int, operand: int = 1,
                shape: Optional[tuple] = None) -> MatrixDims:
  """The matrix view of the weight of a parametrized einsum (``nnx.Einsum``,
  ``linen.Einsum``, Gemma's ``Einsum``): ``spec`` such as ``"BTD,NDH->BTNH"``, the
  weight being operand ``operand`` (default the second) with ``ndim`` axes.

  Each weight axis is read from where its letter appears:

  * in the input and not the output: contracted, a **row** (fan-in) axis;
  * in the output and not the input: a **column** (fan-out) axis -- unless it comes, in
    the output, before every axis carried over from the input (Gemma's
    ``"BSD,CKDH->CBSKH"``: ``C`` stacks the key and value projections), then a
    **batch** axis: each index is an independent matrix;
  * in the input and the output: a **batch** axis (one matrix per index);
  * with ``shape`` (the weight's), a **stacked pair of projections**: the weight's first
    axis, of size 2, in the output only and not its only output axis -- Gemma's gating
    ``"...F,NFH->...NH"`` with ``(2, F, H)``, gate and up -- is a batch axis: two
    matrices, not one of twice the width (a 2-head projection written heads first,
    ``"BTD,NDH->BTNH"`` with ``N = 2``, then reads as two per-head matrices).

  Returns :data:`NOT_A_MATRIX` for a weight with no row or no column axis (a scale or a
  vector), and :class:`Unclassified` with the reason for a spec it cannot read (an
  ellipsis in the weight, a letter summed within the weight, a rank that does not match
  ``ndim``).
  """
  s = spec.replace(" ", "")
  bad = lambda why: Unclassified(f"einsum {spec!r}: {why}")  # noqa: E731
  if "->" in s:
    ins, out = s.split("->", 1)
  else:  # implicit output: the letters that appear once, in alphabetical order
    ins = s
    letters = ins.replace(",", "").replace(".", "")
    out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
  operands = ins.split(",")
  if len(operands) != 2 or operand not in (0, 1):
    return bad("the weight must be one of two operands")
  w, x = operands[operand], operands[1 - operand]
  if "." in w:
    return bad("an ellipsis in the weight's axes")
  if len(w) != ndim or len(set(w)) != len(w):
    return bad(f"the weight's axes {w!r} do not match its {ndim} dims")
  # an ellipsis stands for axes carried over from the input
  x, out = x.replace("...", "\0"), out.replace("...", "\0")
  from_input = [i for i, c in enumerate(out) if c in x]
  first_input = min(from_input) if from_input else len(out)
  rows, cols = [], []
  for a, c in enumerate(w):
    if c in x and c not in out:
      rows.append(a)
    elif c in out and c not in x:
      if out.index(c) > first_input:
        cols.append(a)
    elif c not in x and c not in out:
      return bad(f"axis {c!r} of the weight is summed within the weight")
  if (shape is not None and len(shape) == ndim and shape[0] == 2 and cols[:1] == [0]
      and len(cols) > 1):
    cols = cols[1:]  # gate and up stacked: two matrices
  if not rows or not cols:
    return NOT_A_MATRIX
  return MatrixDims(rows=tuple(rows), cols=tuple(cols))


def resolve_dims(dims: DimsSpec, tree: Any) -> Any:
  """Returns a tree (structure of ``tree``) of :class:`MatrixDims` or ``None`` leaves."""
  dims = as_dims(dims)
  if dims is None or isinstance(dims, MatrixDims):
    d = dims or MatrixDims()
    return jax.tree.map(lambda _: d, tree)
  if isinstance(dims, DimsRule):
    dims = dims.resolve(tree)
  elif callable(dims):
    dims = dims(tree)
  # ``dims`` is a prefix of ``tree``: inside ``optax.partition`` the leaves routed elsewhere
  # are ``MaskedNode``s (no leaves), while ``dims`` may hold ``None`` for them.
  is_dims = lambda x: x is None or isinstance(x, MatrixDims)  # noqa: E731
  check_prefix(dims, tree, "`dims`", is_leaf=is_dims)
  return jax.tree.map(lambda d, sub: jax.tree.map(lambda _: d or MatrixDims(), sub), dims, tree,
                      is_leaf=is_dims)
