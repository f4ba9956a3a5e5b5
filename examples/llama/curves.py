"""Reading eval-loss curves: when a run first reaches a target loss, and seed statistics.

Shared by ``compare.py`` and ``benchmarks/convergence.py`` so both count the same way.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


def crossing(rows: Sequence[dict], target: float, x: str = "step") -> Optional[float]:
  """First ``x`` (``"step"`` or ``"wall_s"``) at which the eval loss reaches ``target``.

  Linear interpolation between the last evaluation above the target and the first at or
  below it; ``None`` when no evaluation reaches it (the run never got there). The curve
  before the first evaluation is unknown, so a first evaluation already at or below the
  target gives that evaluation's ``x``: evaluate often (``compare.py`` and the harness
  evaluate every 2.5% of the budget) so that this resolves the crossing finely.
  """
  prev_x, prev_l = None, None
  for r in rows:
    xv, lv = float(r[x]), float(r["eval_loss"])
    if not math.isfinite(lv):
      return None
    if lv <= target:
      if prev_l is None or prev_l <= lv:
        return xv
      return prev_x + (xv - prev_x) * (prev_l - target) / (prev_l - lv)
    prev_x, prev_l = xv, lv
  return None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and (population) standard deviation of the finite values; NaN if none."""
  v = np.asarray([x for x in values if x is not None and math.isfinite(x)], float)
  if v.size == 0:
    return float("nan"), float("nan")
  return float(v.mean()), float(v.std())


def verdict(mean: float, std: float, ref_mean: float, ref_std: float) -> str:
  """``wins`` / ``ties`` / ``loses`` against a reference (lower is better).

  A tie is a difference of means within the sum of the two seed standard deviations.
  """
  if not math.isfinite(mean):
    return "loses (diverged)"
  tol = (std if math.isfinite(std) else 0.0) + (ref_std if math.isfinite(ref_std) else 0.0)
  if mean < ref_mean - tol:
    return "wins"
  if mean > ref_mean + tol:
    return "loses"
  return "ties"
