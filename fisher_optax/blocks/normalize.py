"""Normalization: ``Normalize(G) = G S^{-1/2}`` and SWAN's ``GradNorm`` (paper Sec. 3.3
"Normalization and Whitening", Eq. "whiten and normal operator"; App. "Operators for
gradient" and "SWAN", Eq. "gradnorm and whitening").

Structure ``F ~ S (x) I_m`` with positive diagonal ``S`` (paper Prop. "Normalization and
whitening"): the optimum is ``S* = E[diag(g_1^T g_1, ..., g_n^T g_n)] / m`` and its
square-root NGD direction ``sqrt(m) G S*^{-1/2}``; with a one-sample estimate that is
``sqrt(m)`` times the normalization operator, which divides every column ``g_j`` of ``G``
by its l2 norm::

    Normalize(G) = G diag(s)^{-1/2},   s_j = sum_i G_ij^2          (center=False)

SWAN's ``GradNorm`` standardises instead: with the mean ``g_bar`` and standard
deviation ``s`` of each row over the ``n`` columns (both ``m``-vectors)::

    GradNorm(G) = (G - g_bar 1_n^T) / (s 1_n^T)                   (center=True)

i.e. every row gets zero mean and unit RMS; without the mean it is the row-wise
normalization up to ``sqrt(n)`` (the paper's remark). ``axis`` picks whether the
statistic is taken per column (``"columns"``, the paper's ``Normalize``) or per row
(``"rows"``, SWAN's ``GradNorm``) of the canonical ``m x n`` view with ``m <= n`` (tall
matrices are read as their transpose, so ``"rows"`` always runs over the longer side).

A column (row) whose statistic is zero gives zero there; ``eps`` is added to the norm
(standard deviation). Centering a constant row leaves float32 rounding noise of about
``1e-7 max|G|`` where the exact result is zero, and that noise depends on the order of
the summation; a row whose standard deviation is below ``1e-6 max|G|`` is therefore
taken as constant and gives exactly zero, not its rounding noise scaled to unit RMS.
Float32 inside, the parameter dtype outside; non-finite entries stay visible. No state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, matrices, validation


_CENTER_FLOOR = 1e-6  # relative to max|G|: above float32's cancellation noise


def normalize_matrix(g: jax.Array, axis: str, center: bool, eps: float) -> jax.Array:
  """One canonical ``m x n`` matrix, float32 (see the module docstring)."""
  red = 0 if axis == "columns" else 1
  x = g.astype(jnp.float32)
  c = jnp.max(jnp.abs(x))
  c = jnp.where((c > 0) & jnp.isfinite(c), c, 1.0)
  x = x / c  # scale-free: the result does not depend on the gradient's magnitude
  if center:
    x = x - jnp.mean(x, axis=red, keepdims=True)
    scale = jnp.sqrt(jnp.mean(jnp.square(x), axis=red, keepdims=True))
    # centering noise: x is at most 1 here, its float32 cancellation error ~1e-7
    return jnp.where(scale <= _CENTER_FLOOR, 0.0, x / (scale + eps / c))  # NaN stays NaN
  scale = jnp.sqrt(jnp.sum(jnp.square(x), axis=red, keepdims=True))
  return x / (scale + eps / c)


def normalize(*, axis: str = "columns", center: bool = False, eps: float = 1e-8,
              dims: matrices.DimsSpec = None) -> optax.GradientTransformation:
  """Column (``G S^{-1/2}``) or row normalization, or SWAN's ``GradNorm`` (``center``).

  Args:
    axis: ``"columns"``: every column divided by its l2 norm (paper's ``Normalize``);
      ``"rows"``: every row of the canonical view (``m <= n``), over the longer side.
    center: subtract the mean and divide by the standard deviation instead (SWAN's
      ``GradNorm``, with ``axis="rows"``).
    eps: added to the norm (standard deviation), in the gradient's units.
    dims: matrix axes of each leaf (default: the last two; others are batch axes).

  Returns:
    A stateless ``optax.GradientTransformation``; updates keep the gradient dtype.
  """
  if axis not in ("columns", "rows"):
    raise ValueError(f"`axis` must be 'columns' or 'rows', got {axis!r}")
  validation.check_range("eps", eps, low=0.0, high=1.0)

  def update_fn(updates, state, params=None):
    del params
    out = lifting.map_stateless(lambda g, _: normalize_matrix(g, axis, center, eps), updates,
                                 dims, side="smaller", what="normalize")
    return out, state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
