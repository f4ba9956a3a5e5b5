"""The two-sided scaling family (paper Sec. 3.3, 4): RACS."""

from typing import Any, Optional, Union

import optax

from fisher_optax import matrices
from fisher_optax.alias.closing import finish, named
from fisher_optax.blocks import norm_growth_limiter, scale_by_two_sided


@named('racs(1e-2)', static_args=('iters',))
def racs(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.9, alpha: float = 0.05,
         iters: int = 5, limiter: Optional[float] = 1.01, eps: float = 1e-8,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
         owner_layout: Any = False,
         fallback: Optional[optax.GradientTransformation] = None,
         fallback_learning_rate: Optional[optax.ScalarOrSchedule] = None
         ) -> optax.GradientTransformationExtraArgs:
  r"""RACS, row and column scaled SGD (paper Sec. 4, Alg. "RACS").

  .. math::

    s, q &\leftarrow \beta (s, q) + (1 - \beta)\, \mathrm{fixpoint}(G \odot G)
    \qquad W \leftarrow W - \eta_t\, \alpha\, \phi_t\,
    \mathrm{diag}(q)^{-1/2}\, G\, \mathrm{diag}(s)^{-1/2}

  where ``(s, q)`` is the fixed point of Prop. "Two-sided scaling" (the optimal
  ``S (x) Q`` FIM structure, Sec. 3.3) and ``phi_t`` the norm-growth limiter.
  Chain: :func:`scale_by_two_sided` -> :func:`norm_growth_limiter` -> ``scale(alpha)``
  -> ``scale_by_learning_rate``. State per ``m x n`` matrix: ``m + n + 1`` numbers.

  Args:
    learning_rate: ``eta_t``, a float or an optax schedule (paper 130M: 0.02 with
      ``alpha`` 0.05).
    beta: EMA decay of the scales ``s, q`` (paper: 0.9).
    alpha: update scale (paper: 0.05).
    iters: fixed-point iterations per step (paper: 5); may be traced.
    limiter: norm-growth limit ``gamma`` of the update (paper: 1.01, Fira's); ``None``
      disables it.
    eps: relative floor of the scales (``max(s) * eps``).
{common}
  """
  def blocks(bd):
    limit = [] if limiter is None else [norm_growth_limiter(limiter, dims=bd)]
    return [scale_by_two_sided(beta=beta, iters=iters, eps=eps, dims=bd), *limit,
            optax.scale(alpha)]

  return finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, owner=owner_layout, name="racs")
