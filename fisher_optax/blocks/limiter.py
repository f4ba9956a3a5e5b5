"""Norm-growth limiter (Fira; paper Alg. "RACS" lines 9-10 and Alg. "Compensation" lines 4-6).

For each matrix, with ``phi`` the (limited) norm of the previous step::

    eta  = gamma / max(||X_t||_F / phi, gamma)     if phi > 0, else 1
    phi <- eta * ||X_t||_F
    X_t <- eta * X_t

so the Frobenius norm of the output grows by at most a factor ``gamma`` per step.
The paper writes "eta = 1 at t = 1" (RACS) and "eta = 1 if phi = 0" (Compensation);
both read ``eta = 1 while phi = 0`` here, which also keeps a run that starts with
all-zero gradients from being frozen at eta = 0 forever.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import optax

from fisher_optax import grouping, lifting, matrices, validation
from fisher_optax.linalg import limit_growth  # the rule, shared with compensate


class NormGrowthLimiterState(NamedTuple):
  """``phi``: per matrix (shape = batch shape of the leaf; ``()`` for non-matrices)."""
  phi: optax.Updates


def norm_growth_limiter(limiter: float = 1.01, *,
                        dims: matrices.DimsSpec = None) -> optax.GradientTransformation:
  """Fira's norm-growth limiter, per matrix (stacked leaves: per slice).

  Args:
    limiter: ``gamma > 0``, the largest allowed growth factor of the update
      norm between consecutive steps (paper: 1.01).
    dims: matrix axes of leaves with ndim >= 2 (default: the last two). Leaves
      with ndim < 2 are limited as one block.

  Returns:
    An ``optax.GradientTransformation``; its update implements
    ``X <- gamma / max(||X|| / phi, gamma) * X`` (module docstring).
  """
  validation.check_range("limiter", limiter, low=0.0, high=float("inf"), low_open=True)

  def lift(tree):
    return lifting.Lifted(tree, dims, what="norm_growth_limiter", vectors=True)

  def norm(x, view):  # per matrix of a stack; a vector or scalar is one tensor
    x = x.astype(jnp.float32)
    if view is None:
      return jnp.sqrt(jnp.sum(jnp.square(x)))
    return jnp.sqrt(jnp.sum(jnp.square(view.to_canonical(x)), axis=(-2, -1)))

  def leaf(u, phi, view):
    eta, phi = limit_growth(norm(u, view), phi, limiter)
    if view is not None:
      eta = view.expand_batch(eta)
    return lifting.cast_like(u * eta, u.dtype), phi

  def init_fn(params):
    return NormGrowthLimiterState(phi=lift(params).per_view(
        lambda v: jnp.zeros(v.batch_shape if v else (), jnp.float32)))

  def update_fn(updates, state, params=None):
    del params
    lifted = lift(updates)
    out, new_phi = [], []
    one = grouping.shared(leaf, static_argnums=2)
    for u, phi, view in zip(lifted.leaves, lifted.leaves_of(state.phi), lifted.views):
      o, phi = one(u, phi, view)
      out.append(o)
      new_phi.append(phi)
    return lifted.unflatten(out), NormGrowthLimiterState(phi=lifted.unflatten(new_phi))

  return optax.GradientTransformation(init_fn, update_fn)
