"""Named optimizers: short chains of blocks (like ``optax/_src/alias.py``). No math here.

Each returns an ``optax.GradientTransformationExtraArgs`` that applies the
structured rule to the leaves selected by ``mask`` (default: matrices, see
:func:`fisher_optax.routing.default_mask`) and ``fallback`` (default
``optax.adam(learning_rate)`` run in float32, :func:`fisher_optax.routing.in_float32`)
to the others. Defaults are the paper's 130M
settings (App. "Experiment details").
"""

from __future__ import annotations

from typing import Any, Optional

import math

import optax

from fisher_optax import routing
from fisher_optax.blocks import (compensate, low_rank_track, norm_growth_limiter,
                                 project_back, random_project, rotate,
                                 scale_by_bias_correction, scale_by_subspace_ratio,
                                 scale_by_moments, scale_by_two_sided, svd_refresh, switch)
from fisher_optax.blocks import normalize, scale_by_momentum, scale_by_shape, whiten
from fisher_optax.blocks.whiten import MUON_COEFFS


def inject_hyperparams(factory, *, static_args=(), hyperparam_dtype=None):
  """``optax.inject_hyperparams`` for a named optimizer, with its shape-fixing
  arguments (``factory.static_args``: rank, leading, iters) marked static."""
  static = tuple(set(static_args) | set(getattr(factory, "static_args", ())))
  return optax.inject_hyperparams(factory, static_args=static,
                                  hyperparam_dtype=hyperparam_dtype)


def _finish(structured: list, learning_rate, mask, dims, fallback, weight_decay=0.0, *,
            name: str = "structured", rank: Optional[int] = None):
  """Closes a chain: decoupled weight decay on the structured leaves, then the step size.

  ``W <- W - lr * (direction + weight_decay * W)`` as in ``optax.adamw`` (Loshchilov &
  Hutter's decoupled decay, multiplied by the learning rate and its schedule). The decay
  applies to the leaves that get the structured rule (``mask``: matrices by default);
  the fallback (default ``optax.adam``) has none unless ``fallback`` brings its own,
  e.g. ``fallback=optax.adamw(lr, weight_decay=...)``.
  """
  if not callable(weight_decay):
    routing.check_range("weight_decay", weight_decay, low=0.0, high=float("inf"))
  decay = ([] if isinstance(weight_decay, (int, float)) and weight_decay == 0
           else [optax.add_decayed_weights(weight_decay)])
  structured = optax.chain(*structured, *decay, optax.scale_by_learning_rate(learning_rate))
  fallback = fallback if fallback is not None else routing.in_float32(optax.adam(learning_rate))
  return routing.route(structured, mask=mask, dims=dims, fallback=fallback,
                       info=dict(name=name, rank=rank))


def racs(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.9, alpha: float = 0.05,
         iters: int = 5, limiter: Optional[float] = 1.01, eps: float = 1e-8,
         weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
         dims: routing.DimsSpec = None,
         fallback: Optional[optax.GradientTransformation] = None
         ) -> optax.GradientTransformationExtraArgs:
  """RACS (paper Sec. 4, Alg. "RACS"): ``W <- W - lr * alpha * eta * Q^-1/2 G S^-1/2``.

  Chain: :func:`scale_by_two_sided` -> :func:`norm_growth_limiter` ->
  ``scale(alpha)`` -> ``scale_by_learning_rate``. ``limiter=None`` drops the limiter.
  State per matrix: ``m + n + 1`` numbers.
  """
  routing.check_range("limiter", limiter, low=0.0, high=float("inf"), low_open=True,
                      allow_none=True)
  blocks = [scale_by_two_sided(beta=beta, iters=iters, eps=eps, dims=dims)]
  if limiter is not None:
    blocks.append(norm_growth_limiter(limiter, dims=dims))
  blocks.append(optax.scale(alpha))
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="racs")


def _alice_chain(*, rank, leading, interval, alpha, alpha_c, b1, b2, b3, limiter, eps, seed,
                 dims, state_dtype):
  routing.check_int("rank", rank, low=1)
  routing.check_int("leading", leading, low=0, high=rank)
  routing.check_range("b3", b3, low=0.0, high=1.0)
  routing.check_range("alpha_c", alpha_c, low=0.0, high=float("inf"))
  routing.check_range("limiter", limiter, low=0.0, high=float("inf"), low_open=True,
                      allow_none=True)
  track = low_rank_track(rank=rank, interval=interval, tracking=b3,
                         refresh=switch(leading=leading, seed=seed), dims=dims,
                         state_dtype=state_dtype)
  return [
      track,
      track.on_coefficients(scale_by_moments(b1, b2, eps, mu_dtype=state_dtype)),
      compensate(method="optimal", weight=alpha_c, b1=b1, limiter=limiter, dims=dims),
      optax.scale(alpha),
  ]


def alice(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, leading: int = 40,
          interval: int = 200, alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9,
          b2: float = 0.9, b3: float = 0.999, limiter: Optional[float] = 1.01,
          eps: float = 1e-8, seed: int = 0,
          weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
          dims: routing.DimsSpec = None,
          fallback: Optional[optax.GradientTransformation] = None,
          state_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Alice (paper Sec. 5.4, Alg. "Alice"): ``W <- W - lr * alpha * (U omega + alpha_c C)``.

  Chain: :func:`low_rank_track` (tracking ``b3``, refresh :func:`switch` with
  ``leading``) -> :func:`on_coefficients` (:func:`scale_by_moments` ``b1, b2``,
  no bias correction) -> :func:`compensate` (optimal, ``alpha_c``, decay ``b1``,
  limiter) -> ``scale(alpha)`` -> ``scale_by_learning_rate``.
  State per ``m x n`` matrix (``m <= n``): ``mr + r^2 + 2nr + n + 1``.
  """
  return _finish(_alice_chain(rank=rank, leading=leading, interval=interval, alpha=alpha,
                              alpha_c=alpha_c, b1=b1, b2=b2, b3=b3, limiter=limiter, eps=eps,
                              seed=seed, dims=dims, state_dtype=state_dtype),
                 learning_rate, mask, dims, fallback,
                 weight_decay, name="alice", rank=rank)


def alice0(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, leading: int = 40,
           interval: int = 200, alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9,
           b2: float = 0.9, limiter: Optional[float] = 1.01, eps: float = 1e-8, seed: int = 0,
           weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
           dims: routing.DimsSpec = None,
           fallback: Optional[optax.GradientTransformation] = None,
           state_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Alice-0: :func:`alice` with ``b3 = 0`` (no ``r x r`` tracking state).

  State per matrix: ``mr + 2nr + n + 1``.
  """
  return _finish(_alice_chain(rank=rank, leading=leading, interval=interval, alpha=alpha,
                              alpha_c=alpha_c, b1=b1, b2=b2, b3=0.0, limiter=limiter, eps=eps,
                              seed=seed, dims=dims, state_dtype=state_dtype),
                 learning_rate, mask, dims, fallback,
                 weight_decay, name="alice0", rank=rank)


def _galore_head(rank, interval, b1, b2, eps, dims, state_dtype):
  track = low_rank_track(rank=rank, interval=interval, refresh=svd_refresh(), dims=dims,
                         state_dtype=state_dtype)
  return [track, track.on_coefficients(scale_by_moments(b1, b2, eps, mu_dtype=state_dtype))]


def galore(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
           scale: float = 0.3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
           weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
           dims: routing.DimsSpec = None,
           fallback: Optional[optax.GradientTransformation] = None,
           state_dtype=None) -> optax.GradientTransformationExtraArgs:
  """GaLore (paper App. Alg. "GaLore"), as its release behaves.

  ``U`` = top-``r`` left singular vectors of ``G`` every ``interval`` steps; Adam on
  ``sigma = U^T G``; ``W <- W - lr * c_t * scale * U (M / (sqrt(V) + eps))`` with the
  release's step-size bias correction ``c_t = sqrt(1 - b2^t) / (1 - b1^t)``.
  The smaller side is projected (the release's "std" mode). ``eps`` defaults to
  the release's 1e-6. State per matrix: ``mr + 2nr``.
  """
  blocks = _galore_head(rank, interval, b1, b2, eps, dims, state_dtype) + [
      project_back(), optax.scale(scale), scale_by_bias_correction(b1, b2)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="galore",
                 rank=rank)


def fira(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
         scale: float = 0.3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         limiter: Optional[float] = 1.01,
         weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
         dims: routing.DimsSpec = None,
         fallback: Optional[optax.GradientTransformation] = None,
         state_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Fira: GaLore plus Fira's norm-based scaled residual and 1.01 limiter (its release).

  ``W <- W - lr * c_t * (scale * U omega + eta * (G - scale * U sigma) diag(phi))`` with
  ``phi_j = ||omega_j|| / ||sigma_j||`` (see :func:`compensate`, ``method="fira"``).
  State per matrix: ``mr + 2nr + 1``.
  """
  blocks = _galore_head(rank, interval, b1, b2, eps, dims, state_dtype) + [
      compensate(method="fira", weight=1.0, scale=scale, limiter=limiter, dims=dims),
      scale_by_bias_correction(b1, b2)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="fira",
                 rank=rank)


racs.static_args = ("iters",)
alice.static_args = ("rank", "leading")
alice0.static_args = ("rank", "leading")
galore.static_args = ("rank",)
fira.static_args = ("rank",)


# ------------------------------------------------------------------ rotation family


def eigen_adam(learning_rate: optax.ScalarOrSchedule, *, interval: int = 10, b1: float = 0.9,
               b2: float = 0.9, b3: float = 0.999, eps: float = 1e-8,
               max_precond_dim: Optional[int] = None,
               weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
               dims: routing.DimsSpec = None,
               fallback: Optional[optax.GradientTransformation] = None
               ) -> optax.GradientTransformationExtraArgs:
  """Eigen-Adam (Alice-C / AdaDiag / one-sided SOAP; paper Sec. 3.4, App. Alg.).

  ``Q <- b3 Q + (1 - b3) G G^T``; ``U = eig(Q)`` (full, smaller side) when
  ``(t - 1) mod interval == 0``; Adam moments of ``U^T G`` without bias correction,
  the first moment re-expressed on a basis change (= kept in the original space);
  ``W <- W - lr * U (M / (sqrt(V) + eps))``. Betas default to Alice's (its low-rank
  extension). State per matrix: ``m^2`` (Q) + ``m^2`` (U) + ``2mn``.
  """
  blocks = [rotate(scale_by_moments(b1, b2, eps), sides="smaller", interval=interval, b3=b3,
                   statistics="before", refresh="eigh", reexpress=("mu",),
                   max_precond_dim=_precond_limit(max_precond_dim), dims=dims)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="eigen_adam")


def soap(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.95, b2: float = 0.95,
         shampoo_beta: Optional[float] = None, eps: float = 1e-8,
         precondition_frequency: int = 10, max_precond_dim: Optional[int] = None,
         weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
         dims: routing.DimsSpec = None,
         fallback: Optional[optax.GradientTransformation] = None
         ) -> optax.GradientTransformationExtraArgs:
  """SOAP (paper Sec. 3.5, App. Alg. SOAP), as the SOAP authors' reference optimizer.

  Step 1 initialises ``L, R`` (EMA ``shampoo_beta``, default ``b2``) and their
  eigenbases and makes no update; then Adam (bias-corrected, torch-AdamW form) on
  ``U_L^T G U_R``, statistics updated after the step, refresh every
  ``precondition_frequency`` updates by sorting + one power iteration + QR, with
  the second moment permuted and the first moment re-expressed. Sides larger than
  ``max_precond_dim`` (``None``: the standard 10000) are not rotated.
  """
  routing.check_int("precondition_frequency", precondition_frequency, low=1)
  routing.check_int("max_precond_dim", max_precond_dim, low=1, allow_none=True)
  inner = optax.chain(scale_by_moments(b1, b2, eps), scale_by_bias_correction(b1, b2))
  blocks = [rotate(inner, sides="both", interval=precondition_frequency,
                   b3=b2 if shampoo_beta is None else shampoo_beta, statistics="after",
                   refresh="power_qr", reexpress=("mu",), permute=("nu",),
                   max_precond_dim=_precond_limit(max_precond_dim), dims=dims)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="soap")


def shampoo(learning_rate: optax.ScalarOrSchedule, *, eps: float = 1e-6, interval: int = 10,
            max_precond_dim: Optional[int] = None,
            weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
            dims: routing.DimsSpec = None,
            fallback: Optional[optax.GradientTransformation] = None
            ) -> optax.GradientTransformationExtraArgs:
  """Shampoo (paper App. Alg. Shampoo): ``L = eps I + sum G G^T``, ``R = eps I + sum G^T G``,
  ``W <- W - lr * L^-1/4 G R^-1/4`` with the inverse roots (eigendecompositions)
  recomputed when ``(t - 1) mod interval == 0``.
  """
  routing.check_range("eps", eps, low=0.0, high=float("inf"))
  blocks = [rotate(optax.identity(), sides="both", interval=interval, b3=None,
                   statistics="before", refresh="eigh", eigenvalue_power=-0.25,
                   stats_eps=eps, max_precond_dim=_precond_limit(max_precond_dim), dims=dims)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="shampoo")


def _precond_limit(max_precond_dim):
  """``None`` (the default) is the standard limit, 10000 (SOAP's reference value)."""
  return MAX_PRECOND_DIM if max_precond_dim is None else max_precond_dim


MAX_PRECOND_DIM = 10000

eigen_adam.static_args = ("max_precond_dim",)
soap.static_args = ("max_precond_dim", "precondition_frequency")
shampoo.static_args = ("max_precond_dim",)


# ------------------------------------------------------------------------- Apollo


def _apollo(learning_rate, *, rank, interval, scale, kind, b1, b2, eps, limiter, seed, mask,
            dims, fallback, weight_decay):
  routing.check_range("scale", scale, low=0.0, high=float("inf"))
  routing.check_range("limiter", limiter, low=0.0, high=float("inf"), low_open=True,
                      allow_none=True)
  project = random_project(rank=rank, interval=interval, seed=seed, dims=dims)
  blocks = [project, project.on_coefficients(scale_by_moments(b1, b2, eps)),
            scale_by_subspace_ratio(kind)]
  if limiter is not None:
    blocks.append(norm_growth_limiter(limiter, dims=dims))
  blocks += [optax.scale(math.sqrt(scale)) if isinstance(scale, (int, float))
             else optax.scale(scale ** 0.5), scale_by_bias_correction(b1, b2)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 name="apollo" if kind == "channel" else "apollo_mini", rank=rank)


def apollo(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
           scale: float = 1.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
           limiter: Optional[float] = 1.01, seed: int = 0,
           weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
           dims: routing.DimsSpec = None,
           fallback: Optional[optax.GradientTransformation] = None
           ) -> optax.GradientTransformationExtraArgs:
  """APOLLO (paper App. Alg. "Apollo"), as its release: channel-wise scaling.

  ``sigma = U^T G`` with a seeded Gaussian ``U`` (``N(0, 1/r)``, new seed every
  ``interval`` steps, never stored); Adam moments of ``sigma``;
  ``s_j = ||adam_j|| / ||sigma_j||``; ``W <- W - lr * c_t * sqrt(scale) * limiter(G diag(s))``
  with the release's step-size bias correction ``c_t`` and ``sqrt(scale)``.
  State per matrix: ``2nr + 1`` (+ a seed).
  """
  return _apollo(learning_rate, rank=rank, interval=interval, scale=scale, kind="channel",
                 b1=b1, b2=b2, eps=eps, limiter=limiter, seed=seed, mask=mask, dims=dims,
                 fallback=fallback, weight_decay=weight_decay)


def apollo_mini(learning_rate: optax.ScalarOrSchedule, *, interval: int = 200,
                scale: float = 128.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                limiter: Optional[float] = 1.01, seed: int = 0,
                weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
                dims: routing.DimsSpec = None,
                fallback: Optional[optax.GradientTransformation] = None
                ) -> optax.GradientTransformationExtraArgs:
  """APOLLO-mini: rank 1, tensor-wise scaling (``scale`` 128 as in the release's scripts).

  State per matrix: ``2n + 2`` numbers (moments, limiter norm, seed; paper App.).
  """
  return _apollo(learning_rate, rank=1, interval=interval, scale=scale, kind="tensor", b1=b1,
                 b2=b2, eps=eps, limiter=limiter, seed=seed, mask=mask, dims=dims,
                 fallback=fallback, weight_decay=weight_decay)


apollo.static_args = ("rank",)


# ----------------------------------------------------------- normalization / whitening


def swan(learning_rate: optax.ScalarOrSchedule, *, steps: int = 5,
         coeffs: tuple = MUON_COEFFS, consistent_rms: Optional[float] = 0.2,
         eps: float = 1e-8, weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
         dims: routing.DimsSpec = None,
         fallback: Optional[optax.GradientTransformation] = None
         ) -> optax.GradientTransformationExtraArgs:
  """SWAN (paper App. "SWAN", Eq. "SWAN update"; Ma et al. 2024, arXiv 2412.13148):
  ``W <- W - lr * c * GradWhitening(GradNorm(G))``, no optimizer state for matrices.

  Chain: :func:`normalize` (``axis="rows", center=True``: SWAN's ``GradNorm``) ->
  :func:`whiten` (Newton--Schulz, ``steps`` and ``coeffs``) -> ``c =
  sqrt(max(m, n)) * consistent_rms`` (:func:`scale_by_shape`: the update's
  RMS becomes ``consistent_rms``, so Adam-range learning rates apply; ``None`` uses
  Muon's ``sqrt(max(1, n / m))``) -> ``scale_by_learning_rate``. The scale is our
  choice (the paper gives none). State per matrix: none.
  """
  blocks = [normalize(axis="rows", center=True, eps=eps, dims=dims),
            whiten(steps=steps, coeffs=coeffs, eps=eps, dims=dims),
            scale_by_shape(consistent_rms=consistent_rms, dims=dims)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="swan")


def muon(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, nesterov: bool = True,
         steps: int = 5, coeffs: tuple = MUON_COEFFS, consistent_rms: Optional[float] = None,
         eps: float = 1e-8, weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None,
         dims: routing.DimsSpec = None,
         fallback: Optional[optax.GradientTransformation] = None
         ) -> optax.GradientTransformationExtraArgs:
  """Muon by composition (paper App. "Muon", Eq. "Muon update"; Jordan et al. 2024):
  ``W <- W - lr * c * GradWhitening(m_t)`` with Muon's momentum ``m_t``.

  Chain: :func:`scale_by_momentum` (``beta``, Nesterov) -> :func:`whiten`
  (Newton--Schulz) -> :func:`scale_by_shape` (``consistent_rms``) ->
  ``scale_by_learning_rate``. Its matrix updates equal ``optax.contrib.muon``'s with the
  same arguments (tested). State per matrix: ``mn`` (the momentum).
  """
  blocks = [scale_by_momentum(beta, nesterov=nesterov),
            whiten(steps=steps, coeffs=coeffs, eps=eps, dims=dims),
            scale_by_shape(consistent_rms=consistent_rms, dims=dims)]
  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay, name="muon")


swan.static_args = ("steps",)
muon.static_args = ("steps",)
