"""The rotation family (paper Sec. 3.4-3.5): Adam or Shampoo in eigenbases of the
gradient statistics. Eigen-Adam, SOAP, Shampoo."""

from typing import Any, Optional, Union

import optax

from fisher_optax import matrices, validation
from fisher_optax.alias.closing import finish, named
from fisher_optax.blocks import rotate, scale_by_bias_correction, scale_by_moments
from fisher_optax.parallel import owners


@named('eigen_adam(1e-3, interval=2)', static_args=('max_precond_dim', 'refresh'))
def eigen_adam(learning_rate: optax.ScalarOrSchedule, *, interval: int = 10, b1: float = 0.9,
               b2: float = 0.9, b3: float = 0.999, eps: float = 1e-8,
               max_precond_dim: Optional[int] = None, refresh: str = "eigh",
               weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
               dims: matrices.DimsSpec = None,
               stack_matrices: Union[bool, str] = "auto",
               owner_layout: Any = "auto",
               fallback: Optional[optax.GradientTransformation] = None,
               fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
               ) -> optax.GradientTransformationExtraArgs:
  r"""Eigen-Adam (Alice-C / AdaDiag / one-sided SOAP; paper Sec. 3.4, Alg. "Eigen-Adam").

  .. math::

    Q \leftarrow b_3 Q + (1 - b_3) G G^\top,\quad U = \mathrm{eig}(Q)
    \text{ when } (t-1) \bmod K = 0,\quad
    W \leftarrow W - \eta_t\, U \frac{M}{\sqrt{V} + \epsilon}

  with ``M, V`` the EMAs of ``U^T G`` (no bias correction; ``M`` re-expressed on a basis
  change), on the smaller side. State per ``m x n`` matrix: ``2 m^2 + 2 m n``.

  ``refresh="power_qr"`` replaces the eigendecomposition after the first by SOAP's
  refresh (Vyas et al. 2024): the old basis sorted by ``diag(U^T Q U)``, one warm-started
  power iteration ``U <- QR(Q U)`` (positive-diagonal QR, Cholesky QR on accelerators),
  and ``V`` permuted with the sort. It tracks the eigenbasis across refreshes instead of
  recomputing it: an approximation of the paper's algorithm, made of matrix products and
  one batched factorization per shape, where a GPU runs an ``m x m`` ``eigh`` above
  32 x 32 one matrix after another (the performance page counts the calls).

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    interval: eigenbasis refresh period ``K`` (default 10).
    b1: first-moment decay (Alice's 0.9).
    b2: second-moment decay (Alice's 0.9).
    b3: decay of the statistic ``Q`` (0.999).
    eps: Adam's ``epsilon``.
    max_precond_dim: sides larger than this are not rotated (``None``: 10000); static.
    refresh: ``"eigh"`` (default: the paper's eigendecomposition at every refresh) or
      ``"power_qr"`` (after the first: one warm-started power iteration, above); static.
{common}
  """
  def blocks(bd):
    return [rotate(scale_by_moments(b1, b2, eps), sides="smaller", interval=interval, b3=b3,
                   statistics="before", refresh=refresh, reexpress=("mu",),
                   permute=("nu",) if refresh == "power_qr" else (),
                   max_precond_dim=_precond_limit(max_precond_dim), dims=bd,
                   owners=owners.state_devices(owner_layout))]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="eigen_adam")


@named('soap(1e-3, precondition_frequency=2)',
       static_args=('max_precond_dim', 'precondition_frequency'))
def soap(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.95, b2: float = 0.95,
         shampoo_beta: Optional[float] = None, eps: float = 1e-8,
         precondition_frequency: int = 10, max_precond_dim: Optional[int] = None,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
         owner_layout: Any = "auto",
         fallback: Optional[optax.GradientTransformation] = None,
         fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
         ) -> optax.GradientTransformationExtraArgs:
  r"""SOAP (Vyas et al. 2024, arXiv:2409.11321; paper Sec. 3.5, App. "SOAP/AdaDiag++"), as
  the SOAP authors' reference optimizer.

  .. math::

    L \leftarrow \beta L + (1-\beta) G G^\top,\ R \leftarrow \beta R + (1-\beta)
    G^\top G,\quad \tilde G = Q_L^\top G Q_R,\quad
    W \leftarrow W - \eta_t\, Q_L\, \mathrm{Adam}(\tilde G)\, Q_R^\top

  Step 1 initialises ``L, R`` and their eigenbases and makes no update; statistics are
  updated after the step; the bases are refreshed every ``precondition_frequency``
  updates by one power iteration + QR, with ``V`` permuted and ``M`` re-expressed.
  State per ``m x n`` matrix: ``2 m^2 + 2 n^2 + 2 m n``.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    b1: Adam's first-moment decay (reference: 0.95).
    b2: Adam's second-moment decay (reference: 0.95).
    shampoo_beta: decay of ``L, R`` (default ``b2``).
    eps: Adam's ``epsilon``.
    precondition_frequency: basis refresh period (reference: 10).
    max_precond_dim: sides larger than this are not rotated (``None``: 10000); static.
{common}
  """
  # rotate calls it `interval`: an error should name the argument the user passed
  validation.check_int("precondition_frequency", precondition_frequency, low=1)
  inner = optax.chain(scale_by_moments(b1, b2, eps), scale_by_bias_correction(b1, b2))

  def blocks(bd):
    return [rotate(inner, sides="both", interval=precondition_frequency,
                   b3=b2 if shampoo_beta is None else shampoo_beta, statistics="after",
                   refresh="power_qr", reexpress=("mu",), permute=("nu",),
                   max_precond_dim=_precond_limit(max_precond_dim), dims=bd,
                   owners=owners.state_devices(owner_layout), transposable=True)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="soap")


@named('shampoo(1e-3, interval=2)', static_args=('max_precond_dim', 'refresh'))
def shampoo(learning_rate: optax.ScalarOrSchedule, *, eps: float = 1e-6, interval: int = 10,
            max_precond_dim: Optional[int] = None, refresh: str = "eigh",
            weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
            dims: matrices.DimsSpec = None,
            stack_matrices: Union[bool, str] = "auto",
            owner_layout: Any = "auto",
            fallback: Optional[optax.GradientTransformation] = None,
            fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
            ) -> optax.GradientTransformationExtraArgs:
  r"""Shampoo (Gupta et al. 2018, arXiv:1802.09568; paper Sec. 3.2, App. "Shampoo").

  .. math::

    L \leftarrow L + G G^\top,\ R \leftarrow R + G^\top G,\quad
    W \leftarrow W - \eta_t\, (L + \epsilon I)^{-1/4}\, G\, (R + \epsilon I)^{-1/4}

  with the inverse roots (eigendecompositions) recomputed when ``(t-1) mod K == 0``.
  State per ``m x n`` matrix: ``2 m^2 + 2 n^2`` (statistics and roots).

  ``refresh="power_qr"``: after the first, each side's basis is refreshed by one
  warm-started power iteration ``U <- QR(L U)`` on the old basis sorted
  by ``diag(U^T L U)`` (SOAP's refresh, Vyas et al. 2024), and the roots use the Rayleigh
  quotients ``diag(U^T L U)`` of the new basis as eigenvalues: matrix products and one
  batched factorization per shape instead of an ``eigh`` per matrix (one matrix after
  another on a GPU above 32 x 32), at the price of roots that track the exact ones
  across refreshes rather than equal them.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule.
    eps: ``epsilon`` added to ``L, R``; keep it well above float32's resolution of
      their eigenvalues.
    interval: root refresh period ``K`` (default 10).
    max_precond_dim: sides larger than this are not preconditioned (``None``: 10000);
      static.
    refresh: ``"eigh"`` (default: exact roots at every refresh) or ``"power_qr"`` (after
      the first: one warm-started power iteration, above); static.
{common}
  """
  validation.check_range("eps", eps, low=0.0, high=float("inf"))  # rotate's `stats_eps`

  def blocks(bd):
    return [rotate(optax.identity(), sides="both", interval=interval, b3=None,
                   statistics="before", refresh=refresh, eigenvalue_power=-0.25,
                   stats_eps=eps, max_precond_dim=_precond_limit(max_precond_dim), dims=bd,
                   owners=owners.state_devices(owner_layout), transposable=True)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="shampoo")


def _precond_limit(max_precond_dim):
  """``None`` (the default) is the standard limit, 10000 (SOAP's reference value)."""
  return MAX_PRECOND_DIM if max_precond_dim is None else max_precond_dim


MAX_PRECOND_DIM = 10000

shampoo.static_args = ("max_precond_dim", "refresh")
