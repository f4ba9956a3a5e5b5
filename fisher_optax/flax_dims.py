"""Matrix views of a Flax NNX model's parameters, read from its modules.

``fo.flax_dims(model)`` returns a rule that maps a tree shaped like
``nnx.state(model, nnx.Param)`` to how each parameter is a matrix
(:class:`~fisher_optax.MatrixDims`) or that it is none
(:data:`~fisher_optax.NOT_A_MATRIX`: the named optimizers send it to their fallback).
Pass it as ``dims=`` to any named optimizer::

    tx = fo.alice(1e-2, dims=fo.flax_dims(model))

The rule table (the module that owns a parameter decides; axes beyond what the module
declares are leading *layer* axes from ``nnx.vmap``/``nnx.scan``, batch axes of
independent matrices):

=====================================  ===========================  =======================
parameter                              matrix (rows x cols)         as in
=====================================  ===========================  =======================
``nnx.Linear`` kernel ``(in, out)``    ``in x out``                 every Shampoo/Muon
``nnx.LinearGeneral`` kernel           in-feature axes x out-feature ``optax.contrib.muon``
(attention ``(in, heads, head_dim)``,  axes, merged: ``in x heads*head_dim``,  dimension numbers
output ``(heads, head_dim, out)``)     ``heads*head_dim x out``
``nnx.Conv`` kernel                    ``kh*kw*cin x cout``          Muon / Shampoo for conv
``(kh, kw, cin, cout)``                                             (reshape to 2-D)
``nnx.Embed`` embedding                ``vocab x features``         (route with ``mask``)
biases, norm scales, any other         ``NOT_A_MATRIX``             fallback
parameter of a known module
a parameter of another module          the default rule (last two axes if it is not a
                                       vector's name and has ndim 2; otherwise
                                       ``NOT_A_MATRIX``: the rule cannot tell)
=====================================  ===========================  =======================

:func:`fisher_optax.describe` prints the result leaf by leaf.
"""

from __future__ import annotations

from typing import Any

import jax

from fisher_optax import matrices, routing


def _module_dims(module, name: str, ndim: int):
  """MatrixDims of parameter ``name`` (``ndim`` dims) of ``module``, or ``None`` if the
  module type is unknown."""
  nnx = _import_nnx()
  if isinstance(module, nnx.Linear):
    if name != "kernel":
      return matrices.NOT_A_MATRIX
    k = ndim - 2
    return matrices.MatrixDims(rows=k, cols=k + 1) if k >= 0 else matrices.NOT_A_MATRIX
  if isinstance(module, nnx.LinearGeneral):
    if name != "kernel":
      return matrices.NOT_A_MATRIX
    n_in = len(module.in_features) if isinstance(module.in_features, tuple) else 1
    n_out = len(module.out_features) if isinstance(module.out_features, tuple) else 1
    # kernel layout: batch_dims + in_features + out_features (flax LinearGeneral)
    n_batch_decl = len(getattr(module, "batch_axis", {}) or {})
    k = ndim - (n_batch_decl + n_in + n_out)
    if k < 0:
      return matrices.NOT_A_MATRIX
    first = k + n_batch_decl
    return matrices.MatrixDims(rows=tuple(range(first, first + n_in)),
                              cols=tuple(range(first + n_in, first + n_in + n_out)))
  if isinstance(module, nnx.Conv):
    if name != "kernel":
      return matrices.NOT_A_MATRIX
    spatial = len(module.kernel_size) if isinstance(module.kernel_size, (tuple, list)) else 1
    k = ndim - (spatial + 2)
    if k < 0:
      return matrices.NOT_A_MATRIX
    return matrices.MatrixDims(rows=tuple(range(k, k + spatial + 1)), cols=k + spatial + 1)
  if isinstance(module, nnx.Embed):
    if name != "embedding":
      return matrices.NOT_A_MATRIX
    k = ndim - 2
    return matrices.MatrixDims(rows=k, cols=k + 1) if k >= 0 else matrices.NOT_A_MATRIX
  norms = tuple(getattr(nnx, n) for n in ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm")
                if hasattr(nnx, n))
  if isinstance(module, norms):
    return matrices.NOT_A_MATRIX
  return None


class FlaxDims(matrices.DimsRule):
  """The ``dims=`` rule of one NNX model (built by :func:`flax_dims`).

  Attributes:
    table: ``{"/"-joined parameter path: MatrixDims or NOT_A_MATRIX}``.
  """

  def __init__(self, table: dict):
    self.table = dict(table)

  def resolve(self, tree: Any) -> Any:
    """The dims of every leaf of ``tree``, a tree whose paths are the model's parameter
    paths (``nnx.state(model, nnx.Param)``, its pure-dict form, or the masked trees
    inside ``optax.partition``); raises a ``ValueError`` naming an unknown leaf."""
    def one(path, _):
      key = routing.path_to_str(path)
      if key not in self.table:
        raise ValueError(f"fo.flax_dims: leaf {key!r} is not a parameter of the model "
                         f"(known: {sorted(self.table)[:5]}...)")
      return self.table[key]
    return jax.tree_util.tree_map_with_path(one, tree)

  def __repr__(self):
    return f"FlaxDims({len(self.table)} parameters)"


def _import_nnx():
  try:
    from flax import nnx
  except ImportError as e:
    raise ImportError("fo.flax_dims reads a Flax NNX model and needs flax: "
                      "pip install 'fisher-optax[flax]'") from e
  return nnx


def flax_dims(model: Any) -> FlaxDims:
  """The :class:`MatrixDims` (or :data:`NOT_A_MATRIX`) of every parameter of an NNX
  ``model``, as a ``dims=`` rule (:class:`FlaxDims`) that maps any tree whose paths are
  the model's parameter paths -- ``nnx.state(model, nnx.Param)``, its pure-dict form, or
  the masked trees inside ``optax.partition`` -- to the dims of its leaves.

  The rule is not a Python callable, so it passes through
  ``optax.inject_hyperparams`` (which takes callables for schedules) unchanged.

  Raises:
    ImportError: flax is not installed (the ``flax`` extra installs it).
  """
  nnx = _import_nnx()
  owners = {}
  for path, module in nnx.iter_graph(model):
    if isinstance(module, nnx.Module):
      owners[routing.path_to_str(path)] = module
  table = {}
  for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
    key = routing.path_to_str(path)
    parts = key.split("/")
    module = next((owners[m] for m in ("/".join(parts[:c]) for c in range(len(parts) - 1, -1, -1))
                   if m in owners), None)
    ndim = len(getattr(x, "shape", ()))
    d = _module_dims(module, parts[-1], ndim) if module is not None else None
    if d is None:
      d = (matrices.MatrixDims() if ndim == 2 and not routing.is_vector_name(path)
           else matrices.NOT_A_MATRIX)
    table[key] = d
  return FlaxDims(table)
