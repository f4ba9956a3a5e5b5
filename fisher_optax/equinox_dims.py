"""Matrix views of an Equinox model's parameters: :func:`equinox_dims`.

Equinox stores weights as PyTorch does, ``(out, in)``: ``eqx.nn.Linear``'s weight is
``(out_features, in_features)`` and ``eqx.nn.Conv``'s ``(out, in / groups, *kernel)``.
Read as ``(in, out)`` -- the default of every ``dims``-less rule -- such a weight is
routed transposed: fan-in and fan-out swap, which changes the update of every method
that is not symmetric in them (Muon's shape factor, SOAP's and Alice's choice of side).
The rule here names the sides from the layer (rows = fan-in, columns = fan-out):

=========================================  =====================================
parameter                                  matrix (rows x cols)
=========================================  =====================================
``Linear`` weight ``(out, in)``            ``in x out``: ``MatrixDims(rows=-1, cols=-2)``
``Conv``/``ConvTranspose`` weight          ``in*k1*...*ks x out``
``(out, in, k1, ..., ks)``
``Embedding`` weight ``(vocab, features)`` ``EMBEDDING`` (fallback, as the paper)
biases, norm weights and biases            ``NOT_A_MATRIX``
``MultiheadAttention``                     its four ``Linear`` projections, as above
a 2-D array of another module              ``(out, in)``, as Equinox's own layers
an array with more dims of another module  ``Unclassified`` (fallback, flagged by
                                           ``describe``; set it with ``overrides=``)
=========================================  =====================================

Axes in front of a layer's own (a stack of layers made with ``eqx.filter_vmap``) are
batch axes: every index is an independent matrix. For weights ported from PyTorch into
any other container, the same view is ``dims=fo.MatrixDims(rows=-1, cols=-2)``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from fisher_optax import matrices, model_dims, routing

# rows = fan-in (last axis), cols = fan-out: the (out, in) layout
OUT_IN = matrices.MatrixDims(rows=-1, cols=-2)


class EquinoxDims(model_dims.ModelDims):
  """The ``dims=`` rule of one Equinox model (built by :func:`equinox_dims`).

  Attributes:
    table: ``{"/"-joined parameter path: MatrixDims, NOT_A_MATRIX or Unclassified}``.
  """

  helper = "fo.equinox_dims"


def _import_equinox():
  try:
    import equinox as eqx
  except ImportError as e:
    raise ImportError("fo.equinox_dims reads an Equinox model and needs equinox: "
                      "pip install equinox") from e
  return eqx


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  return None


def _owner(model: Any, path: tuple, module_type: type) -> tuple:
  """The last Equinox module on ``path`` from ``model`` and the leaf's attribute name."""
  node, owner = model, model if isinstance(model, module_type) else None
  for key in path[:-1]:
    node = _child(node, key)
    if node is None:
      break
    if isinstance(node, module_type):
      owner = node
  last = path[-1] if path else None
  return owner, getattr(last, "name", None)


def _leaf_dims(eqx, module: Any, name: Optional[str], path, ndim: int):
  nn = eqx.nn
  if isinstance(module, nn.Linear):
    return OUT_IN if name == "weight" and ndim >= 2 else matrices.NOT_A_MATRIX
  convs = tuple(getattr(nn, n) for n in ("Conv", "ConvTranspose") if hasattr(nn, n))
  if isinstance(module, convs):
    if name != "weight":
      return matrices.NOT_A_MATRIX
    s = module.num_spatial_dims
    if ndim < s + 2:
      return matrices.NOT_A_MATRIX
    return matrices.MatrixDims(rows=tuple(range(-s - 1, 0)), cols=-s - 2)
  if isinstance(module, nn.Embedding):
    return matrices.EMBEDDING if name == "weight" and ndim >= 2 else matrices.NOT_A_MATRIX
  norms = tuple(getattr(nn, n) for n in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")
                if hasattr(nn, n))
  if isinstance(module, norms) or ndim < 2 or routing.is_vector_name(path):
    return matrices.NOT_A_MATRIX
  if ndim == 2:
    return OUT_IN
  owner = type(module).__name__ if module is not None else "no module"
  return matrices.Unclassified(
      f"{ndim}-D array of {owner}, a module the rule does not know; give its dims with "
      "overrides={path regex: fo.MatrixDims(rows=..., cols=...)}")


def equinox_dims(model: Any, *, overrides: Optional[dict] = None,
                 on_unmatched: str = "raise") -> EquinoxDims:
  """The matrix view of every array of an Equinox ``model`` (Equinox's ``(out, in)``
  layouts: rows = fan-in, columns = fan-out), as a ``dims=`` rule.

  The rule maps any tree whose paths are the model's -- the model itself,
  ``eqx.filter(model, eqx.is_inexact_array)`` (what ``optimizer.init`` gets), the masked
  trees inside ``optax.partition`` -- to the dims of its leaves. Use it with the
  filtered params, as Equinox's optax examples do::

    params = eqx.filter(model, eqx.is_inexact_array)
    tx = fo.muon(2e-2, dims=fo.equinox_dims(model))
    state = tx.init(params)

  Args:
    model: an ``equinox.Module`` (or a pytree of them).
    overrides: ``{path regex: MatrixDims or NOT_A_MATRIX}`` over the layer rules (first
      matching pattern wins); an override that does not fit a leaf it matches raises a
      ``ValueError`` here.
    on_unmatched: a pattern of ``overrides`` that matches no path: ``"raise"``
      (default), ``"warn"`` or ``"ignore"``, as :func:`~fisher_optax.path_mask`'s.

  Raises:
    ImportError: equinox is not installed.
  """
  if isinstance(model, dict) or type(model).__name__ == "FrozenDict":
    raise TypeError(
        "fo.equinox_dims reads an Equinox model, not a parameter dict: a dict cannot tell "
        "a layer stack from an attention or conv kernel. For a Flax Linen model use "
        "fo.linen_dims(module, *example_inputs); for plain arrays (Haiku's params "
        "included) give fo.MatrixDims(...) per leaf (a tree of them)")
  eqx = _import_equinox()
  table, ndims = {}, {}
  for path, x in jax.tree_util.tree_flatten_with_path(model)[0]:
    if not eqx.is_array(x):
      continue
    module, name = _owner(model, path, eqx.Module)
    table[matrices.path_to_str(path)] = _leaf_dims(eqx, module, name, path, len(x.shape))
    ndims[matrices.path_to_str(path)] = len(x.shape)
  return EquinoxDims(model_dims.apply_overrides(table, overrides, "fo.equinox_dims", ndims,
                                              on_unmatched))
