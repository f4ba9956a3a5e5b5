"""Matrix views of a Haiku model's parameters, read from its parameter dict.

Haiku keeps no module objects after ``init``: its parameters are a dict
``{module path: {parameter name: array}}`` (``"multi_head_attention/query": {"w": ..., "b":
...}``), and its modules have fixed layouts and default names. :func:`haiku_dims` reads
both:

==========================================  ===================================
parameter                                   matrix (rows x cols)
==========================================  ===================================
``w`` of ``hk.Linear`` (any 2-D ``w``:      ``in x out``
``MultiHeadAttention``'s projections)
``w`` of ``conv1_d``/``conv2_d``/           ``kh*kw*cin x cout`` (HWIO)
``conv3_d``/``conv_nd`` ``(kh, kw, cin,
cout)``
``w`` of a ``*_transpose`` conv             ``kh*kw*cin x cout`` (its ``cin`` is
``(kh, kw, cout, cin)``                     last)
``embeddings`` of ``hk.Embed``              ``EMBEDDING`` (fallback, as the paper)
leading axes beyond those                   layers (``hk.layer_stack``,
                                            ``hk.vmap``): batch axes
``b``, ``scale``, ``offset``, biases and    ``NOT_A_MATRIX``
norm scales of any shape
a depthwise conv kernel                     ``NOT_A_MATRIX`` (one input channel
                                            per output channel: no matrix)
a ``w`` with more than two axes of a        ``Unclassified``: fallback, warned
module named otherwise                      at ``init``; route it with
                                            ``overrides=``
==========================================  ===================================
"""

from __future__ import annotations

import re
from typing import Any, Optional

import jax

from fisher_optax import matrices, model_dims, routing


class HaikuDims(model_dims.ModelDims):
  """The ``dims=`` rule of one Haiku parameter dict (built by :func:`haiku_dims`).

  Attributes:
    table: ``{"/"-joined parameter path: MatrixDims, NOT_A_MATRIX or Unclassified}``.
  """

  helper = "fo.haiku_dims"


# Haiku's default module names: the class name in snake case, "_<n>" for the n-th
# repeat (``linear_1``); a conv's spatial rank is in its name (``conv2_d``)
_CONV = re.compile(r"^conv(\d)_d(_transpose)?(_\d+)?$|^conv_nd(_transpose)?(_\d+)?$")
_DEPTHWISE = re.compile(r"depthwise|separable")
_EMBED = re.compile(r"^embed(_\d+)?$")


def _leaf(module: str, name: str, shape: tuple, path) -> matrices.MatrixDims:
  ndim = len(shape)
  short = module.rsplit("/", 1)[-1]
  if routing.is_vector_name(path) or name in ("b", "offset", "scale") or ndim < 2:
    return matrices.NOT_A_MATRIX
  if name == "embeddings" and _EMBED.match(short):
    return matrices.EMBEDDING
  if name != "w":
    return _unknown(module, name, ndim)
  if _DEPTHWISE.search(short):
    return matrices.NOT_A_MATRIX
  conv = _CONV.match(short)
  if conv:
    spatial = int(conv.group(1)) if conv.group(1) else ndim - 2
    k = ndim - (spatial + 2)  # leading layer axes
    if k < 0:
      return _unknown(module, name, ndim)
    if conv.group(2) or conv.group(4):  # transposed: (..., cout, cin)
      return matrices.MatrixDims(rows=tuple(range(k, k + spatial)) + (ndim - 1,),
                                 cols=ndim - 2)
    return matrices.MatrixDims(rows=tuple(range(k, k + spatial + 1)), cols=ndim - 1)
  if ndim == 2 or short.startswith("linear") or short in ("query", "key", "value"):
    return matrices.MatrixDims()  # (in, out); leading axes are layers
  return _unknown(module, name, ndim)


def _unknown(module: str, name: str, ndim: int) -> matrices.Unclassified:
  return matrices.Unclassified(
      f"{ndim}-D parameter {name!r} of Haiku module {module!r}, whose layout the rule "
      "does not know (it reads Linear, Conv*D, Conv*DTranspose, Embed and their layer "
      "stacks by their default names); give its dims with "
      "overrides={path regex: fo.MatrixDims(rows=..., cols=...)}")


def haiku_dims(params: Any, *, overrides: Optional[dict] = None,
               on_unmatched: str = "raise") -> HaikuDims:
  """The matrix view of every parameter of a Haiku model, read from its parameter dict
  (what ``hk.transform(f).init`` or ``hk.transform_with_state(f).init`` returns), as a
  ``dims=`` rule.

  Each parameter is read by its module's default name and its own (``w``, ``b``,
  ``embeddings``): ``hk.Linear`` and ``MultiHeadAttention``'s projections ``(in, out)``,
  convolutions ``(kh, kw, cin, cout)`` as one ``kh*kw*cin x cout`` matrix, ``hk.Embed``
  ``vocab x features``, leading axes added by ``hk.layer_stack``/``hk.vmap`` as layers.
  Biases and norm parameters go to the fallback, and a kernel the rule cannot read
  (a module named otherwise) is :class:`~fisher_optax.Unclassified`: ``init`` warns
  naming it, and ``overrides=`` routes it.

  Args:
    params: Haiku's parameter dict ``{module path: {name: array}}`` (arrays or shapes).
    overrides: ``{path regex: MatrixDims or NOT_A_MATRIX}`` over the rules (paths are
      ``"<module path>/<name>"``, e.g. ``"multi_head_attention/query/w"``); an override
      that does not fit a leaf it matches raises a ``ValueError`` here.
    on_unmatched: a pattern of ``overrides`` that matches no path: ``"raise"``
      (default), ``"warn"`` or ``"ignore"``, as :func:`~fisher_optax.path_mask`'s.

  Raises:
    TypeError: ``params`` is not a Haiku parameter dict (a Flax, Equinox or other
      model: the message names the helper for it).
  """
  if not isinstance(params, dict) or not all(
      isinstance(v, dict) and all(not isinstance(x, dict) for x in v.values())
      for v in params.values()):
    raise TypeError(
        "fo.haiku_dims reads Haiku's parameter dict {module path: {name: array}} (what "
        "hk.transform(f).init returns), got " + type(params).__name__ + "; for Flax use "
        "fo.flax_dims(model) or fo.linen_dims(module, *example_inputs), for Equinox "
        "fo.equinox_dims(model)")
  table, ndims = {}, {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    module, name = path[0].key, path[1].key
    key = matrices.path_to_str(path)
    shape = tuple(getattr(x, "shape", ()))
    table[key] = _leaf(module, name, shape, path)
    ndims[key] = len(shape)
  return HaikuDims(model_dims.apply_overrides(table, overrides, "fo.haiku_dims", ndims,
                                            on_unmatched))
