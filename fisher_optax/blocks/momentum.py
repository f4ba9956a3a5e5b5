"""Momentum as Muon keeps it (paper App. "Muon", Eq. "Muon update"; ``optax.contrib``'s
``scale_by_muon``): an exponential moving average of the gradient with bias correction,
optionally in Nesterov form::

    m_t = beta m_{t-1} + (1 - beta) G_t
    out = m_t / (1 - beta^t)                                            (nesterov=False)
    out = beta m_t / (1 - beta^(t+1)) + (1 - beta) G_t / (1 - beta^t)   (nesterov=True)

exactly as ``optax.contrib.scale_by_muon`` forms it before orthogonalising, so that
``chain(scale_by_momentum, whiten, ...)`` reproduces Muon. The paper reads Muon as the
whitening structure ``I (x) M`` applied to ``E[G]``, estimated by this momentum
(App. "Connection to existing optimizers"). State: ``m`` (one number per parameter,
float32 unless ``mu_dtype`` says otherwise, as all fisher_optax state) and a step counter.
Computed in float32; the output is cast (saturating) to the gradient dtype, so float16
gradients near the top of their range do not overflow in the bias correction.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, validation


class ScaleByMomentumState(NamedTuple):
  """State of :func:`scale_by_momentum`: the step count (for the bias correction) and
  the momentum ``M`` (float32, shaped like the updates)."""

  count: jax.Array  # int32 step counter
  mu: optax.Updates


def scale_by_momentum(beta: float = 0.95, *, nesterov: bool = True,
                      mu_dtype: Optional[jnp.dtype] = None) -> optax.GradientTransformation:
  """Bias-corrected EMA of the gradient, Nesterov form by default (Muon's momentum).

  Args:
    beta: EMA decay, in [0, 1).
    nesterov: return the Nesterov look-ahead combination (see the module docstring).
    mu_dtype: dtype of the stored moment (default float32).
  """
  validation.check_range("beta", beta, low=0.0, high=1.0)

  mu_dtype = jnp.float32 if mu_dtype is None else mu_dtype

  def init_fn(params):
    return ScaleByMomentumState(count=jnp.zeros([], jnp.int32),
                                mu=optax.tree.zeros_like(params, dtype=mu_dtype))

  def update_fn(updates, state, params=None):
    del params
    grads = updates
    updates = optax.tree.cast(updates, jnp.float32)
    mu = optax.tree.update_moment(updates, optax.tree.cast(state.mu, jnp.float32), beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      out = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                         optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                         optax.tree.bias_correction(updates, beta, count))
    else:
      out = optax.tree.bias_correction(mu, beta, count)
    out = jax.tree.map(lambda o, g: lifting.cast_like(o, g.dtype), out, grads)
    return out, ScaleByMomentumState(count=count, mu=optax.tree.cast(mu, mu_dtype))

  return optax.GradientTransformation(init_fn, update_fn)
