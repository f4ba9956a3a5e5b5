"""Named optimizers: short chains of blocks, as optax builds its aliases from its
transforms. No math here.

Each returns an ``optax.GradientTransformationExtraArgs`` that applies the
structured rule to the leaves selected by ``mask`` (default: matrices, see
:func:`~fisher_optax.default_mask`) and ``fallback`` (default
``optax.adam(learning_rate)`` run in float32, :func:`fisher_optax.routing.in_float32`)
to the others. Defaults are the paper's 130M
settings (App. "Experiment details").
"""


import functools
import inspect
import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from fisher_optax import matrices, routing, stacking, validation
from fisher_optax.parallel import explicit_axes
from fisher_optax.blocks import (compensate, low_rank_track, norm_growth_limiter,
                                 project_back, random_project, rotate,
                                 scale_by_bias_correction, scale_by_subspace_ratio,
                                 scale_by_moments, scale_by_two_sided)
from fisher_optax.blocks import normalize, scale_by_momentum, scale_by_shape, whiten
from fisher_optax.blocks import scale_by_row_moments, scale_to_rms
from fisher_optax.refresh import (SubspaceRefresh, SvdRefresh, subspace_refresh, svd_refresh,
                                  switch)
from fisher_optax.blocks.whiten import MUON_COEFFS


# Arguments that are never schedules: optax.inject_hyperparams takes any callable for one,
# so a callable mask or dims of the user's (or a dtype class) must stay static.
_NEVER_SCHEDULES = ("mask", "dims", "fallback", "state_dtype")


def inject_hyperparams(factory, *, static_args=(), hyperparam_dtype=None):
  """``optax.inject_hyperparams`` for a named optimizer, with its shape-fixing
  arguments (``factory.static_args``: rank, leading, iters) and its routing arguments
  (``mask``, ``dims``, ``fallback``, ``state_dtype``: callables there are rules, not
  schedules) marked static.

  Plain ``optax.inject_hyperparams(fo.X, static_args=...)`` works too, with the
  arguments each optimizer's docstring marks *static*; :func:`~fisher_optax.path_mask`
  and :func:`~fisher_optax.flax_dims` are not Python callables and pass through it, but
  a ``mask``/``dims`` function of your own (or a dtype class as ``state_dtype``) must be
  listed in ``static_args`` there, since optax calls every callable argument as a
  schedule."""
  names = set(inspect.signature(factory).parameters)
  static = tuple(set(static_args) | set(getattr(factory, "static_args", ()))
                 | (names & set(_NEVER_SCHEDULES)))
  return optax.inject_hyperparams(factory, static_args=static,
                                  hyperparam_dtype=hyperparam_dtype)


_PAPER = "Gong, Scetbon, Ma, Meeds 2025, arXiv:2502.07752"

_COMMON_ARGS = """\
    weight_decay: decoupled weight decay ``lambda`` on the structured leaves
      (``W <- W - lr * (direction + lambda * W)``, as ``optax.adamw``); a float or a
      schedule; default ``None``: no decay (the paper uses none). Any number, ``0.0``
      included, adds the decay step (stateless), so the state is the same with and
      without ``optax.inject_hyperparams``.
    mask: which leaves get the structured rule: a tree of bools, a callable on the
      params (e.g. :func:`~fisher_optax.path_mask`), or ``None`` (default: every
      2-D leaf whose sides are both > 1 and whose name is not a bias or norm scale;
      :func:`~fisher_optax.default_mask`). The others get ``fallback``.
      With ``optax.inject_hyperparams``, a function of your own here must be in its
      ``static_args`` (optax calls callables as schedules); a ``fo.path_mask`` is no
      callable and needs nothing.
    dims: which axes of each leaf are the matrix rows and columns
      (:class:`~fisher_optax.MatrixDims`, a tree or callable of them,
      :func:`~fisher_optax.flax_dims` for a Flax NNX model, or a tree of
      ``optax.contrib.MuonDimensionNumbers`` as ``optax.contrib.muon`` and MaxText take,
      ``None`` entries to the fallback); other axes are stacks of independent matrices. Default ``None``: 2-D leaves as ``(m, n)``, leaves with more
      dims to the fallback. A ``dims`` that does not fit its leaf (axes out of range, a
      ``MatrixDims`` given for a vector) raises a ``ValueError`` naming the leaf at
      ``init``. ``fo.flax_dims`` rules pass through ``optax.inject_hyperparams``; a
      function of your own must be in its ``static_args``.
    stack_matrices: run the structured rule on same-shape matrices stacked into one
      ``(k, m, n)`` array per shape (``fisher_optax.stacking``):
      the same per-matrix update, state stored per shape instead of per leaf, one
      batched kernel per shape instead of one per leaf, compile time flat in depth for
      models with one leaf per layer. ``True``, ``False`` or ``"auto"`` (default:
      stacked where ``jax.default_backend()`` is a GPU or TPU when the optimizer is
      built, per-leaf on CPU, as measured faster on each). The price: the update holds
      a transient copy of the routed matrix gradients (XLA temporary memory;
      +350-650 MiB on the 130M LLaMA). A state of the other layout is a
      ``ValueError`` that says which ``stack_matrices`` continues it;
      :func:`fisher_optax.convert_state_layout` converts it.
      Matrices that draw random numbers (switching, APOLLO) get other draws.
    fallback: transformation for the other leaves (default
      ``optax.adam(fallback_learning_rate)`` run in float32), e.g.
      ``optax.adamw(lr, weight_decay=0.1)``.
    fallback_learning_rate: learning rate (or schedule) of the default fallback; default
      ``None``: ``learning_rate``, the paper's setting for embeddings, norms and biases.
      The structured rule's learning rate is scaled inside it (``alpha``, a unit-RMS
      direction), so it can be 10-20x above Adam's usable range: when the fallback
      receives weight matrices (kernels with no ``dims``), give it Adam's own rate, e.g.
      ``1e-3`` (docs: "Your model")."""


_APOLLO_ARGS = """\
    b1: first-moment decay.
    b2: second-moment decay.
    eps: Adam's ``epsilon`` (release: 1e-6).
    limiter: norm-growth limit (release: 1.01); ``None`` disables it.
    seed: base seed of the projections."""


def _documented(example: str):
  """Completes a named optimizer's docstring: the arguments every named optimizer
  shares (``{common}`` in its Args), the paper reference, and a runnable example."""

  def wrap(fn):
    doc = fn.__doc__.replace("{common}", _COMMON_ARGS).replace("{apollo}", _APOLLO_ARGS)
    doc = doc.rstrip() + "\n\n  Returns:\n    An ``optax.GradientTransformationExtraArgs``.\n"
    doc += "\n  Example:\n" + "".join(f"    {line}\n" if line else "\n"
                                         for line in example.strip().splitlines())
    doc += f"\n  Reference:\n    {_PAPER}.\n"
    fn.__doc__ = doc
    return fn

  return wrap


_EXAMPLE = """\
>>> import jax, jax.numpy as jnp, optax
>>> import fisher_optax as fo
>>> params = {{"w": jnp.ones((8, 16)), "b": jnp.zeros((16,))}}
>>> tx = fo.{call}
>>> state = tx.init(params)
>>> grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
>>> updates, state = tx.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)
>>> params["w"].shape
(8, 16)"""


def _ex(call: str) -> str:
  return _EXAMPLE.format(call=call)


def _finish(blocks: Callable[[matrices.DimsSpec], list], learning_rate, mask, dims, fallback,
            weight_decay=None, *, name: str = "structured", rank: Optional[int] = None,
            stack: Union[bool, str] = False, fallback_lr=None):
  """Closes a chain: ``blocks(block_dims)``, decoupled weight decay on the structured
  leaves, then the step size; then the optional stacked layout, ``Auto`` axes under an
  ``Explicit`` mesh (:func:`fisher_optax.with_auto_axes`) and the routing of leaves.

  ``blocks`` builds the optimizer's blocks for the matrix axes they see: the leaves'
  own ``dims``, or under ``stack`` (``stack_matrices=True``) the ``(k, fan_in,
  fan_out)`` stacks of :mod:`fisher_optax.stacking`, whose matrix axes are the last two.

  ``W <- W - lr * (direction + weight_decay * W)`` as in ``optax.adamw`` (Loshchilov &
  Hutter's decoupled decay, multiplied by the learning rate and its schedule). The decay
  applies to the leaves that get the structured rule (``mask``: matrices by default);
  the fallback (default ``optax.adam``) has none unless ``fallback`` brings its own,
  e.g. ``fallback=optax.adamw(lr, weight_decay=...)``.
  """
  validation.check_learning_rate("learning_rate", learning_rate)
  if fallback_lr is not None:
    validation.check_learning_rate("fallback_learning_rate", fallback_lr)
  if weight_decay is not None and not callable(weight_decay):
    validation.check_range("weight_decay", weight_decay, low=0.0, high=float("inf"))
  # ``None`` (not 0) means no decay, as in optax: then a traced weight decay under
  # ``optax.inject_hyperparams`` gives the same state structure as a Python number
  decay = [] if weight_decay is None else [optax.add_decayed_weights(weight_decay)]
  dims = matrices.as_dims(dims)  # optax.contrib.MuonDimensionNumbers trees read here
  stack = stacking.resolve(stack)
  structured = optax.chain(*blocks(None if stack else dims), *decay,
                           optax.scale_by_learning_rate(learning_rate))
  if stack:
    structured = stacking.stack_matrices(structured, dims=dims)
  # under a context mesh with ``Explicit`` axes the structured rule runs on ``Auto`` axes
  structured = explicit_axes.with_auto_axes(structured)
  if fallback is not None and fallback_lr is not None:
    raise ValueError(f"fo.{name}: give fallback= or fallback_learning_rate=, not both (the "
                     "learning rate is part of the fallback transformation you pass)")
  if fallback is None:
    fallback_lr = learning_rate if fallback_lr is None else fallback_lr
    fallback = routing.in_float32(optax.adam(fallback_lr))
  return routing.route(structured, mask=mask, dims=dims, fallback=fallback,
                       info=dict(name=name, rank=rank, stack_matrices=stack))


@_documented(_ex('racs(1e-2)'))
def racs(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.9, alpha: float = 0.05,
         iters: int = 5, limiter: Optional[float] = 1.01, eps: float = 1e-8,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="racs")


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


@_documented(_ex('alice(1e-2, rank=4, leading=1)'))
def alice(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256,
          leading: Optional[int] = None,
          interval: int = 200, alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9,
          b2: float = 0.9, b3: float = 0.999, limiter: Optional[float] = 1.01,
          eps: float = 1e-8, seed: int = 0,
          weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
          dims: matrices.DimsSpec = None,
          stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="alice", rank=rank)


@_documented(_ex('alice0(1e-2, rank=4, leading=1)'))
def alice0(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256,
           leading: Optional[int] = None,
           interval: int = 200, alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9,
           b2: float = 0.9, limiter: Optional[float] = 1.01, eps: float = 1e-8, seed: int = 0,
           weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
           dims: matrices.DimsSpec = None,
           stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="alice0", rank=rank)


@_documented(_ex('alice_soap(1e-2, rank=4, leading=1)'))
def alice_soap(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256,
               right_rank: Optional[int] = None, leading: Optional[int] = None,
               interval: int = 200,
               alpha: float = 0.3, alpha_c: float = 0.4, b1: float = 0.9, b2: float = 0.9,
               b3: float = 0.999, limiter: Optional[float] = 1.01, eps: float = 1e-8,
               seed: int = 0, weight_decay: Optional[optax.ScalarOrSchedule] = None,
               mask: Any = None,
               dims: matrices.DimsSpec = None,
               stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="alice_soap", rank=rank)


def _galore_head(rank, interval, b1, b2, eps, dims, state_dtype, refresh):
  refresh = subspace_refresh() if refresh is None else refresh
  if not isinstance(refresh, (SubspaceRefresh, SvdRefresh)):
    raise TypeError("`refresh` must be fo.subspace_refresh(...) or fo.svd_refresh(), got "
                    f"{refresh!r}")
  track = low_rank_track(rank=rank, interval=interval, refresh=refresh, dims=dims,
                         state_dtype=state_dtype)
  return [track, track.on_coefficients(scale_by_moments(b1, b2, eps, mu_dtype=state_dtype))]


@_documented(_ex('galore(1e-2, rank=4)'))
def galore(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
           scale: float = 0.3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
           weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
           dims: matrices.DimsSpec = None,
           stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="galore",
                 rank=rank)


@_documented(_ex('fira(1e-2, rank=4)'))
def fira(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
         scale: float = 0.3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         limiter: Optional[float] = 1.01,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="fira",
                 rank=rank)


racs.static_args = ("iters",)
alice.static_args = ("rank", "leading")
alice0.static_args = ("rank", "leading")
alice_soap.static_args = ("rank", "right_rank", "leading")
galore.static_args = ("rank",)
fira.static_args = ("rank",)


# ------------------------------------------------------------------ rotation family


@_documented(_ex('eigen_adam(1e-3, interval=2)'))
def eigen_adam(learning_rate: optax.ScalarOrSchedule, *, interval: int = 10, b1: float = 0.9,
               b2: float = 0.9, b3: float = 0.999, eps: float = 1e-8,
               max_precond_dim: Optional[int] = None, refresh: str = "eigh",
               weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
               dims: matrices.DimsSpec = None,
               stack_matrices: Union[bool, str] = "auto",
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
                   max_precond_dim=_precond_limit(max_precond_dim), dims=bd)]

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="eigen_adam")


@_documented(_ex('soap(1e-3, precondition_frequency=2)'))
def soap(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.95, b2: float = 0.95,
         shampoo_beta: Optional[float] = None, eps: float = 1e-8,
         precondition_frequency: int = 10, max_precond_dim: Optional[int] = None,
         weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
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
                   max_precond_dim=_precond_limit(max_precond_dim), dims=bd)]

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="soap")


@_documented(_ex('shampoo(1e-3, interval=2)'))
def shampoo(learning_rate: optax.ScalarOrSchedule, *, eps: float = 1e-6, interval: int = 10,
            max_precond_dim: Optional[int] = None, refresh: str = "eigh",
            weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
            dims: matrices.DimsSpec = None,
            stack_matrices: Union[bool, str] = "auto",
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
                   stats_eps=eps, max_precond_dim=_precond_limit(max_precond_dim), dims=bd)]

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="shampoo")


def _precond_limit(max_precond_dim):
  """``None`` (the default) is the standard limit, 10000 (SOAP's reference value)."""
  return MAX_PRECOND_DIM if max_precond_dim is None else max_precond_dim


MAX_PRECOND_DIM = 10000

eigen_adam.static_args = ("max_precond_dim", "refresh")
soap.static_args = ("max_precond_dim", "precondition_frequency")
shampoo.static_args = ("max_precond_dim", "refresh")


# ------------------------------------------------------------------------- Apollo


def _apollo(learning_rate, *, rank, interval, scale, kind, b1, b2, eps, limiter, seed, mask,
            dims, stack_matrices, fallback, weight_decay, fallback_learning_rate):
  validation.check_range("scale", scale, low=0.0, high=float("inf"))  # used here: sqrt
  def blocks(bd):
    project = random_project(rank=rank, interval=interval, seed=seed, dims=bd)
    limit = [] if limiter is None else [norm_growth_limiter(limiter, dims=bd)]
    return [project, project.on_coefficients(scale_by_moments(b1, b2, eps)),
            scale_by_subspace_ratio(kind), *limit,
            optax.scale(math.sqrt(scale)) if isinstance(scale, (int, float))
            else optax.scale(scale ** 0.5), scale_by_bias_correction(b1, b2)]

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 name="apollo" if kind == "channel" else "apollo_mini", rank=rank,
                 stack=stack_matrices)


@_documented(_ex('apollo(1e-2, rank=4)'))
def apollo(learning_rate: optax.ScalarOrSchedule, *, rank: int = 256, interval: int = 200,
           scale: float = 1.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
           limiter: Optional[float] = 1.01, seed: int = 0,
           weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
           dims: matrices.DimsSpec = None,
           stack_matrices: Union[bool, str] = "auto",
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
                 stack_matrices=stack_matrices,
                 fallback=fallback, weight_decay=weight_decay,
                 fallback_learning_rate=fallback_learning_rate)


@_documented(_ex('apollo_mini(1e-2)'))
def apollo_mini(learning_rate: optax.ScalarOrSchedule, *, interval: int = 200,
                scale: float = 128.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                limiter: Optional[float] = 1.01, seed: int = 0,
                weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
                dims: matrices.DimsSpec = None,
                stack_matrices: Union[bool, str] = "auto",
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
                 stack_matrices=stack_matrices,
                 fallback=fallback, weight_decay=weight_decay,
                 fallback_learning_rate=fallback_learning_rate)


apollo.static_args = ("rank",)


# ----------------------------------------------------------- normalization / whitening


@_documented(_ex('swan(1e-3)'))
def swan(learning_rate: optax.ScalarOrSchedule, *, steps: int = 5,
         coeffs: tuple = MUON_COEFFS, consistent_rms: Optional[float] = 0.2,
         eps: float = 1e-8, weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="swan")


@_documented(_ex('muon(1e-3)'))
def muon(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, nesterov: bool = True,
         steps: int = 5, coeffs: tuple = MUON_COEFFS, consistent_rms: Optional[float] = None,
         eps: float = 1e-8, weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
         dims: matrices.DimsSpec = None,
         stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="muon")


@_documented(_ex('normuon(1e-2)'))
def normuon(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, b2: float = 0.95,
            nesterov: bool = True, steps: int = 5, coeffs: tuple = MUON_COEFFS,
            rms: float = 0.2, eps: float = 1e-8,
            weight_decay: Optional[optax.ScalarOrSchedule] = None, mask: Any = None,
            dims: matrices.DimsSpec = None,
            stack_matrices: Union[bool, str] = "auto",
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

  return _finish(blocks, learning_rate, mask, dims, fallback, weight_decay,
                 fallback_lr=fallback_learning_rate,
                 stack=stack_matrices, name="normuon")


swan.static_args = ("steps",)
muon.static_args = ("steps",)
normuon.static_args = ("steps",)
apollo_mini.static_args = ()


# ------------------------------------------------------------- static arguments

# Arguments that fix array shapes. optax.inject_hyperparams turns every numeric argument
# it is not told is static into a jax array; for these that cannot work, and without a
# check the failure surfaces deep inside JAX as a ConcretizationTypeError.
_SHAPE_ARGS = ("rank", "right_rank", "max_precond_dim")


def _check_static(fn: Callable) -> Callable:
  """``fn`` raising a ``ValueError`` that names the fix when a shape-fixing argument
  arrives as a jax array (``optax.inject_hyperparams`` without ``static_args``)."""
  sig = inspect.signature(fn)
  names = [n for n in _SHAPE_ARGS if n in sig.parameters]

  @functools.wraps(fn)
  def named_optimizer(*args, **kwargs):
    given = sig.bind_partial(*args, **kwargs).arguments
    arrays = [n for n in names if isinstance(given.get(n), jax.Array)]
    if arrays:
      name = fn.__name__
      raise ValueError(
          f"fo.{name}: {', '.join(f'`{n}`' for n in arrays)} arrived as a jax array, but "
          "fixes array shapes and must be a Python int. optax.inject_hyperparams turns "
          "every numeric argument not in its static_args into an array: use "
          f"optax.inject_hyperparams(fo.{name}, static_args={tuple(fn.static_args)!r}) or "
          f"fo.inject_hyperparams(fo.{name}), which marks them static.")
    return fn(*args, **kwargs)

  named_optimizer.static_args = fn.static_args
  return named_optimizer


alice, alice0, alice_soap = map(_check_static, (alice, alice0, alice_soap))
galore, fira, apollo = map(_check_static, (galore, fira, apollo))
eigen_adam, soap, shampoo = map(_check_static, (eigen_adam, soap, shampoo))
