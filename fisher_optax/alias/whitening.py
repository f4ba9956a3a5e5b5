"""The normalization and whitening family (paper Sec. 3.3): SWAN, Muon, NorMuon."""

from typing import Any, Optional, Union

import optax

from fisher_optax import matrices
from fisher_optax.alias.closing import finish, named
from fisher_optax.blocks import (normalize, scale_by_momentum, scale_by_row_moments,
                                 scale_by_shape, scale_to_rms, whiten)
from fisher_optax.blocks.whiten import MUON_COEFFS


@named('swan(1e-3)', static_args=('steps',))
def swan(learning_rate: optax.ScalarOrSchedule, *, steps: int = 5,
         coeffs: tuple = MUON_COEFFS, consistent_rms: Optional[float] = 0.2,
         eps: float = 1e-8, weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
         owner_layout: Any = "auto",
         fallback: Optional[optax.GradientTransformation] = None,
         fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
         ) -> optax.GradientTransformationExtraArgs:
  r"""SWAN (Ma et al. 2024, arXiv:2412.13148; paper App. "SWAN", Sec. 3.3): stateless
  normalization then whitening.

  .. math::

    W \leftarrow W - \eta_t\, c\; \mathrm{GradWhitening}(\mathrm{GradNorm}(G)),
    \quad \mathrm{GradWhitening}(X) = (X X^\top)^{-1/2} X

  Chain: :func:`normalize` (``axis="rows", center=True``: SWAN's ``GradNorm``) ->
  :func:`whiten` (Newton--Schulz) -> :func:`scale_by_shape` (``c = sqrt(max(m, n)) *
  consistent_rms``: the update's RMS is ``consistent_rms``, so Adam-range learning rates
  apply; the scale is our choice, the paper gives none). State per matrix: none.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    steps: Newton--Schulz iterations (Muon's 5); may be traced.
    coeffs: Newton--Schulz polynomial coefficients (Muon's ``(3.4445, -4.7750, 2.0315)``).
    consistent_rms: RMS of the update (0.2, Moonshot's Muon convention); ``None`` uses
      Muon's ``sqrt(max(1, n / m))``.
    eps: floor of the normalizations.
{common}
  """
  def blocks(bd):
    return [normalize(axis="rows", center=True, eps=eps, dims=bd),
            whiten(steps=steps, coeffs=coeffs, eps=eps, dims=bd),
            scale_by_shape(consistent_rms=consistent_rms, dims=bd)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="swan")


@named('muon(1e-3)', static_args=('steps',))
def muon(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, nesterov: bool = True,
         steps: int = 5, coeffs: tuple = MUON_COEFFS, consistent_rms: Optional[float] = None,
         eps: float = 1e-8, weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
         owner_layout: Any = "auto",
         fallback: Optional[optax.GradientTransformation] = None,
         fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
         ) -> optax.GradientTransformationExtraArgs:
  r"""Muon by composition (Jordan et al. 2024; paper App. "Muon"): whitening of the
  momentum.

  .. math::

    M \leftarrow \beta M + G,\quad X = G + \beta M \text{ (Nesterov) or } M,\quad
    W \leftarrow W - \eta_t\, c\; \mathrm{NS}(X) \approx (X X^\top)^{-1/2} X

  Chain: :func:`scale_by_momentum` -> :func:`whiten` (Newton--Schulz) ->
  :func:`scale_by_shape` -> ``scale_by_learning_rate``. Its matrix updates equal
  ``optax.contrib.muon``'s with the same arguments (tested). State per ``m x n`` matrix:
  ``mn`` (the momentum).

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    beta: momentum decay (0.95).
    nesterov: Nesterov momentum (default ``True``, as ``optax.contrib.muon``).
    steps: Newton--Schulz iterations (5); may be traced.
    coeffs: Newton--Schulz coefficients (Muon's).
    consistent_rms: ``None`` (default): ``c = sqrt(max(1, n / m))``; a float: the
      update's RMS (e.g. 0.2).
    eps: floor of the Newton--Schulz normalization.
{common}
  """
  def blocks(bd):
    return [scale_by_momentum(beta, nesterov=nesterov),
            whiten(steps=steps, coeffs=coeffs, eps=eps, dims=bd),
            scale_by_shape(consistent_rms=consistent_rms, dims=bd)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="muon")


@named('normuon(1e-2)', static_args=('steps',))
def normuon(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, b2: float = 0.95,
            nesterov: bool = True, steps: int = 5, coeffs: tuple = MUON_COEFFS,
            rms: float = 0.2, eps: float = 1e-8,
            weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
            dims: matrices.DimsSpec = None,
            stack_matrices: Union[bool, str] = "auto",
            owner_layout: Any = "auto",
            fallback: Optional[optax.GradientTransformation] = None,
            fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
            ) -> optax.GradientTransformationExtraArgs:
  r"""NorMuon (Li, Liu, Liang, Chen, Zhao 2025, arXiv:2510.05491, Alg. 1): Muon's
  whitened momentum, normalized per neuron by an EMA of its second moment.

  .. math::

    M \leftarrow eta M + (1-eta) G,\quad O = \mathrm{NS}(M),\quad
    v_j \leftarrow b_2 v_j + (1-b_2)\,	frac{1}{m}	extstyle\sum_i O_{ij}^2,\quad
    \hat O = O\,\mathrm{diag}(\sqrt{v} + \epsilon)^{-1},\quad
    W \leftarrow W - \eta_t ig(0.2\,\sqrt{mn}\,\hat O / \|\hat O\|_F + \lambda Wig)

  for an ``m x n`` matrix with ``m`` the fan-in and ``n`` the fan-out (a Flax kernel
  ``(in, out)``; NorMuon's neurons are the output units, the columns here). In the
  paper's framework (arXiv:2502.07752, Sec. 3.3) it composes the whitening structure
  with a diagonal normalization structure ``diag(v) (x) I`` estimated over time.
  Chain: :func:`scale_by_momentum` (Nesterov, as NorMuon's release) -> :func:`whiten`
  (Newton--Schulz) -> :func:`scale_by_row_moments` (``unit="fan_out"``) ->
  :func:`scale_to_rms` (``rms``) -> ``scale_by_learning_rate``. State per ``m x n``
  matrix: ``mn + n`` (momentum and ``v``) and a step counter. Send embeddings and the
  output layer to the fallback with ``mask=``, as for :func:`muon`.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule (AdamW's range: the update's
      RMS is ``rms * eta_t``).
    beta: momentum decay (NorMuon: 0.95).
    b2: decay of the per-neuron second moment ``v`` (NorMuon: 0.95).
    nesterov: Nesterov momentum (default ``True``, as NorMuon's release).
    steps: Newton--Schulz iterations (5); may be traced.
    coeffs: Newton--Schulz coefficients (Muon's).
    rms: RMS of every matrix update before the learning rate (NorMuon's 0.2).
    eps: floor of the Newton--Schulz normalization and added to ``sqrt(v)``.
{common}
  """
  def blocks(bd):
    return [scale_by_momentum(beta, nesterov=nesterov),
            whiten(steps=steps, coeffs=coeffs, eps=eps, dims=bd),
            scale_by_row_moments(b2=b2, eps=eps, unit="fan_out", dims=bd),
            scale_to_rms(rms, dims=bd)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="normuon")
