"""``fo.describe(tx, params)``: how a named optimizer routes every leaf of a model.

A table of every parameter -- path, shape, rule (the structured block or the fallback),
matrix view ``batch x fan-in x fan-out`` (merged axes; rows are the contracted side),
rank actually used, optimizer-state numbers next to Adam's (``2 x size``) -- and
totals; returned as data
(:class:`Description`) and printable as text. Reading it before training shows at a
glance a stack of norm scales taken for a matrix, a conv kernel split into many small
matrices, or a typo'd mask that sent the whole model to Adam.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

import jax
import numpy as np

from fisher_optax import matrices, model_dims, routing, stacking
from fisher_optax.parallel import sharding
from fisher_optax.blocks.power import power_rank
from fisher_optax.inspect import memory

# a leaf named like an embedding table: Flax's "embed/embedding", Haiku's
# "embed/embeddings", Gemma's "input_embedding", "embed_tokens/weight", GPT-2's "wte"
_TABLE_NAME = re.compile(r"(embed|wte)[^/]*(/(weight|w|embedding|embeddings))?$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class LeafRouting:
  path: str
  shape: tuple
  rule: str                 # e.g. "alice" or "fallback"
  view: str                 # "batch x fan-in x fan-out" of the matrices, or "-"
  rank: Optional[int]       # rank used per matrix (low-rank rules), else None
  state_numbers: int        # this leaf's optimizer-state numbers, wrappers' included
  adam_numbers: int         # Adam's: 2 x size
  own_numbers: int = -1     # the named optimizer's own state for this leaf (-1: all)
  unclassified: str = ""    # why the dims rule could not classify the leaf, if so
  embedding: bool = False   # an embedding table (by its module, or by its name)

  @property
  def above_adam(self) -> bool:
    """A structured leaf whose named optimizer keeps more state for it than Adam would
    (wrappers' own state, e.g. ``optax.MultiSteps``'s accumulator, is not counted)."""
    own = self.state_numbers if self.own_numbers < 0 else self.own_numbers
    return self.rule not in ("fallback", "other") and own > self.adam_numbers


@dataclasses.dataclass(frozen=True)
class Description:
  """What :func:`describe` returns: one row per parameter leaf (path, shape, rule, matrix
  view, rank, state numbers, Adam's) and a
  note; ``str()`` prints the table with totals and the state's share of Adam's."""

  rows: tuple
  note: str = ""

  @property
  def state_numbers(self) -> int:
    return sum(r.state_numbers for r in self.rows)

  @property
  def adam_numbers(self) -> int:
    return sum(r.adam_numbers for r in self.rows)

  @property
  def above_adam(self) -> tuple:
    """Paths of the structured leaves whose state is larger than Adam's."""
    return tuple(r.path for r in self.rows if r.above_adam)

  @property
  def embeddings(self) -> tuple:
    """Paths of the leaves taken for embedding tables.

    A leaf is taken for a table by the model rule, which sends it to the fallback,
    or, without one, by its name; it is then marked ``~`` when it reaches the
    structured rule, which the paper does not do.
    """
    return tuple(r.path for r in self.rows if r.embedding)

  @property
  def unclassified(self) -> tuple:
    """Paths of the leaves that the ``dims`` rule could not classify (they train on the
    fallback; the note says why)."""
    return tuple(r.path for r in self.rows if r.unclassified)

  def as_dicts(self) -> list[dict]:
    return [dataclasses.asdict(r) for r in self.rows]

  def __str__(self) -> str:
    head = ("path", "shape", "rule", "matrix view", "rank", "state", "Adam")
    body = [(r.path, "x".join(map(str, r.shape)) or "()", r.rule, r.view,
             "-" if r.rank is None else str(r.rank),
             f"{r.state_numbers:,}" + (" !" if r.above_adam else ""),
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


def describe(tx: Any, params: Any) -> Description:
  """Routing table of ``tx`` over ``params``: every leaf's rule, matrix view, rank and
  optimizer-state numbers beside Adam's.

  ``tx`` is a fisher_optax named optimizer, or any transformation built around named
  optimizers -- ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
  ``optax.apply_if_finite``, ``optax.partition``/``optax.multi_transform``,
  ``optax.masked`` -- whose ``init`` calls theirs: ``describe`` traces ``tx.init`` with
  ``jax.eval_shape`` (nothing is computed) and records what each named optimizer inside
  was given. Leaves that no named optimizer receives are listed with rule
  ``"other"``; when ``tx`` holds no named optimizer at all, the note says so. A leaf whose
  state is larger than Adam's (a rank clipped to a small matrix's side can do that) is
  marked ``!`` and listed in :attr:`~fisher_optax.Description.above_adam`.

  The matrix view is ``batch x fan-in x fan-out``: rows are the contracted (input)
  side, so a weight stored ``(out, in)`` and routed with the right ``dims`` shows its
  sides in the same order as an ``(in, out)`` one. A leaf that a model rule
  (:func:`~fisher_optax.flax_dims`, :func:`~fisher_optax.linen_dims`,
  :func:`~fisher_optax.equinox_dims`) could not classify is marked ``?`` and the note
  says why; :attr:`~fisher_optax.Description.unclassified` lists them.

  The state column counts every state array that ends in the leaf's path (wrappers'
  accumulators included, e.g. ``optax.MultiSteps``'s gradient sum); ``!`` compares the
  named optimizer's own state with Adam's.
  """
  if not hasattr(tx, "init") and hasattr(params, "init") and hasattr(params, "update"):
    raise TypeError("fo.describe(tx, params): the optimizer comes first; called as "
                    "describe(params, tx)?")
  if not hasattr(tx, "init"):
    raise TypeError(f"fo.describe(tx, params): `tx` must be an optax transformation, got "
                    f"{type(tx).__name__}")
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [matrices.path_to_str(p) for p, _ in flat]
  with routing.record_routed_inits() as found:
    # a new function each call: jax caches traces by function, and a cached trace would
    # not run the inits that record themselves
    state = jax.eval_shape(lambda p: tx.init(p), params)
  seen = _routing_by_path(found)
  counts = memory.state_sizes_by_leaf(state, [p for p, _ in flat])
  own = _own_numbers(found, flat, paths)
  for rec in found:
    if stacking.is_stacked(rec.routed):
      stacking.add_stacked_state(counts, rec, paths)
    _add_owned_state(counts, rec, paths)
  notes = [] if found else ["no fisher_optax named optimizer inside tx: rules unknown"]
  rows = [_row(key, tuple(np.shape(x)), seen.get(key), n, notes, default="other",
               own=o)
          for (_, x), key, n, o in zip(flat, paths, counts, own)]
  return Description(tuple(rows), "; ".join(notes + _table_notes(rows, bool(found))))


def _table_notes(rows: list, found: bool) -> list:
  """The notes on the whole table: unclassified leaves, leaves no named optimizer
  receives, embedding tables and where they went, state above Adam's."""
  notes = []
  unclassified = [r for r in rows if r.unclassified]
  if unclassified:
    shown = "; ".join(f"{r.path}: {r.unclassified}" for r in unclassified[:3])
    more = f" (and {len(unclassified) - 3} more)" if len(unclassified) > 3 else ""
    notes.append(f"? not classified by the dims rule, so on the fallback: {shown}{more}")
  if found and any(row.rule == "other" for row in rows):
    notes.append("other: leaves that no fisher_optax named optimizer inside tx receives")
  structured_tables = [r.path for r in rows if r.embedding and r.rule not in ("fallback",
                                                                              "other")]
  if structured_tables:
    notes.append(f"~ {', '.join(structured_tables[:3])}: named like an embedding table and "
                 "trained by the structured rule; the paper trains embeddings with Adam: "
                 "mask=fo.path_mask(exclude=['embed']), or dims= from a model rule, which "
                 "sends them to the fallback")
  if any(r.embedding and r.rule == "fallback" for r in rows):
    notes.append("embedding: an embedding table, on the fallback as the paper trains it "
                 "(overrides={path: fo.MatrixDims()} in the model rule routes it)")
  if any(row.above_adam for row in rows):
    notes.append("! the optimizer's own state for this leaf is above Adam's: a small "
                 "matrix under a rank clipped to its side, or a full-matrix preconditioner "
                 "(SOAP, Shampoo, Eigen-Adam) by design; a lower rank, or mask= sending it "
                 "to the fallback, saves memory")
  return notes


def _own_numbers(found: list, flat: list, paths: list) -> list:
  """Per leaf, the state numbers of the named optimizer that received it (its own
  state: no wrapper's accumulator)."""
  own = [0] * len(paths)
  index = {p: i for i, p in enumerate(paths)}
  for rec in found:
    inner = jax.tree_util.tree_flatten_with_path(rec.params)[0]
    counts = memory.state_sizes_by_leaf(rec.state, [p for p, _ in inner])
    inner_paths = [matrices.path_to_str(p) for p, _ in inner]
    if stacking.is_stacked(rec.routed):
      stacking.add_stacked_state(counts, rec, inner_paths)
    _add_owned_state(counts, rec, inner_paths)
    for (p, _), n in zip(inner, counts):
      i = index.get(matrices.path_to_str(p))
      if i is not None:
        own[i] += n
  return own


def _add_owned_state(counts: list, rec: Any, paths: list) -> None:
  """Adds the state kept in the owner layout (stacks keyed by matrix size ``"m x n"``,
  :class:`~fisher_optax.RotateOwnedState`) to the structured leaves of that size (either
  orientation, the stored one first), in proportion to their matrices: its padding slots
  are counted with the real ones, as they take memory."""
  totals: dict = {}
  for key, role in sharding.field_roles(rec.state).items():
    if role == "owners":
      leaf = _leaf_at(rec.state, key)
      group = re.search(r"\['(\d+x\d+)'\]", key)
      if group is not None and leaf is not None:
        totals[group.group(1)] = totals.get(group.group(1), 0) + int(np.prod(leaf.shape))
  if not totals:
    return
  flat = jax.tree_util.tree_flatten_with_path(rec.params)[0]
  labels = jax.tree.leaves(rec.labels)
  dims = jax.tree.leaves(model_dims.resolve_dims(rec.routed.dims, rec.params),
                         is_leaf=lambda x: x is None or isinstance(x, matrices.MatrixDims))
  outer = {p: i for i, p in enumerate(paths)}
  members: dict = {}
  for (path, x), label, d in zip(flat, labels, dims):
    if label != "structured":
      continue
    v = matrices.matrix_view(x.shape, d, what="describe")
    key = next((k for k in (f"{v.fan_in}x{v.fan_out}", f"{v.fan_out}x{v.fan_in}")
                if k in totals), None)
    if key is not None:
      members.setdefault(key, []).append((outer[matrices.path_to_str(path)], v.num_matrices))
  for key, who in members.items():
    k = sum(n for _, n in who)
    for i, n in who:
      counts[i] += totals[key] * n // k


def _leaf_at(tree: Any, key: str) -> Any:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.tree_util.keystr(path) == key:
      return leaf
  return None


def _routing_by_path(found: list) -> dict:
  """``{leaf path: (record, label, dims)}`` from the recorded inits (the first wins)."""
  seen = {}
  for rec in found:
    inner = jax.tree_util.tree_flatten_with_path(rec.params)[0]
    labels = jax.tree.leaves(rec.labels)
    dims = jax.tree.leaves(model_dims.resolve_dims(rec.routed.dims, rec.params),
                           is_leaf=lambda x: isinstance(x, matrices.MatrixDims))
    for (path, _), label, d in zip(inner, labels, dims):
      seen.setdefault(matrices.path_to_str(path), (rec, label, d))
  return seen


def _row(key: str, shape: tuple, routed, numbers: int, notes: list, *, default: str,
         own: int = -1) -> LeafRouting:
  """One leaf's row; ``routed`` is its ``(record, label, dims)`` or ``None``."""
  view, r, rule, why, table = "-", None, default, "", False
  if routed is not None:
    rec, label, d = routed
    rule = rec.routed.info.get("name", "structured") if label == "structured" else "fallback"
    if label == "fallback" and isinstance(d, matrices.Unclassified):
      view, why = "? unclassified", d.reason
    if label == "fallback" and isinstance(d, matrices.Embedding):
      view, table = "embedding", True
    if label == "fallback" and rec.routed.dims is None and len(shape) > 2:
      view = "? *"
      star = ("* more than two dims and no dims=: a layer stack, attention or conv kernel "
              "cannot be told apart, so the fallback; pass dims=fo.flax_dims(model) "
              "(Flax NNX), fo.linen_dims(module, x) (Linen), fo.equinox_dims(model) "
              "(Equinox) or fo.MatrixDims(...)")
      if star not in notes:
        notes.append(star)
    if label == "structured":
      v = matrices.matrix_view(shape, d)
      view = " x ".join(map(str, v.batch_shape + (v.fan_in, v.fan_out)))
      rank = rec.routed.info.get("rank")
      if isinstance(rank, float):  # a fraction of the smaller side (Dion)
        r = power_rank(rank, min(v.fan_in, v.fan_out))
      elif rank is not None:
        r = min(int(rank), v.fan_in, v.fan_out)
      table = len(shape) == 2 and _TABLE_NAME.search(key) is not None
      if table:
        view += " ~"
  return LeafRouting(key, shape, rule, view, r, numbers, 2 * int(math.prod(shape)),
                     own_numbers=own if routed is not None else -1, unclassified=why,
                     embedding=table)


