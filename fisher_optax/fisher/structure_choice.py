r"""A structure chosen per layer: the paper's design rule applied matrix by matrix.

The paper derives each optimizer from a structure ``F~`` that approximates the Fisher
``F`` (arXiv:2502.07752, Sec. 3); which structure is closest differs between layers and
over training (see :func:`fisher_optax.fisher.fisher_report.fisher_report`). Given a report and a
memory budget, :func:`choose_structures` picks for every reported matrix leaf ``l`` one
structure ``s_l`` among those that have an optimizer, solving

.. math::

  \min_{s_1..s_L} \sum_l e_l(s_l) \quad\text{s.t.}\quad \sum_l b_l(s_l) \le B,

where ``e_l(s)`` is the report's relative error ``||F~_s - F||_F / ||F||_F`` of leaf
``l`` (the mean over the matrices of a stacked leaf) and ``b_l(s)`` the bytes of state the
optimizer given for ``s`` holds for that leaf (counted from ``jax.eval_shape`` of its
``init`` on the real parameter tree, as :func:`fisher_optax.describe` counts them). It is a
multiple-choice knapsack; it is solved exactly by dynamic programming over the budget cut
into ``resolution`` bins, every option's bytes rounded *up* to whole bins, so the choice
never exceeds the budget and is optimal up to one bin per leaf. With ``per_leaf=True``
the budget is a fraction of Adam's state applied to every leaf on its own: each leaf
takes its lowest-error structure that fits.

:func:`per_layer` builds the optimizer: ``optax.partition`` of the given named
optimizers, each receiving the leaves it was chosen for, and ``fallback`` for every leaf
the report does not cover (embeddings, norms, biases). It is one
``optax.GradientTransformation``: :func:`fisher_optax.describe` shows each leaf's
optimizer, its state shards with :func:`fisher_optax.state_shardings`, and it
checkpoints like any optax state.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Optional

import jax
import numpy as np
import optax

from fisher_optax import matrices, routing, stacking
from fisher_optax.inspect import memory
from fisher_optax.fisher.fisher_report import FisherReport

FALLBACK = "fallback"


@dataclasses.dataclass(frozen=True)
class LayerChoice:
  """One leaf's choice: its structure, that structure's relative error, the state bytes
  of the optimizer chosen for it and Adam's (two float32 moments)."""
  path: str
  structure: str
  relative: float
  state_bytes: int
  adam_bytes: int


@dataclasses.dataclass(frozen=True)
class StructureChoice:
  """The result of :func:`choose_structures`: one :class:`LayerChoice` per reported leaf,
  the budget in bytes, and every candidate's ``(relative error, state bytes)`` per leaf
  (``options[path][structure]``)."""
  layers: tuple
  budget_bytes: int
  options: Mapping[str, Mapping[str, tuple]]

  @property
  def structures(self) -> dict:
    """``{leaf path: chosen structure}``."""
    return {c.path: c.structure for c in self.layers}

  @property
  def state_bytes(self) -> int:
    return sum(c.state_bytes for c in self.layers)

  @property
  def adam_bytes(self) -> int:
    return sum(c.adam_bytes for c in self.layers)

  def to_markdown(self) -> str:
    """One row per leaf (structure, error, state vs Adam's), then totals and counts."""
    lines = ["| leaf | structure | relative error | state bytes | vs Adam |",
             "|---|---|---|---|---|"]
    for c in self.layers:
      lines.append(f"| {c.path} | {c.structure} | {c.relative:.3f} | {c.state_bytes:,} | "
                   f"{c.state_bytes / c.adam_bytes:.2f}x |")
    lines.append(f"| total (budget {self.budget_bytes:,}) | | "
                 f"{np.mean([c.relative for c in self.layers]):.3f} (mean) | "
                 f"{self.state_bytes:,} | {self.state_bytes / self.adam_bytes:.2f}x |")
    counts: dict = {}
    for c in self.layers:
      counts[c.structure] = counts.get(c.structure, 0) + 1
    lines += ["", "Leaves per structure: "
              + ", ".join(f"{s} {k}" for s, k in sorted(counts.items())) + "."]
    return "\n".join(lines)


def _leaf_of(matrix: str) -> str:
  """The leaf path of a report row (``path[j]`` is the j-th matrix of a stacked leaf)."""
  return re.sub(r"\[\d+\]$", "", matrix)


def _state_bytes_by_leaf(tx: optax.GradientTransformation, params: Any) -> dict:
  """Bytes of ``tx``'s state attributed to each parameter path (a state leaf belongs to
  the parameter whose path ends its own path; counters belong to none)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [matrices.path_to_str(p) for p, _ in flat]
  with routing.record_routed_inits() as found:
    state = jax.eval_shape(lambda p: tx.init(p), params)  # a new function: no cached trace
  counts = memory.state_sizes_by_leaf(state, [p for p, _ in flat], nbytes=True)
  for rec in found:  # the stacked layout's state, per stack: shared among its members
    if stacking.is_stacked(rec.routed):
      stacking.add_stacked_state(counts, rec, paths, nbytes=True)
  return dict(zip(paths, counts))


def choose_structures(report: FisherReport,
                      optimizers: Mapping[str, optax.GradientTransformation], params: Any, *,
                      budget: Optional[float] = None, budget_bytes: Optional[int] = None,
                      per_leaf: bool = False, resolution: int = 20_000) -> StructureChoice:
  """Per reported leaf, the structure of lowest error whose optimizer fits the budget.

  Args:
    report: a :class:`~fisher_optax.fisher.fisher_report.FisherReport` of ``params``' model.
    optimizers: ``{structure name: the optimizer used for it}``, e.g.
      ``{"diagonal": optax.adam(lr), "two_sided": fo.racs(lr), "soap": fo.soap(lr)}``;
      only these structures are candidates. Each optimizer's state per leaf is measured
      on ``params`` (abstract arrays are enough).
    params: the parameters (any pytree; ``jax.ShapeDtypeStruct`` leaves work).
    budget: state budget as a fraction of Adam's (two float32 moments) over the reported
      leaves, e.g. ``1.0`` for Adam's memory.
    budget_bytes: the budget in bytes instead (exactly one of the two).
    per_leaf: apply ``budget`` to each leaf on its own instead of to their sum.
    resolution: bins of the budget in the dynamic programme (global budget only).

  Returns:
    A :class:`StructureChoice`.

  Raises:
    ValueError: an optimizer for a structure the report lacks, a report leaf absent from
      ``params``, a budget that is not positive, or a budget below the cheapest choice
      (naming the leaf that cannot fit).
  """
  if (budget is None) == (budget_bytes is None):
    raise ValueError("choose_structures: give exactly one of budget (a fraction of "
                     "Adam's state) and budget_bytes")
  if per_leaf and budget is None:
    raise ValueError("choose_structures: per_leaf=True takes budget (a fraction of each "
                     "leaf's Adam state), not budget_bytes")
  if not optimizers:
    raise ValueError("choose_structures: no optimizers given")
  unknown = [s for s in optimizers if s not in report.structures]
  if unknown:
    raise ValueError(f"choose_structures: the report has no structure {unknown}; it has "
                     f"{list(report.structures)}")
  limit = budget if budget is not None else budget_bytes
  if not limit > 0:
    raise ValueError(f"choose_structures: the budget must be positive, got {limit}")
  options, adam = _options(report, optimizers, params)
  leaves = list(options)
  if per_leaf:
    picks = _per_leaf_picks(options, adam, budget)
    total = sum(int(budget * adam[k]) for k in leaves)
  else:
    total = int(budget * sum(adam.values())) if budget is not None else int(budget_bytes)
    need = sum(_cheapest(options[k]) for k in leaves)
    if need > total:
      worst = max(leaves, key=lambda k: _cheapest(options[k]))
      raise ValueError(f"choose_structures: budget {total:,} bytes is below the cheapest "
                       f"choice, {need:,} bytes; the largest cheapest leaf is {worst!r} at "
                       f"{_cheapest(options[worst]):,} bytes")
    picks = _knapsack(leaves, options, total, resolution)
  layers = tuple(LayerChoice(k, picks[k], options[k][picks[k]][0], options[k][picks[k]][1],
                             adam[k]) for k in leaves)
  return StructureChoice(layers, total, options)


def _options(report: FisherReport, optimizers: Mapping[str, optax.GradientTransformation],
             params: Any) -> tuple[dict, dict]:
  """``{leaf: {structure: (relative error, state bytes)}}`` for the report's leaves (the
  mean error over a stacked leaf's matrices) and Adam's bytes per leaf."""
  errors: dict = {}
  for r in report.rows:
    if r.structure in optimizers:
      if not math.isfinite(r.relative):
        raise ValueError(f"choose_structures: the report's {r.structure} error of "
                         f"{r.matrix!r} is {r.relative}; a report needs finite errors")
      errors.setdefault(_leaf_of(r.matrix), {}).setdefault(r.structure, []).append(r.relative)
  sizes = {matrices.path_to_str(p): int(math.prod(np.shape(x)))
           for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing = [k for k in errors if k not in sizes]
  if missing:
    raise ValueError(f"choose_structures: report leaf {missing[0]!r} is not in params "
                     f"(params has {list(sizes)[:6]}...)")
  state = {s: _state_bytes_by_leaf(tx, params) for s, tx in optimizers.items()}
  options = {k: {s: (float(np.mean(errors[k][s])), int(state[s][k]))
                 for s in optimizers if s in errors[k]} for k in errors}
  return options, {k: 8 * sizes[k] for k in errors}


def _cheapest(leaf_options: dict) -> int:
  return min(b for _, b in leaf_options.values())


def _per_leaf_picks(options: dict, adam: dict, budget: float) -> dict:
  """Each leaf's lowest-error structure within ``budget`` x its own Adam bytes."""
  picks = {}
  for k, opts in options.items():
    fits = {s: eb for s, eb in opts.items() if eb[1] <= budget * adam[k]}
    if not fits:
      raise ValueError(f"choose_structures: leaf {k!r} has no structure within "
                       f"{budget:g} x Adam's {adam[k]:,} bytes (cheapest: "
                       f"{_cheapest(opts):,} bytes)")
    picks[k] = min(fits, key=lambda s: (fits[s][0], fits[s][1]))
  return picks


def _knapsack(leaves: list, options: dict, total: int, resolution: int) -> dict:
  """Exact multiple-choice knapsack on ``resolution`` bins (bytes rounded up per option):
  minimal summed error within ``total`` bytes; ties go to the smaller state."""
  unit = total / resolution
  best = np.zeros(resolution + 1)  # best[b]: least error of the leaves so far in <= b bins
  picks = []
  for k in leaves:
    names = sorted(options[k], key=lambda s: (options[k][s][1], options[k][s][0]))
    new = np.full(resolution + 1, np.inf)
    arg = np.full(resolution + 1, -1)
    for i, s in enumerate(names):
      e, b = options[k][s]
      w = math.ceil(b / unit - 1e-9)
      if w > resolution:
        continue
      cand = np.full(resolution + 1, np.inf)
      cand[w:] = best[:resolution + 1 - w] + e
      better = cand < new - 1e-12
      new = np.where(better, cand, new)
      arg = np.where(better, i, arg)
    best = new
    picks.append((names, arg))
  if not np.isfinite(best[resolution]):
    raise ValueError("choose_structures: no choice fits the budget at this resolution; "
                     "raise the budget or the resolution")
  out, b = {}, resolution
  for k, (names, arg) in zip(reversed(leaves), reversed(picks)):
    s = names[arg[b]]
    out[k] = s
    b -= math.ceil(options[k][s][1] / unit - 1e-9)
  return out


def per_layer(choice: StructureChoice, optimizers: Mapping[str, optax.GradientTransformation],
              *, fallback: optax.GradientTransformation) -> optax.GradientTransformation:
  """The optimizer of a :class:`StructureChoice`: ``optax.partition`` sending each chosen
  leaf to ``optimizers[its structure]`` and every other leaf to ``fallback``.

  Args:
    choice: from :func:`choose_structures`.
    optimizers: ``{structure name: optimizer}``, the same as given to the choice.
    fallback: the optimizer of the leaves the report does not cover (embeddings, norms,
      biases), e.g. ``optax.adamw(lr)``.

  Raises:
    ValueError: a chosen structure without an optimizer here; at ``init``, a chosen leaf
      absent from the parameters.
  """
  chosen = choice.structures
  used = sorted(set(chosen.values()))
  lacking = [s for s in used if s not in optimizers]
  if lacking:
    raise ValueError(f"per_layer: the choice uses {lacking} but optimizers has only "
                     f"{sorted(optimizers)}")
  transforms = {s: optimizers[s] for s in used}
  transforms[FALLBACK] = fallback

  def labels(params):
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [matrices.path_to_str(p) for p, _ in flat]
    absent = sorted(set(chosen) - set(paths))
    if absent:
      raise ValueError(f"per_layer: chosen leaf {absent[0]!r} is not in the parameters")
    return jax.tree_util.tree_unflatten(treedef, [chosen.get(p, FALLBACK) for p in paths])

  return optax.partition(transforms, labels)
