"""The low-rank family (paper Sec. 5): tracking a subspace, an optimizer on its
coefficients, compensation of the complement. Alice, Alice-0, Alice-SOAP, and Dion
(one power step per step, orthonormalized coefficients, error feedback)."""

from typing import Any, Optional, Union

import jax.numpy as jnp
import optax

from fisher_optax import matrices, validation
from fisher_optax.alias.closing import finish, named
from fisher_optax.parallel import owners
from fisher_optax.blocks import (compensate, low_rank_track, power_track, scale_by_moments,
                                 scale_by_shape)
from fisher_optax.refresh import switch


PAPER_RANK, PAPER_LEADING = 256, 40


def default_leading(rank: int) -> int:
  """Alice's ``leading`` when not given: the paper's 40 leading eigenvectors at rank 256
  (App. "Experiment details"), scaled with the rank and kept in ``[1, rank]``:
  ``min(rank, max(1, round(40 * rank / 256)))`` -- 40 at 256, 20 at 128, 1 at 8 or less.
  A switch then keeps about 16% of the basis and explores the rest, as in the paper."""
  validation.check_int("rank", rank, low=1)
  return min(int(rank), max(1, round(PAPER_LEADING * int(rank) / PAPER_RANK)))


def _alice_chain(*, rank, leading, interval, alpha_c, b1, b2, b3, limiter, eps, seed,
                 dims, state_dtype, side="smaller", core=None):
  """Tracking (+ switching) -> ``core`` on the coefficients (default Adam's moments) ->
  optimal compensation, on the ``side`` of each matrix (paper Alg. "Alice")."""
  track = low_rank_track(rank=rank, interval=interval, b3=b3,
                         refresh=switch(leading=leading, seed=seed), dims=dims,
                         state_dtype=state_dtype, side=side)
  if core is None:
    core = scale_by_moments(b1, b2, eps, mu_dtype=state_dtype)
  return [
      track,
      track.on_coefficients(core),
      compensate(method="optimal", alpha_c=alpha_c, b1=b1, limiter=limiter, dims=dims,
                 side=side),
  ]


@named('alice(1e-2, rank=4, leading=1)', static_args=('rank', 'leading'))
def alice(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256,
          leading: Optional[int] = None,
          interval: int = 200, alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9,
          b2: float = 0.9, b3: float = 0.999, limiter: Optional[float] = 1.01,
          eps: float = 1e-8, seed: int = 0,
          weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
          dims: matrices.DimsSpec = None,
          stack_matrices: Union[bool, str] = "auto",
          owner_layout: Any = "auto",
          fallback: Optional[optax.GradientTransformation] = None,
          fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None,
          state_dtype=None) -> optax.GradientTransformationExtraArgs:
  r"""Alice, low-rank Eigen-Adam with tracking, switching and compensation (paper Sec. 5.4,
  Alg. "Alice").

  .. math::

    \sigma = U^\top G,\quad \tilde Q \leftarrow \beta_3 \tilde Q + (1-\beta_3)
    \sigma\sigma^\top,\quad \omega = \frac{M}{\sqrt{V} + \epsilon},\quad
    W \leftarrow W - \eta_t\, \alpha\, (U \omega + \alpha_c\, C)

  with ``M, V`` the EMAs (``b1, b2``, no bias correction) of ``sigma``, ``U`` (``m x r``,
  ``m <= n``) refreshed every ``interval`` steps by subspace iteration on
  ``Q = U Q~ U^T + G G^T`` with subspace switching (``leading`` leading eigenvectors
  plus ``r - leading`` drawn from the complement; Alg. "Subspace switching"), and ``C``
  the optimal compensation of the complement (Thm. "Optimal compensation") under a
  norm-growth limiter. Chain: :func:`low_rank_track` -> ``on_coefficients``
  (:func:`scale_by_moments`) -> :func:`compensate` -> ``scale(alpha)`` ->
  ``scale_by_learning_rate``. State per ``m x n`` matrix: ``mr + r^2 + 2nr + n + 1``.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule (paper 130M: 0.02).
    rank: ``r``, clipped per matrix to ``min(m, n)`` (paper: 256); static.
    leading: eigenvectors kept at a switch, ``0 <= leading <= rank``; the other
      ``rank - leading`` columns come from the complement. Default ``None``: the
      paper's 40 at rank 256 scaled with the rank (:func:`default_leading`:
      ``max(1, round(40 * rank / 256))``, at most ``rank``); may be traced.
    interval: refresh period ``K`` of the basis (paper: 200).
    alpha: update scale (paper: 0.3).
    alpha_c: compensation weight (paper: 0.4).
    b1: first-moment decay (paper: 0.9); also the compensation's EMA decay.
    b2: second-moment decay (paper: 0.9).
    b3: tracking decay of ``Q~`` (paper: 0.999).
    limiter: norm-growth limit ``gamma`` of the compensation (paper: 1.01); ``None``
      disables it.
    eps: Adam's ``epsilon``.
    seed: seed of the complement draws at a switch.
{common}
    state_dtype: dtype of ``U``, ``Q~`` and the moments in the state (default float32;
      decompositions always run in float32).
  """
  leading = default_leading(rank) if leading is None else leading

  def blocks(bd):
    return _alice_chain(rank=rank, leading=leading, interval=interval, alpha_c=alpha_c,
                        b1=b1, b2=b2, b3=b3, limiter=limiter, eps=eps, seed=seed, dims=bd,
                        state_dtype=state_dtype) + [optax.scale(alpha)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, owned=True, name="alice", rank=rank)


@named('alice0(1e-2, rank=4, leading=1)', static_args=('rank', 'leading'))
def alice0(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256,
           leading: Optional[int] = None,
           interval: int = 200, alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9,
           b2: float = 0.9, limiter: Optional[float] = 1.01, eps: float = 1e-8, seed: int = 0,
           weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
           dims: matrices.DimsSpec = None,
           stack_matrices: Union[bool, str] = "auto",
           owner_layout: Any = "auto",
           fallback: Optional[optax.GradientTransformation] = None,
           fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None,
           state_dtype=None) -> optax.GradientTransformationExtraArgs:
  r"""Alice-0: :func:`alice` without tracking (``b3 = 0``: no ``r x r`` state; paper Sec.
  5.4).

  .. math::

    W \leftarrow W - \eta_t\, \alpha\, (U \omega + \alpha_c\, C),\qquad
    U = \mathrm{switch}(\mathrm{eig}_r(G G^\top)) \text{ every } K \text{ steps}

  State per ``m x n`` matrix: ``mr + 2nr + n + 1``.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule (paper 130M: 0.02).
    rank: ``r``, clipped per matrix to ``min(m, n)`` (paper: 256); static.
    leading: eigenvectors kept at a switch, at most ``rank``; default ``None``: the
      paper's 40 at rank 256 scaled with the rank (:func:`default_leading`); may be
      traced.
    interval: refresh period ``K`` (paper: 200).
    alpha: update scale (paper: 0.3).
    alpha_c: compensation weight (paper: 0.4).
    b1: first-moment decay (paper: 0.9).
    b2: second-moment decay (paper: 0.9).
    limiter: norm-growth limit of the compensation (paper: 1.01); ``None`` disables it.
    eps: Adam's ``epsilon``.
    seed: seed of the complement draws.
{common}
    state_dtype: dtype of the state arrays (default float32).
  """
  leading = default_leading(rank) if leading is None else leading

  def blocks(bd):
    return _alice_chain(rank=rank, leading=leading, interval=interval, alpha_c=alpha_c,
                        b1=b1, b2=b2, b3=0.0, limiter=limiter, eps=eps, seed=seed, dims=bd,
                        state_dtype=state_dtype) + [optax.scale(alpha)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, owned=True, name="alice0", rank=rank)


@named('alice_soap(1e-2, rank=4, leading=1)', static_args=('rank', 'right_rank', 'leading'))
def alice_soap(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256,
               right_rank: Optional[int] = None, leading: Optional[int] = None,
               interval: int = 200,
               alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9, b2: float = 0.9,
               b3: float = 0.999, limiter: Optional[float] = 1.01, eps: float = 1e-8,
               seed: int = 0, weight_decay: Optional[optax.ScalarOrSchedule] = None,
               mask: Any = None,
               dims: matrices.DimsSpec = None,
               stack_matrices: Union[bool, str] = "auto",
               owner_layout: Any = "auto",
               fallback: Optional[optax.GradientTransformation] = None,
               fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None,
               state_dtype=None) -> optax.GradientTransformationExtraArgs:
  r"""Alice-SOAP: a two-sided low-rank SOAP from the paper's tracking / switching /
  compensation framework (Sec. 5) applied to SOAP's structure (Sec. 3.5). Not in the
  paper: derivation and decisions in ``docs/low_rank_soap.md``.

  .. math::

    \sigma = U^\top G,\quad \tau = V^\top \sigma^\top,\quad
    \omega = \frac{M}{\sqrt{N} + \epsilon},\quad
    W \leftarrow W - \eta_t\, \alpha \big(U (V \omega + \alpha_c C_R^\top)^\top
    + \alpha_c C_L\big)

  with ``U`` (``m x r``, ``m <= n``) and ``V`` (``n x k``) tracked bases of
  ``E[G G^T]`` and ``E[sigma^T sigma]`` (refreshed every ``interval`` steps by subspace
  iteration with subspace switching on both sides, tracking decay ``b3``), ``M, N`` the
  EMAs (``b1, b2``, no bias correction) of the ``k x r`` core ``tau`` (SOAP's Adam in
  the rotated coordinates), ``C_R`` the optimal compensation of the right complement
  inside ``span(U)`` (rows of ``sigma`` scaled by
  ``sqrt(n-k) / sqrt(E||sigma_i (I - V V^T)||^2)``) and ``C_L`` Alice's optimal
  compensation of the left complement; each under a norm-growth limiter. At step 1 the
  core term is 0 (its moments are updated): as in SOAP, the first step sets up the bases.
  Chain: :func:`low_rank_track` -> ``on_coefficients`` (
  :func:`low_rank_track` ``(side="larger")`` -> ``on_coefficients``
  (:func:`scale_by_moments`) -> :func:`compensate` ``(side="larger")``) ->
  :func:`compensate` -> ``scale(alpha)`` -> ``scale_by_learning_rate``. State per
  ``m x n`` matrix: ``mr + r^2 + nk + k^2 + 2rk + n + r`` (+2 limiter scalars), against
  Alice's ``mr + r^2 + 2nr + n`` and SOAP's ``2m^2 + 2n^2 + 2mn``. At ``rank = m``,
  ``right_rank = n`` and no switching it is SOAP's update in SOAP's eigenbases
  (up to SOAP's bias correction and statistics timing; tested).

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    rank: ``r``, rank of the left basis ``U`` (smaller side), clipped per matrix to
      ``min(m, n)`` (default: Alice's 256); static.
    right_rank: ``k``, rank of the right basis ``V`` (larger side), clipped to ``n``;
      default ``rank``; static.
    leading: eigenvectors kept at a switch on each side, at most
      ``min(rank, right_rank)``; default ``None``: :func:`default_leading` of
      ``min(rank, right_rank)`` (Alice's 40 at rank 256); may be traced.
    interval: refresh period ``K`` of both bases (Alice's 200).
    alpha: update scale (Alice's 0.3).
    alpha_c: weight of both compensations (Alice's 0.4).
    b1: first-moment decay (0.9); also the compensations' EMA decay.
    b2: second-moment decay (0.9).
    b3: tracking decay of both ``r x r`` and ``k x k`` statistics (0.999).
    limiter: norm-growth limit ``gamma`` of each compensation (1.01); ``None``
      disables it.
    eps: Adam's ``epsilon``.
    seed: seed of the complement draws (the right side uses ``seed + 1``).
{common}
    state_dtype: dtype of the bases, tracked statistics and moments in the state
      (default float32; decompositions always run in float32).
  """
  right_rank = rank if right_rank is None else right_rank
  validation.check_int("right_rank", right_rank, low=1)  # the right chain calls it `rank`
  if leading is None:
    leading = default_leading(min(rank, right_rank))
  common = dict(leading=leading, interval=interval, alpha_c=alpha_c, b1=b1, b2=b2, b3=b3,
                limiter=limiter, eps=eps, state_dtype=state_dtype)
  # step 1: both bases come from G_1, so the core U^T G_1 V is diagonal up to float32
  # rounding, which Adam would blow up to unit size (a different sign on every device
  # layout); as SOAP, whose first step only sets up its bases, the core makes no update
  not_first = optax.scale_by_schedule(lambda count: jnp.where(count == 0, 0.0, 1.0))
  moments = optax.chain(scale_by_moments(b1, b2, eps, mu_dtype=state_dtype), not_first)
  # Alice on the larger side of the r x n coefficients (dims: they are canonical arrays)
  right = _alice_chain(rank=right_rank, seed=seed + 1, dims=None, side="larger",
                       core=moments, **common)

  def blocks(bd):
    return _alice_chain(rank=rank, seed=seed, dims=bd, core=optax.chain(*right),
                        **common) + [optax.scale(alpha)]

  if isinstance(owner_layout, str) and owner_layout == owners.AUTO:
    # its bases stay where the parameters' split puts them: off where that is guessed
    owner_layout = owners.OwnerLayout(guessed=False)

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, owned=True, name="alice_soap",
                 rank=rank)


@named('dion(1e-2, rank=0.5)', static_args=('rank',))
def dion(learning_rate: optax.ScalarOrSchedule, *, rank: Union[int, float] = 0.25,
         mu: float = 0.95, eps: float = 1e-8, seed: int = 0,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
         owner_layout: Any = False,
         fallback: Optional[optax.GradientTransformation] = None,
         fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None,
         state_dtype=None) -> optax.GradientTransformationExtraArgs:
  r"""Dion (Ahn, Xu, Abreu, Langford 2025, arXiv:2504.05295, Alg. 1): low-rank
  orthonormalized updates by one warm-started power step per step, with error feedback;
  as the authors' reference (``microsoft/dion``, ``dion_reference.py``).

  .. math::

    B = M + G,\quad P = \mathrm{orth}(B^\top Q),\quad R = B P,\quad
    M \leftarrow B - (1 - \mu) R P^\top,\quad
    Q \leftarrow R\, \mathrm{diag}(\|R_{:j}\| + \epsilon)^{-1},\quad
    W \leftarrow W - \eta_t \sqrt{d_\mathrm{out} / d_\mathrm{in}}\; Q P^\top

  for each matrix as ``m x n`` with ``m <= n`` (``Q``: ``m x r``, on the smaller side),
  ``orth`` the thin QR factor and ``d_in, d_out`` the fan-in and fan-out. In the paper's
  framework (arXiv:2502.07752, Sec. 5) these are the low-rank family's three steps:
  tracking (``Q`` refreshed at every step by one step of subspace iteration on
  ``B B^T``), the coefficients ``B^T Q`` orthonormalized where Alice and GaLore run
  Adam on them, and compensation by error feedback (what ``P`` does not take stays in
  the momentum) where Alice adds its optimal compensation. Chain:
  :func:`power_track` -> :func:`scale_by_shape` (``floor=False``) ->
  ``scale_by_learning_rate``. Its matrix updates equal the reference's with the same
  initial ``Q`` (tested against a float64 transcription over 12 steps). State per
  ``m x n`` matrix: ``mn + mr`` (momentum and ``Q``).

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule (reference default: 0.01).
    rank: ``r``: a float fraction of ``min(m, n)`` in ``(0, 1]``, rounded up (the
      reference's ``rank_fraction``; default 1/4, which its authors report nearly as
      good as full rank at 3B parameters; the reference's default is 1.0), or an int,
      clipped per matrix to ``min(m, n)`` (at or above it the update is full rank); static.
    mu: error-feedback momentum (reference: 0.95).
    eps: added to the column norms of ``R`` (reference: 1e-8).
    seed: seed of the initial ``Q`` (``N(0, 1)``, as the reference's ``torch.randn``).
{common}
    state_dtype: dtype of the momentum and ``Q`` in the state (default float32; the
      arithmetic is float32 regardless).

  The reference's default weight decay is 0.01 (on every parameter); here, as for the
  other optimizers, ``weight_decay`` is ``None`` unless given, and the fallback has none
  unless ``fallback`` brings its own.
  """
  def blocks(bd):
    return [power_track(rank=rank, mu=mu, eps=eps, seed=seed, dims=bd,
                        state_dtype=state_dtype),
            scale_by_shape(floor=False, dims=bd)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                fallback_lr=fallback_learning_rate,
                stack=stack_matrices, owner=owner_layout, name="dion", rank=rank)

