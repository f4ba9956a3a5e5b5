"""``fo.describe(tx, params)``: how a named optimizer routes every leaf of a model.

A table of every parameter -- path, shape, rule (the structured block or the fallback),
matrix view ``batch x m x n`` (with merged axes), rank actually used, optimizer-state
numbers next to Adam's (``2 x size``) -- and totals; returned as data
(:class:`Description`) and printable as text. Reading it before training shows at a
glance a stack of norm scales taken for a matrix, a conv kernel split into many small
matrices, or a typo'd mask that sent the whole model to Adam.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import numpy as np

from fisher_optax import matrices, routing, stacking


@dataclasses.dataclass(frozen=True)
class LeafRouting:
  path: str
  shape: tuple
  rule: str                 # e.g. "alice" or "fallback"
  view: str                 # "batch x m x n" of the canonical matrices, or "-"
  rank: Optional[int]       # rank used per matrix (low-rank rules), else None
  state_numbers: int        # this leaf's optimizer-state numbers
  adam_numbers: int         # Adam's: 2 x size


@dataclasses.dataclass(frozen=True)
class Description:
  rows: tuple
  note: str = ""

  @property
  def state_numbers(self) -> int:
    return sum(r.state_numbers for r in self.rows)

  @property
  def adam_numbers(self) -> int:
    return sum(r.adam_numbers for r in self.rows)

  def as_dicts(self) -> list[dict]:
    return [dataclasses.asdict(r) for r in self.rows]

  def __str__(self) -> str:
    head = ("path", "shape", "rule", "matrix view", "rank", "state", "Adam")
    body = [(r.path, "x".join(map(str, r.shape)) or "()", r.rule, r.view,
             "-" if r.rank is None else str(r.rank), f"{r.state_numbers:,}",
             f"{r.adam_numbers:,}") for r in self.rows]
    ratio = self.state_numbers / max(self.adam_numbers, 1)
    body.append(("total", "", "", "", "", f"{self.state_numbers:,}",
                 f"{self.adam_numbers:,}"))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    lines = [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(b) for b in body]
    lines.append(f"optimizer state = {ratio:.1%} of Adam's" + (f"  ({self.note})"
                                                              if self.note else ""))
    return "\n".join(lines)


def _find_routed(tx) -> Optional[routing.RoutedTransformation]:
  return tx if isinstance(tx, routing.RoutedTransformation) else None


def describe(tx: Any, params: Any) -> Description:
  """Routing table of ``tx`` (a fisher_optax named optimizer) over ``params``."""
  routed = _find_routed(tx)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if routed is not None:
    labels = jax.tree.leaves(routed.labels(params))
    dims = jax.tree.leaves(matrices.resolve_dims(routed.dims, params),
                           is_leaf=lambda x: isinstance(x, matrices.MatrixDims))
    name, rank = routed.info.get("name", "structured"), routed.info.get("rank")
    note = ""
  else:
    labels = ["fallback"] * len(flat)
    dims = [None] * len(flat)
    name, rank, note = "?", None, "not a fisher_optax named optimizer: rules unknown"
  counts = _state_numbers_by_leaf(tx, params, [p for p, _ in flat])
  if routed is not None and routed.info.get("stack_matrices"):
    _add_stacked_state(counts, routed, params)
  rows = []
  for (path, x), label, d, n in zip(flat, labels, dims, counts):
    shape = tuple(np.shape(x))
    size = int(math.prod(shape))
    view, r = "-", None
    if label == "fallback" and routed is not None and routed.dims is None and len(shape) > 2:
      view = "? *"
      note = ("* more than two dims and no dims=: a layer stack, attention or conv kernel "
              "cannot be told apart, so the fallback; pass dims=fo.flax_dims(model) "
              "(Flax NNX) or fo.MatrixDims(...)")
    if label == "structured":
      v = matrices.matrix_view(shape, d, smaller_first=True)
      view = " x ".join(map(str, v.batch_shape + (v.m, v.n)))
      if rank is not None:
        r = min(int(rank), v.m)
    rows.append(LeafRouting(routing.path_to_str(path), shape,
                            name if label == "structured" else "fallback", view, r, n,
                            2 * size))
  return Description(tuple(rows), note)


def _add_stacked_state(counts: list, routed, params) -> None:
  """Under ``stack_matrices=True``: each stack's state numbers go to its member leaves
  in proportion to their matrices (every matrix of a stack holds the same state)."""
  plan, index = stacking.plan_routed(params, routed.labels(params), routed.dims)
  per_group = dict.fromkeys(plan.groups, 0)
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.eval_shape(routed.init, params))[0]:
    name = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)
                 and k.key in per_group), None)
    if name is not None:
      per_group[name] += int(math.prod(getattr(leaf, "shape", ())))
  for name, members in plan.groups.items():
    total = sum(plan.views[j].num_matrices for j in members)
    for j in members:
      counts[index[j]] += per_group[name] * plan.views[j].num_matrices // total


def _state_numbers_by_leaf(tx, params, param_paths) -> list[int]:
  """Optimizer-state numbers attributed to each parameter: a state leaf belongs to the
  parameter whose path ends its own path (counters and keys belong to none)."""
  shapes = jax.eval_shape(tx.init, params)
  keys = {tuple(routing.path_to_str([k]) for k in p): i for i, p in enumerate(param_paths)}
  longest = max((len(k) for k in keys), default=0)
  counts = [0] * len(param_paths)
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    names = tuple(routing.path_to_str([k]) for k in path)
    for n in range(min(longest, len(names)), 0, -1):
      i = keys.get(names[-n:])
      if i is not None:
        counts[i] += int(math.prod(getattr(leaf, "shape", ())))
        break
  return counts
