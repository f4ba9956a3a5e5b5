"""A per-layer Fisher-structure report of a model: for every matrix a named optimizer
would route, how close each structure of :mod:`fisher_optax.fisher.structure_errors` comes to
that layer's empirical Fisher, and at what memory.

``fisher_report(loss_fn, params, batches, rank=...)`` takes one gradient sample per batch
(``jax.grad`` of ``loss_fn(params, batch)``; pass micro-batches), routes the leaves as the
named optimizers do (``mask``/``dims``, matrices read on their smaller side, every matrix
of a stacked leaf on its own), and returns a :class:`FisherReport`: rows of (matrix,
structure, relative error, numbers the structure holds, Adam's ``2mn``), printable as a
markdown table, writable as CSV, drawable as a heat map (layers x structures). It works
on any params pytree (Flax NNX state, Linen dicts, plain dicts).
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import numpy as np

from fisher_optax import matrices, model_dims, routing
from fisher_optax.fisher import structure_errors as se


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One matrix and one structure: ``matrix`` is the leaf's path (``[i]`` for the i-th
  matrix of a stacked leaf), ``m x n`` its canonical shape (``m <= n``)."""
  matrix: str
  m: int
  n: int
  structure: str
  relative: float
  numbers: int

  @property
  def adam_numbers(self) -> int:
    return 2 * self.m * self.n


@dataclasses.dataclass(frozen=True)
class FisherReport:
  """Rows of :func:`fisher_report`, with ``samples`` gradient samples per matrix."""
  rows: tuple
  samples: int
  structures: tuple

  @property
  def matrices(self) -> list:
    seen = {}
    for r in self.rows:
      seen.setdefault(r.matrix, (r.m, r.n))
    return list(seen)

  def table(self) -> dict:
    """``{matrix: {structure: relative error}}``."""
    out: dict = {}
    for r in self.rows:
      out.setdefault(r.matrix, {})[r.structure] = r.relative
    return out

  def best(self) -> dict:
    """``{matrix: the structure with the lowest relative error}``."""
    return {k: min(v, key=v.get) for k, v in self.table().items()}

  def to_markdown(self) -> str:
    """One row per matrix, one column per structure (relative error; the lowest in
    bold), then each structure's numbers as a share of Adam's ``2mn`` over all rows."""
    shapes = {r.matrix: (r.m, r.n) for r in self.rows}
    table = self.table()
    head = "| matrix | m x n | " + " | ".join(self.structures) + " |"
    lines = [head, "|" + "---|" * (len(self.structures) + 2)]
    for name, errs in table.items():
      best = min(errs.values())
      cells = [(f"**{errs[s]:.3f}**" if errs[s] == best else f"{errs[s]:.3f}")
               if s in errs else "-" for s in self.structures]
      lines.append(f"| {name} | {shapes[name][0]} x {shapes[name][1]} | " + " | ".join(cells)
                   + " |")
    adam = sum(2 * m * n for m, n in shapes.values())
    mem = {s: sum(r.numbers for r in self.rows if r.structure == s) for s in self.structures}
    lines.append("| numbers vs Adam's | | " + " | ".join(f"{mem[s] / adam:.1%}"
                                                        for s in self.structures) + " |")
    return "\n".join(lines)

  @classmethod
  def from_csv(cls, path) -> "FisherReport":
    """The report ``to_csv`` wrote (errors at the 6 digits written)."""
    with pathlib.Path(path).open(newline="") as f:
      recs = list(csv.DictReader(f))
    if not recs:
      raise ValueError(f"FisherReport.from_csv: {path} has no rows")
    rows = tuple(ReportRow(r["matrix"], int(r["m"]), int(r["n"]), r["structure"],
                           float(r["relative_error"]), int(r["numbers"])) for r in recs)
    structures = tuple(dict.fromkeys(r.structure for r in rows))
    return cls(rows, int(recs[0]["samples"]), structures)

  def to_csv(self, path) -> None:
    with pathlib.Path(path).open("w", newline="") as f:
      w = csv.writer(f)
      w.writerow(["matrix", "m", "n", "structure", "relative_error", "numbers",
                  "adam_numbers", "samples"])
      for r in self.rows:
        w.writerow([r.matrix, r.m, r.n, r.structure, f"{r.relative:.6g}", r.numbers,
                    r.adam_numbers, self.samples])

  def heatmap(self, path, *, title: Optional[str] = None) -> None:
    """Layers x structures, colour = relative error (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = self.matrices
    table = self.table()
    data = np.array([[table[k].get(s, np.nan) for s in self.structures] for k in names])
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(self.structures), 1.0 + 0.28 * len(names)))
    im = ax.imshow(data, cmap="viridis_r", aspect="auto", vmin=0.0,
                   vmax=max(1.0, float(np.nanmax(data))))
    ax.set_xticks(range(len(self.structures)), self.structures, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    for i in range(len(names)):
      j = int(np.nanargmin(data[i]))
      ax.text(j, i, "*", ha="center", va="center", color="white", fontsize=9)
    fig.colorbar(im, ax=ax, label="||F~ - F|| / ||F||")
    ax.set_title(title or f"Fisher structure errors ({self.samples} samples; * lowest)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _per_matrix_samples(grads: Sequence[Any], params: Any, mask: Any, dims: Any) -> dict:
  """``{matrix name: [N, m, n] float32}`` for the routed matrices of the gradients."""
  labels = jax.tree.leaves(routing.resolve_mask(mask, params, dims))
  dims_leaves = jax.tree.leaves(model_dims.resolve_dims(dims, params),
                                is_leaf=lambda x: isinstance(x, matrices.MatrixDims))
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  per_sample = [jax.tree.leaves(g) for g in grads]
  out = {}
  for i, ((path, p), sel, d) in enumerate(zip(flat, labels, dims_leaves)):
    if not sel:
      continue
    view = matrices.matrix_view(np.shape(p), d, smaller_first=True)
    name = matrices.path_to_str(path)
    stack = np.stack([np.asarray(view.to_canonical(g[i]), np.float32).reshape(
        (view.num_matrices, view.m, view.n)) for g in per_sample])
    for j in range(view.num_matrices):
      out[name if view.num_matrices == 1 else f"{name}[{j}]"] = stack[:, j]
  return out


def fisher_report(loss_fn: Callable[[Any, Any], Any], params: Any, batches: Iterable[Any], *,
                  rank: int, dims: Any = None, mask: Any = None,
                  structures: Sequence[str] = se.STRUCTURES,
                  max_samples: Optional[int] = None) -> FisherReport:
  """Each routed matrix's structure errors from one gradient sample per batch.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (JAX-differentiable).
    params: the parameters (any pytree).
    batches: an iterable of batches; each gives one gradient sample (use micro-batches:
      the Fisher is estimated from their gradients).
    rank: Alice's rank ``r``, clipped per matrix to its smaller side minus one.
    dims: the optimizers' ``dims=`` (e.g. ``fo.flax_dims(model)``).
    mask: the optimizers' ``mask=`` (default: matrices).
    structures: which structures (``structure_errors.STRUCTURES``).
    max_samples: stop after this many batches.

  Raises:
    ValueError: fewer than two batches, non-finite gradients, or a matrix too small for
      a structure; each names the matrix.
  """
  grad_fn = jax.jit(jax.grad(loss_fn))
  grads = []
  for k, batch in enumerate(batches):
    if max_samples is not None and k >= max_samples:
      break
    grads.append(jax.device_get(grad_fn(params, batch)))
  if len(grads) < 2:
    raise ValueError(f"fisher_report: an empirical Fisher needs at least two batches, got "
                     f"{len(grads)}")
  rows = []
  for name, samples in _per_matrix_samples(grads, params, mask, dims).items():
    m = samples.shape[1]
    res = se.structure_errors(samples, rank=max(1, min(rank, m - 1)), structures=structures,
                              name=name, smaller_first=False)
    for s in structures:
      rows.append(ReportRow(name, samples.shape[1], samples.shape[2], s, res[s].relative,
                            res[s].numbers))
  return FisherReport(tuple(rows), len(grads), tuple(structures))
