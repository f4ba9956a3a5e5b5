"""Adam-style moments without bias correction, and the bias correction as its own block.

:func:`scale_by_moments` is the moment step of Alice (paper Alg. "Alice", lines 12-14)::

    M_t = b1 M_{t-1} + (1 - b1) X,   V_t = b2 V_{t-1} + (1 - b2) X^2,
    out = M_t / (sqrt(V_t) + eps)                       (no bias correction)

:func:`scale_by_bias_correction` multiplies by ``sqrt(1 - b2^t) / (1 - b1^t)``: the
step-size form of Adam's bias correction used by the GaLore and Fira releases
(``torch`` AdamW), applied *after* back-projection and compensation. The chain
``scale_by_moments -> scale_by_bias_correction`` equals ``optax.scale_by_adam``
with ``eps`` replaced by ``eps * sqrt(1 - b2^t)``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from fisher_optax import grouping, lifting, linalg, validation


class ScaleByMomentsState(NamedTuple):
  """State of :func:`scale_by_moments`: the EMAs ``M`` of ``X`` and ``V`` of ``X^2``."""

  mu: optax.Updates
  nu: optax.Updates


def scale_by_moments(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                     mu_dtype: Optional[jnp.dtype] = None) -> optax.GradientTransformation:
  """``M / (sqrt(V) + eps)`` with EMAs ``M``, ``V`` of ``X``, ``X^2``; no bias correction.

  Args:
    b1: first-moment decay, [0, 1).
    b2: second-moment decay, [0, 1).
    eps: added to ``sqrt(V)``, >= 0.
    mu_dtype: dtype of both moments (default float32).
  """
  validation.check_range("b1", b1, low=0.0, high=1.0)
  validation.check_range("b2", b2, low=0.0, high=1.0)
  validation.check_range("eps", eps, low=0.0, high=float("inf"))
  dtype = mu_dtype or jnp.float32

  def init_fn(params):
    return ScaleByMomentsState(mu=otu.tree_zeros_like(params, dtype=dtype),
                               nu=otu.tree_zeros_like(params, dtype=dtype))

  def leaf(u, mu, nu):
    x = u.astype(jnp.float32)
    mu = linalg.ema(b1, mu.astype(jnp.float32), x)
    nu = linalg.ema(b2, nu.astype(jnp.float32), jnp.square(x))
    out = lifting.cast_like(mu / (jnp.sqrt(nu) + eps), u.dtype)
    return out, mu.astype(dtype), nu.astype(dtype)

  def update_fn(updates, state, params=None):
    del params
    # traced once per leaf shape (grouping.shared)
    res = jax.tree.map(grouping.shared(leaf), updates, state.mu, state.nu)
    pick = lambda i: jax.tree.map(lambda _, r: r[i], updates, res)  # noqa: E731
    return pick(0), ScaleByMomentsState(mu=pick(1), nu=pick(2))

  return optax.GradientTransformation(init_fn, update_fn)


class ScaleByBiasCorrectionState(NamedTuple):
  """State of :func:`scale_by_bias_correction`: the step count ``t``."""

  count: jax.Array


def scale_by_bias_correction(b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
  """Multiplies updates by ``sqrt(1 - b2^t) / (1 - b1^t)`` (t counts from 1)."""
  validation.check_range("b1", b1, low=0.0, high=1.0)
  validation.check_range("b2", b2, low=0.0, high=1.0)

  def init_fn(params):
    del params
    return ScaleByBiasCorrectionState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    t = count.astype(jnp.float32)
    decay1, decay2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
    factor = jnp.sqrt(1 - decay2 ** t) / (1 - decay1 ** t)
    out = jax.tree.map(lambda u: lifting.cast_like(u * factor, u.dtype), updates)
    return out, ScaleByBiasCorrectionState(count=count)

  return optax.GradientTransformation(init_fn, update_fn)
