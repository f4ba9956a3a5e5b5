"""Optimizer-state sizes: measured from state trees, and the paper's formulas.

Paper App. Table "memory consumption of low-rank optimizers" and Sec. 4 (RACS),
for one ``m x n`` matrix with ``m <= n`` and rank ``r`` (weights excluded):

=============  ===========================
RACS           ``m + n + 1``
GaLore         ``2nr + mr``
Fira           ``2nr + mr`` (+1 limiter scalar)
Alice          ``2nr + mr + r^2 + n`` (+1 limiter scalar)
Alice-0        ``2nr + mr + n`` (+1)
Alice-SOAP     ``mr + r^2 + nk + k^2 + 2rk + n + r`` (+2 limiter scalars; ``k`` the
               right rank, default ``r``; not in the paper: docs/low_rank_soap.md)
Dion           ``mn + mr`` (momentum and the smaller side's ``Q``; Ahn et al. 2025,
               arXiv:2504.05295, not in the paper; ``r`` as given or a fraction of ``m``)
Apollo         ``2nr`` (+1 limiter scalar)
Apollo-mini    ``2n`` (+1 limiter norm) -- the paper's ``2n + 2`` counts a stored seed;
               here the projection's key follows from the step counter
Eigen-Adam     ``2m^2 + 2mn`` (statistics, basis, moments)
SOAP           ``2m^2 + 2n^2 + 2mn``
Shampoo        ``2m^2 + 2n^2 + m + n`` (statistics, bases, eigenvalues)
Adam           ``2mn``
=============  ===========================

(Rotation methods: a side larger than ``max_precond_dim`` drops its ``d^2`` terms.)

The "+1" scalars (limiter norms), step counters and PRNG keys are listed
separately by :func:`paper_state_numbers` (``extra``).
"""

from __future__ import annotations

from typing import Any

import math

import jax
import numpy as np

from fisher_optax import matrices
from fisher_optax.blocks.power import power_rank


def state_bytes(state: Any) -> int:
  """Total bytes of the array leaves of ``state`` (works on ``jax.eval_shape`` output)."""
  total = 0
  for x in jax.tree.leaves(state):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  return total


def state_numbers(state: Any) -> int:
  """Total number of elements of the array leaves of ``state``."""
  return sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state)
             if hasattr(x, "shape"))


def state_sizes_by_leaf(state, param_paths, *, nbytes: bool = False) -> list[int]:
  """Optimizer-state numbers (or bytes) attributed to each parameter: a state leaf belongs
  to the parameter whose path ends its own path (counters and keys belong to none)."""
  keys = {tuple(matrices.path_to_str([k]) for k in p): i for i, p in enumerate(param_paths)}
  longest = max((len(k) for k in keys), default=0)
  counts = [0] * len(param_paths)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = tuple(matrices.path_to_str([k]) for k in path)
    for n in range(min(longest, len(names)), 0, -1):
      i = keys.get(names[-n:])
      if i is not None:
        size = int(math.prod(getattr(leaf, "shape", ())))
        counts[i] += size * (np.dtype(leaf.dtype).itemsize if nbytes else 1)
        break
  return counts


def paper_state_numbers(name: str, m: int, n: int, rank: int = 0,
                        right_rank: int | None = None) -> tuple[int, int]:
  """``(formula, extra)``: the paper's per-matrix state numbers, and per-matrix scalars.

  ``m, n`` are the matrix sizes in any order (the formulas use ``m <= n``), except for
  ``normuon``, whose per-neuron moment needs them as ``(fan_in, fan_out)``;
  ``rank`` is clipped to ``min(m, n)`` (Dion: an int, or a float fraction of it rounded
  up); ``right_rank`` (Alice-SOAP's ``k``, default
  ``rank``) to ``n``.
  """
  if name == "normuon":  # momentum and one second moment per fan-out unit
    return m * n + n, 0
  m, n = min(m, n), max(m, n)
  r = power_rank(rank, m)  # an int clipped to m, or Dion's fraction of m rounded up
  k = min(rank if right_rank is None else right_rank, n)
  table = {
      "racs": (m + n, 1),
      "galore": (2 * n * r + m * r, 0),
      "fira": (2 * n * r + m * r, 1),
      "alice": (2 * n * r + m * r + r * r + n, 1),
      "alice0": (2 * n * r + m * r + n, 1),
      "alice_soap": (m * r + r * r + n * k + k * k + 2 * r * k + n + r, 2),
      "dion": (m * n + m * r, 0),
      "apollo": (2 * n * r, 1),
      "apollo_mini": (2 * n, 1),
      "eigen_adam": (2 * m * m + 2 * m * n, 0),
      "soap": (2 * m * m + 2 * n * n + 2 * m * n, 0),
      "shampoo": (2 * m * m + 2 * n * n + m + n, 0),
      "adam": (2 * m * n, 0),
  }
  if name not in table:
    raise ValueError(f"no formula for {name!r}; known: {sorted(table)}")
  return table[name]
