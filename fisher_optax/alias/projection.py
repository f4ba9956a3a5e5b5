"""The projection family: Adam on projected coefficients, mapped back or used to scale
the gradient. GaLore and Fira (tracked projections), APOLLO and APOLLO-mini (random
projections)."""

import math
from typing import Any, Optional, Union

import optax

from fisher_optax import matrices, validation
from fisher_optax.alias.closing import finish, named
from fisher_optax.blocks import (compensate, low_rank_track, norm_growth_limiter,
                                 project_back, random_project, scale_by_bias_correction,
                                 scale_by_moments, scale_by_subspace_ratio)
from fisher_optax.refresh import SubspaceRefresh, SvdRefresh, subspace_refresh


def _galore_head(rank, interval, b1, b2, eps, dims, state_dtype, refresh):
  refresh = subspace_refresh() if refresh is None else refresh
  if not isinstance(refresh, (SubspaceRefresh, SvdRefresh)):
    raise TypeError("`refresh` must be fo.subspace_refresh(...) or fo.svd_refresh(), got "
                    f"{refresh!r}")
  track = low_rank_track(rank=rank, interval=interval, refresh=refresh, dims=dims,
                         state_dtype=state_dtype)
  return [track, track.on_coefficients(scale_by_moments(b1, b2, eps, mu_dtype=state_dtype))]


@named('galore(1e-2, rank=4)', static_args=('rank',))
def galore(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
           scale: float = 0.3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
           weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
           dims: matrices.DimsSpec = None,
           stack_matrices: Union[bool, str] = "auto",
           owner_layout: Any = "auto",
           fallback: Optional[optax.GradientTransformation] = None,
           fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None,
           state_dtype=None, refresh: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""GaLore (Zhao et al. 2024, arXiv:2403.03507; paper App. "Low rank optimizers"), as its
  release behaves.

  .. math::

    U \approx \mathrm{svd}_r(G) \text{ every } K \text{ steps},\quad \sigma = U^\top G,\quad
    W \leftarrow W - \eta_t\, c_t\, \mathrm{scale}\; U \frac{M}{\sqrt{V} + \epsilon},
    \quad c_t = \frac{\sqrt{1 - b_2^t}}{1 - b_1^t}

  The smaller side is projected (the release's "std" mode; ``optax.contrib.galore``
  projects the larger). State per ``m x n`` matrix: ``mr + 2nr``.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    rank: ``r`` (paper: 256); static.
    interval: refresh period ``K`` (paper: 200).
    scale: GaLore's ``alpha`` (default 0.3, the paper's runs).
    b1: first-moment decay.
    b2: second-moment decay.
    eps: Adam's ``epsilon`` (release: 1e-6).
{common}
    state_dtype: dtype of the state arrays (default float32).
    refresh: how ``U`` is refreshed: :func:`~fisher_optax.subspace_refresh` (default:
      warm-started subspace iteration, matrix products and ``r x r`` factorizations,
      batched per shape on accelerators) or :func:`~fisher_optax.svd_refresh` (the
      release's exact SVD, one matrix at a time on GPUs).
  """
  def blocks(bd):
    return _galore_head(rank, interval, b1, b2, eps, bd, state_dtype, refresh) + [
        project_back(), optax.scale(scale), scale_by_bias_correction(b1, b2)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, owned=True, name="galore",
                 rank=rank)


@named('fira(1e-2, rank=4)', static_args=('rank',))
def fira(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
         scale: float = 0.3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         limiter: Optional[float] = 1.01,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
         owner_layout: Any = "auto",
         fallback: Optional[optax.GradientTransformation] = None,
         fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None,
         state_dtype=None, refresh: Any = None) -> optax.GradientTransformationExtraArgs:
  r"""Fira (Chen et al. 2024, arXiv:2410.01623): GaLore plus the norm-based scaled residual
  and a norm-growth limiter, as its release.

  .. math::

    W \leftarrow W - \eta_t\, c_t \left(\mathrm{scale}\; U\omega + \phi_t\,
    (G - \mathrm{scale}\; U\sigma)\, \mathrm{diag}(\psi)\right),\quad
    \psi_j = \frac{\|\omega_j\|}{\|\sigma_j\|}

  (:func:`compensate` with ``method="fira"``). State per ``m x n`` matrix: ``mr + 2nr + 1``.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    rank: ``r`` (paper: 256); static.
    interval: refresh period (paper: 200).
    scale: GaLore's ``alpha`` (default 0.3, the paper's runs).
    b1: first-moment decay.
    b2: second-moment decay.
    eps: Adam's ``epsilon`` (release: 1e-6).
    limiter: norm-growth limit ``gamma`` of the residual (release: 1.01); ``None``
      disables it.
{common}
    state_dtype: dtype of the state arrays (default float32).
    refresh: how ``U`` is refreshed: :func:`~fisher_optax.subspace_refresh` (default:
      warm-started subspace iteration, matrix products and ``r x r`` factorizations,
      batched per shape on accelerators) or :func:`~fisher_optax.svd_refresh` (the
      release's exact SVD, one matrix at a time on GPUs).
  """
  def blocks(bd):
    return _galore_head(rank, interval, b1, b2, eps, bd, state_dtype, refresh) + [
        compensate(method="fira", alpha_c=1.0, scale=scale, limiter=limiter, dims=bd),
        scale_by_bias_correction(b1, b2)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, owned=True, name="fira",
                 rank=rank)


def _apollo(learning_rate, *, rank, interval, scale, kind, b1, b2, eps, limiter, seed, mask,
            dims, stack_matrices, owner_layout, fallback, weight_decay,
            fallback_learning_rate):
  validation.check_range("scale", scale, low=0.0, high=float("inf"))  # used here: sqrt
  def blocks(bd):
    project = random_project(rank=rank, interval=interval, seed=seed, dims=bd)
    limit = [] if limiter is None else [norm_growth_limiter(limiter, dims=bd)]
    return [project, project.on_coefficients(scale_by_moments(b1, b2, eps)),
            scale_by_subspace_ratio(kind), *limit,
            optax.scale(math.sqrt(scale)) if isinstance(scale, (int, float))
            else optax.scale(scale ** 0.5), scale_by_bias_correction(b1, b2)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 name="apollo" if kind == "channel" else "apollo_mini", rank=rank,
                 stack=stack_matrices, owner=owner_layout)


@named('apollo(1e-2, rank=4)', static_args=('rank',))
def apollo(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
           scale: float = 1.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
           limiter: Optional[float] = 1.01, seed: int = 0,
           weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
           dims: matrices.DimsSpec = None,
           stack_matrices: Union[bool, str] = "auto",
           owner_layout: Any = "auto",
           fallback: Optional[optax.GradientTransformation] = None,
           fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
           ) -> optax.GradientTransformationExtraArgs:
  r"""APOLLO (Zhu et al. 2024, arXiv:2412.05270; paper App. "Apollo"), as its release:
  channel-wise scaling.

  .. math::

    \sigma = U^\top G,\ U \sim \mathcal N(0, 1/r) \text{ (seeded, renewed every } K),
    \quad s_j = \frac{\|\mathrm{Adam}(\sigma)_j\|}{\|\sigma_j\|},\quad
    W \leftarrow W - \eta_t\, c_t \sqrt{\mathrm{scale}}\; \phi_t\, G\,
    \mathrm{diag}(s)

  ``U`` is regenerated from its seed and never stored. State per ``m x n`` matrix:
  ``2nr + 1`` (+ a seed).

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    rank: ``r`` (release: 256); static.
    interval: projection renewal period ``K`` (release: 200).
    scale: APOLLO's scale (release: 1 for channel-wise); the update is multiplied by
      ``sqrt(scale)`` as in the release.
{apollo}
{common}
  """
  return _apollo(learning_rate, rank=rank, interval=interval, scale=scale, kind="channel",
                 b1=b1, b2=b2, eps=eps, limiter=limiter, seed=seed, mask=mask, dims=dims,
                 stack_matrices=stack_matrices, owner_layout=owner_layout,
                 fallback=fallback, weight_decay=weight_decay,
                 fallback_learning_rate=fallback_learning_rate)


@named('apollo_mini(1e-2)')
def apollo_mini(learning_rate: optax.ScalarOrSchedule, *, interval: int = 200,
                scale: float = 128.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                limiter: Optional[float] = 1.01, seed: int = 0,
                weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
                dims: matrices.DimsSpec = None,
                stack_matrices: Union[bool, str] = "auto",
                owner_layout: Any = "auto",
                fallback: Optional[optax.GradientTransformation] = None,
                fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
                ) -> optax.GradientTransformationExtraArgs:
  r"""APOLLO-mini (Zhu et al. 2024, arXiv:2412.05270): :func:`apollo` at rank 1 with
  tensor-wise scaling.

  .. math::

    s = \frac{\|\mathrm{Adam}(\sigma)\|}{\|\sigma\|},\quad
    W \leftarrow W - \eta_t\, c_t \sqrt{\mathrm{scale}}\; \phi_t\, s\, G

  State per ``m x n`` matrix: ``2n + 1`` numbers (paper App. "Memory consumption"
  counts ``2n + 2``, with a stored seed; here the projection's key follows from the step
  counter, :mod:`fisher_optax.rng`).

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    interval: projection renewal period (release: 200).
    scale: release scripts' 128.
{apollo}
{common}
  """
  return _apollo(learning_rate, rank=1, interval=interval, scale=scale, kind="tensor", b1=b1,
                 b2=b2, eps=eps, limiter=limiter, seed=seed, mask=mask, dims=dims,
                 stack_matrices=stack_matrices, owner_layout=owner_layout,
                 fallback=fallback, weight_decay=weight_decay,
                 fallback_learning_rate=fallback_learning_rate)
