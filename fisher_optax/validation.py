"""Argument validation shared by the blocks and named optimizers: one place, one wording.

Errors name the argument as the user passed it; traced values (e.g. hyperparameters
injected by ``optax.inject_hyperparams``) are not checked, except that shape-fixing ones
must be static (:func:`static_int`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def static_int(name: str, value: Any) -> Optional[int]:
  """``value`` as a Python int (it fixes array shapes or a loop length).

  Raises a clear ``ValueError`` when it is traced, e.g. because
  ``optax.inject_hyperparams`` was not told it is static (use
  :func:`fisher_optax.inject_hyperparams`, which is).
  """
  if value is None:
    return None
  if not _is_concrete(value):
    raise ValueError(
        f"`{name}` determines array shapes and must be static; with "
        f"optax.inject_hyperparams pass static_args=('{name}', ...) or use "
        "fisher_optax.inject_hyperparams, which does it for you.")
  return int(value)


def check_int(name: str, value: Any, *, low: int, high: Optional[int] = None,
              allow_none: bool = False) -> None:
  """Raises ``ValueError`` naming ``name`` unless ``low <= value (<= high)``."""
  if value is None and allow_none:
    return
  if not _is_concrete(value):
    return
  rng = f"[{low}, {high}]" if high is not None else f">= {low}"
  if isinstance(value, bool) or int(value) != value:
    raise ValueError(f"`{name}` must be an integer {rng}, got {value!r}")
  if value < low or (high is not None and value > high):
    raise ValueError(f"`{name}` must be an integer {rng}, got {value!r}")


def check_range(name: str, value: Any, *, low: float, high: float,
                low_open: bool = False, high_open: bool = True,
                allow_none: bool = False) -> None:
  """Raises ``ValueError`` naming ``name`` unless ``value`` lies in the interval.

  Traced values (e.g. inside ``optax.inject_hyperparams``) are not checked.
  """
  if value is None and allow_none:
    return
  if callable(value) or not _is_concrete(value):
    return
  v = float(value)
  lo_ok = v > low if low_open else v >= low
  hi_ok = v < high if high_open else v <= high
  if not (lo_ok and hi_ok) or math.isnan(v):
    interval = ("(" if low_open else "[") + f"{low}, {high}" + (")" if high_open else "]")
    raise ValueError(f"`{name}` must lie in {interval}, got {value!r}")


def check_learning_rate(name: str, value: Any) -> None:
  """Raises a ``TypeError`` naming ``name`` unless ``value`` is a number (a scalar array
  included) or a schedule, as optax takes: a string such as ``"1e-2"`` would otherwise
  pass ``init`` and fail deep inside the first ``update``."""
  if callable(value) or not _is_concrete(value):
    return
  import numpy as np
  if isinstance(value, (str, bytes, bool)) or value is None or not (
      isinstance(value, (int, float, np.number)) or
      (hasattr(value, "dtype") and np.ndim(value) == 0
       and np.issubdtype(np.asarray(value).dtype, np.number))):
    hint = " (a string: pass the number, e.g. 1e-2)" if isinstance(value, (str, bytes)) else ""
    raise TypeError(f"`{name}` must be a number or a schedule (a function of the step "
                    f"count), got {value!r}{hint}")
