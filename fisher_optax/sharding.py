"""Optimizer-state ``PartitionSpec``s from the parameters' specs (SPEC.md "sharding").

:func:`state_partition_specs` returns, for any optax transformation built from
fisher_optax blocks (and optax's own), the ``PartitionSpec`` tree of its state:

* every state leaf is attributed to the parameter whose tree path ends its own path
  (``state.basis["layers"][0]["kernel"]`` belongs to ``params["layers"][0]["kernel"]``);
* its leading axes are the parameter's batch axes (stacked layers) and keep their specs;
* each remaining axis takes the spec of the parameter's matrix axis of the same size
  (moments ``r x n`` are split where the parameter's ``n`` axis is, scaling vectors
  likewise, Adam moments exactly like the parameter); ``d x d`` rotation statistics and
  bases are split on their first axis only; tracked ``r x r`` states, eigenvalues and
  every leaf not attributable to a parameter (step counters, PRNG keys) are replicated;
* a mesh axis is used at most once per spec, and only where the size divides (when a
  ``mesh`` is given).

All of this only decides *layouts*; results do not depend on it (tests compare sharded
with single-device runs).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fisher_optax import routing

# Small per-matrix arrays kept replicated: tracked r x r states, eigenvalues, PRNG keys.
REPLICATED_FIELDS = {"tracked", "eig_left", "eig_right", "key"}
# d x d rotation statistics and bases: first axis split like the matching parameter axis.
LEFT_SQUARE = {"stats_left", "basis_left"}
RIGHT_SQUARE = {"stats_right", "basis_right"}
# 1-D per-matrix vectors: which matrix axis they run along when a square param is ambiguous.
ROW_VECTORS = {"q"}


def _key_name(k) -> Optional[str]:
  return getattr(k, "name", None)


def _spec_entries(spec: Optional[P], ndim: int) -> list:
  entries = list(spec) if spec is not None else []
  return entries + [None] * (ndim - len(entries))


def _axis_size(mesh: Optional[Mesh], entry) -> int:
  if mesh is None or entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  size = 1
  for n in names:
    size *= mesh.shape[n]
  return size


def _leaf_spec(shape, field, pshape, pspec, dims, mesh) -> P:
  if field in REPLICATED_FIELDS:
    return P()
  pent = _spec_entries(pspec, len(pshape))
  if tuple(shape) == tuple(pshape):
    entries = pent
  else:
    if len(pshape) < 2:
      return P()
    view = routing.matrix_view(pshape, dims)
    batch = view.batch_axes
    nb = len(batch)
    if tuple(shape[:nb]) != tuple(pshape[a] for a in batch):
      return P()
    entries = [pent[a] for a in batch]
    trailing = list(shape[nb:])
    # each matrix side: (its size, the spec of its major axis; merged axes are sharded
    # like their first axis, which a row-major reshape keeps contiguous)
    rows = (view.fan_in, pent[view.rows[0]])
    cols = (view.fan_out, pent[view.cols[0]])
    sides = [rows] if field in ROW_VECTORS else [rows, cols]
    for pos, d in enumerate(trailing):
      if field in LEFT_SQUARE | RIGHT_SQUARE:
        if pos:
          entries.append(None)
          continue
        cands = [sd for sd in sides if sd[0] == d]
        if len(cands) > 1:
          cands = [rows if field in LEFT_SQUARE else cols]
        entries.append(cands[0][1] if cands else None)
        continue
      cands = [sd for sd in sides if sd[0] == d]
      if len(cands) > 1:  # square parameter: positional (rows first) unless a vector
        cands = [cands[pos if len(trailing) == 2 else (-1 if field not in ROW_VECTORS else 0)]]
      entries.append(cands[0][1] if cands else None)
  used, out = set(), []
  for d, e in zip(shape, entries):
    names = e if isinstance(e, tuple) else ((e,) if e is not None else ())
    if e is None or any(n in used for n in names) or d % _axis_size(mesh, e):
      out.append(None)
      continue
    used.update(names)
    out.append(e)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def state_partition_specs(tx, params: Any, param_specs: Any, *, dims: routing.DimsSpec = None,
                          mesh: Optional[Mesh] = None) -> Any:
  """``PartitionSpec`` tree for ``tx.init(params)``.

  Args:
    tx: the (fisher_optax or optax) transformation.
    params: parameters, or their ``jax.ShapeDtypeStruct``s.
    param_specs: a tree of ``PartitionSpec`` (or ``None``) matching ``params``.
    dims: the optimizer's matrix axes; default: those the named optimizer ``tx`` was
      built with (its ``dims=``), else the last two axes.
    mesh: if given, mesh axes that do not divide a dimension are dropped.
  """
  if dims is None and isinstance(tx, routing.RoutedTransformation):
    dims = tx.dims
  state_shapes = jax.eval_shape(tx.init, params)
  p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  s_leaves = jax.tree.leaves(param_specs, is_leaf=lambda x: x is None or isinstance(x, P))
  dims_tree = routing.resolve_dims(dims, params)
  d_leaves = jax.tree.leaves(dims_tree, is_leaf=lambda x: isinstance(x, routing.MatrixDims))
  by_path = {tuple(path): (leaf.shape, spec, d)
             for (path, leaf), spec, d in zip(p_leaves, s_leaves, d_leaves)}
  max_len = max((len(k) for k in by_path), default=0)

  def spec_for(path, leaf):
    path = tuple(path)
    for n in range(min(max_len, len(path)), 0, -1):
      hit = by_path.get(path[-n:])
      if hit is not None:
        names = [_key_name(k) for k in path[:-n] if _key_name(k)]
        field = names[-1] if names else None
        pshape, pspec, d = hit
        return _leaf_spec(leaf.shape, field, pshape, pspec, d, mesh)
    return P()

  return jax.tree_util.tree_map_with_path(spec_for, state_shapes)


def state_shardings(tx, params: Any, param_specs: Any, mesh: Mesh, **kw) -> Any:
  """:func:`state_partition_specs` as ``NamedSharding``s on ``mesh``."""
  specs = state_partition_specs(tx, params, param_specs, mesh=mesh, **kw)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))
