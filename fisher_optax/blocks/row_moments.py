"""One-sided second moments: NorMuon's per-neuron normalization, and the RMS convention
of an update whose magnitude no longer follows from its shape.

``scale_by_row_moments`` keeps, for every unit of one side of each ``m x n`` matrix (rows
= fan-in, columns = fan-out), an EMA of the mean square of the update over the other
side, and divides by its square root. With ``unit="fan_out"`` (default; NorMuon's
neurons, arXiv:2510.05491, Alg. 1)::

    v_j <- b2 v_j + (1 - b2) (1/m) sum_i O_ij^2        j = 1..n (fan-out units)
    out = O diag(sqrt(v) + eps)^-1

This is the diagonal structure ``F ~ diag(v) (x) I_m`` of the paper's framework
(Sec. 3.3, "normalization": one diagonal scale per column) estimated by an EMA, applied
here to an already whitened update. State per matrix: ``n`` numbers (``m`` with
``unit="fan_in"``), float32, no bias correction (as NorMuon; a common factor, which the
following :func:`scale_to_rms` removes). Like Adam's second moment, ``eps`` is absolute:
the block expects updates of moderate scale, such as the whitened ones NorMuon feeds it
(a non-finite mean square leaves ``v`` unchanged and the entry visible).

``scale_to_rms`` rescales each matrix to a fixed RMS::

    out = rms * sqrt(m n) * X / ||X||_F

NorMuon's and Moonshot's convention (``rms = 0.2``: the update of ``lr * out`` has the
RMS of AdamW's at ``lr``, so AdamW learning rates carry over). A zero matrix stays zero.
Stateless.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, linalg, matrices, validation


class ScaleByRowMomentsState(NamedTuple):
  """``nu``: the EMA of the mean square per unit, ``batch + (units,)`` float32."""

  nu: optax.Updates


def row_moments_step(o: jax.Array, nu: jax.Array, b2, eps, axis: int
                     ) -> tuple[jax.Array, jax.Array]:
  """One ``m x n`` matrix: ``(O / (sqrt(nu_t) + eps), nu_t)`` with ``nu_t`` the EMA of
  the mean of ``O * O`` over ``axis`` (0: per column, 1: per row). Non-finite entries
  leave ``nu`` unchanged and stay visible in the output."""
  o = o.astype(jnp.float32)
  nu_t = linalg.ema(b2, nu, jnp.mean(jnp.square(o), axis=axis))
  nu_t = jnp.where(jnp.isfinite(jnp.max(nu_t)), nu_t, nu)
  scale = 1.0 / (jnp.sqrt(nu_t) + eps)
  out = o * (scale[None, :] if axis == 0 else scale[:, None])
  return out, nu_t


def scale_by_row_moments(*, b2: float = 0.95, eps: float = 1e-8, unit: str = "fan_out",
                         dims: matrices.DimsSpec = None) -> optax.GradientTransformation:
  """Per-unit second-moment normalization of every matrix (NorMuon's neuron-wise
  scaling, arXiv:2510.05491 Alg. 1): ``O -> O diag(sqrt(v) + eps)^-1`` with ``v`` the EMA
  (``b2``) of the mean of ``O * O`` over the other side.

  Args:
    b2: EMA decay of ``v``, in [0, 1) (NorMuon: 0.95). With ``b2 = 0`` every unit of
      the output has the same norm.
    eps: added to ``sqrt(v)``, >= 0.
    unit: ``"fan_out"`` (default; a Flax ``(in, out)`` kernel's columns, NorMuon's
      neurons) or ``"fan_in"``: the side that gets one scale per unit.
    dims: matrix axes of each leaf (default: the last two; others are batch axes).

  Returns:
    An ``optax.GradientTransformation``; updates keep the gradient dtype, the state is
    float32.
  """
  validation.check_range("b2", b2, low=0.0, high=1.0)
  validation.check_range("eps", eps, low=0.0, high=float("inf"))
  if unit not in ("fan_out", "fan_in"):
    raise ValueError(f"`unit` must be 'fan_out' or 'fan_in', got {unit!r}")
  axis = 0 if unit == "fan_out" else 1  # reduce over the other side
  what = "scale_by_row_moments"

  def init_fn(params):
    lifted = lifting.Lifted(params, dims, what=what)
    size = lambda v: v.fan_out if unit == "fan_out" else v.fan_in  # noqa: E731
    return ScaleByRowMomentsState(
        nu=lifted.per_view(lambda v: jnp.zeros(v.batch_shape + (size(v),), jnp.float32)))

  def update_fn(updates, state, params=None):
    del params
    lifted = lifting.Lifted(updates, dims, what=what, canonical=True)
    res = lifted.per_matrix(lambda o, nu: row_moments_step(o, nu, b2, eps, axis),
                            lifted.canonical_grads, lifted.leaves_of(state.nu))
    out, nu = zip(*res) if res else ((), ())
    return lifted.to_leaves(out), ScaleByRowMomentsState(nu=lifted.unflatten(nu))

  return optax.GradientTransformation(init_fn, update_fn)


def scale_to_rms(rms: float = 0.2, *, dims: matrices.DimsSpec = None
                 ) -> optax.GradientTransformation:
  """``X -> rms * sqrt(m n) * X / ||X||_F`` per matrix: every matrix update gets RMS
  ``rms`` (NorMuon's and Moonshot's 0.2; a zero matrix stays zero). Stateless.

  Args:
    rms: the RMS of each output matrix, > 0.
    dims: matrix axes of each leaf (default: the last two; others are batch axes).
  """
  validation.check_range("rms", rms, low=0.0, high=float("inf"), low_open=True)

  def per_matrix(x, view):
    del view
    x = x.astype(jnp.float32)
    # scale-free: divided by max|X| first, so that 1e-30 or 1e30 entries neither
    # underflow nor overflow in the squares
    c = jnp.max(jnp.abs(x))
    y = x / jnp.where((c > 0) & jnp.isfinite(c), c, 1.0)
    norm = jnp.sqrt(jnp.sum(jnp.square(y)))
    size = float(x.shape[-1] * x.shape[-2]) ** 0.5
    # a zero matrix stays zero; a non-finite one stays visible (NaN or inf entries)
    return y * jnp.where(norm == 0, 0.0, rms * size / jnp.where(norm == 0, 1.0, norm))

  def update_fn(updates, state, params=None):
    del params
    return lifting.map_stateless(per_matrix, updates, dims, what="scale_to_rms"), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
