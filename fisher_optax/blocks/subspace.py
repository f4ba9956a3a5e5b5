"""The low-rank message and its ends (paper Sec. 5): what passes from a low-rank source
(:func:`~fisher_optax.low_rank_track`, :func:`~fisher_optax.random_project`) to the
block that makes a dense update again.

Data flow of a low-rank chain::

    source  ->  on_coefficients(any optax tx)  ->  end

(the end: project_back, compensate or scale_by_subspace_ratio)

A source replaces every matrix gradient ``G`` (canonical layout, ``m x n``) by a
:class:`Subspace` holding the projected gradient ``sigma = U^T G`` (``r x n``), the
basis ``U`` (``m x r``) and ``G``; :func:`on_coefficients` runs an optax transformation
on the coefficients (``sigma`` at first) and nothing else; :func:`project_back` maps
``U @ coeffs`` back to a dense update in the parameter's layout and dtype (GaLore's
back-projection). :func:`in_subspace` is the whole pipeline as one transformation.

Every array of a :class:`Subspace` is a pytree child. Its last child is a
:class:`SubspaceGuard`, a leaf that refuses any use as an array, so that a transformation
placed between the ends without :func:`on_coefficients` (``optax.scale``,
``optax.clip_by_global_norm``: they would act on the basis and the gradient as well) or
a ``jax.jit`` / ``lax.cond`` / ``vmap`` boundary between the ends is a ``TypeError``
that names the misuse, never a silently wrong update.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fisher_optax import lifting, linalg, matrices, validation
from fisher_optax.parallel import owners

MISUSE = (
    "a low-rank `Subspace` message (made by low_rank_track or random_project) was used "
    "outside its pipeline. Between a low-rank source and its end (project_back, "
    "compensate, scale_by_subspace_ratio) a transformation goes inside "
    "`source.on_coefficients(tx)` (or use fisher_optax.in_subspace(source, tx, end=...)), "
    "and the chain from source to end runs inside one traced function (no jax.jit, "
    "lax.cond or vmap boundary between them).")


class SubspaceGuard:
  """The leaf of a :class:`Subspace` that refuses to be used as an array: any arithmetic,
  attribute or conversion raises a ``TypeError`` saying where a transformation between a
  low-rank source and its end belongs, and ``jax.jit`` refuses to return it. It holds no
  data."""

  __slots__ = ()

  def __getattr__(self, name):
    raise TypeError(f"SubspaceGuard: {MISUSE}")

  def _refuse(self, *args, **kwargs):
    raise TypeError(f"SubspaceGuard: {MISUSE}")

  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
  __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _refuse
  __neg__ = __pos__ = __abs__ = __array__ = __float__ = __int__ = __bool__ = _refuse
  __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = __len__ = __iter__ = _refuse

  def __repr__(self):
    return "SubspaceGuard()"


_GUARD = SubspaceGuard()
_FIELDS = ("coeffs", "sigma", "basis", "grad")


@jax.tree_util.register_pytree_with_keys_class
class Subspace:
  """Per-matrix message between a low-rank source and its end.

  Its arrays are pytree children, in canonical layout and float32.

  Attributes:
    coeffs: ``batch + (r, n)``: what :func:`on_coefficients` transforms (starts as
      ``sigma``).
    sigma: ``batch + (r, n)``: the projected gradient ``U^T G``.
    basis: ``batch + (m, r)``: the basis ``U``.
    grad: ``batch + (m, n)``: the gradient ``G``.

  Static metadata: ``view`` (how canonical arrays map back to the leaf's layout),
  ``dtype`` (the gradient's dtype; dense outputs are cast to it) and ``layout`` (where
  the source moved the gradient's columns under the owner layout, else ``None``). The
  fifth child is a :class:`SubspaceGuard` (module docstring).
  """

  __slots__ = _FIELDS + ("view", "dtype", "layout")

  def __init__(self, coeffs, sigma, basis, grad, view, dtype, layout=None):
    self.coeffs, self.sigma, self.basis, self.grad = coeffs, sigma, basis, grad
    self.view, self.dtype, self.layout = view, dtype, layout

  def with_coeffs(self, coeffs) -> "Subspace":
    return Subspace(coeffs, self.sigma, self.basis, self.grad, self.view, self.dtype,
                    self.layout)

  def tree_flatten_with_keys(self):
    keys = [jax.tree_util.GetAttrKey(f) for f in _FIELDS + ("guard",)]
    values = [self.coeffs, self.sigma, self.basis, self.grad, _GUARD]
    return list(zip(keys, values)), (self.view, self.dtype, self.layout)

  def tree_flatten(self):
    return ((self.coeffs, self.sigma, self.basis, self.grad, _GUARD),
            (self.view, self.dtype, self.layout))

  @classmethod
  def tree_unflatten(cls, aux, children):
    coeffs, sigma, basis, grad, _ = children
    return cls(coeffs, sigma, basis, grad, *aux)

  def __repr__(self):
    return f"Subspace(coeffs={getattr(self.coeffs, 'shape', self.coeffs)}, view={self.view})"


class SubspaceSource(optax.GradientTransformation):
  """A transformation that emits :class:`Subspace` nodes (:func:`low_rank_track`,
  :func:`~fisher_optax.random_project`); it knows its ``rank`` and ``dims``, so
  ``source.on_coefficients(inner)`` needs them no second time::

    track = fo.low_rank_track(rank=8, interval=200)
    galore_like = optax.chain(track, track.on_coefficients(optax.scale_by_adam()),
                              fo.project_back())

  (:func:`in_subspace` writes the same chain in one call.)
  """

  def on_coefficients(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    return on_coefficients(inner, rank=self.rank, dims=self.dims, side=self.side)


def subspace_source(init_fn, update_fn, *, rank: int, dims: matrices.DimsSpec,
                    side: str = "smaller") -> SubspaceSource:
  out = SubspaceSource(init_fn, update_fn)
  out.rank, out.dims, out.side = rank, dims, side
  return out


def is_subspace(x: Any) -> bool:
  return isinstance(x, Subspace)


def clipped_rank(rank: int, view: matrices.MatrixView) -> int:
  """``rank`` clipped to ``min(m, n)`` of one matrix."""
  return min(int(rank), view.m)


SIDES = ("smaller", "larger")


def check_side(side: str) -> str:
  if side not in SIDES:
    raise ValueError(f"`side` must be one of {SIDES}, got {side!r}")
  return side


def lift(tree, dims, what, side: str = "smaller", canonical: bool = False) -> lifting.Lifted:
  """The tree lifted with the projected side as rows: ``m <= n`` for ``side="smaller"``
  (the paper's convention), ``m >= n`` for ``side="larger"``."""
  return lifting.Lifted(tree, dims, side=side, what=what, canonical=canonical)


class OnCoefficientsState(NamedTuple):
  """State of :func:`on_coefficients`: the inner transformation's state, shaped like the
  ``r x n`` subspace coefficients."""

  inner_state: optax.OptState


def on_coefficients(inner: optax.GradientTransformation, *, rank: int,
                    dims: matrices.DimsSpec = None,
                    side: str = "smaller") -> optax.GradientTransformation:
  """Runs ``inner`` (e.g. ``optax.scale_by_adam``) on the subspace coefficients.

  ``inner`` sees a tree of ``batch + (r, n)`` arrays (``r`` clipped per matrix)
  and must not need ``params``. ``rank`` and ``dims`` must equal those given to
  :func:`low_rank_track` (they define the coefficient shapes at ``init``), and so must
  ``side``; ``track.on_coefficients(inner)`` (``SubspaceSource``) takes them from
  the tracking block itself.
  """
  check_side(side)
  validation.check_int("rank", rank, low=1)
  rank = validation.static_int("rank", rank)
  what = "on_coefficients"

  def _coeff_like(params):
    return lift(params, dims, what, side).per_view(
        lambda v: jnp.zeros(v.batch_shape + (clipped_rank(rank, v), v.n), jnp.float32))

  def init_fn(params):
    return OnCoefficientsState(inner_state=inner.init(_coeff_like(params)))

  def update_fn(updates, state, params=None):
    del params
    def get(s):
      if not is_subspace(s):
        raise ValueError("on_coefficients expects the output of low_rank_track, got a "
                         f"{type(s).__name__} leaf")
      if s.coeffs.shape[-2] != clipped_rank(rank, s.view):
        raise ValueError(f"on_coefficients(rank={rank}) does not match the rank "
                         f"{s.coeffs.shape[-2]} emitted by low_rank_track for a leaf of "
                         f"shape {s.view.shape}: give both blocks the same `rank`.")
      return s.coeffs

    coeffs = jax.tree.map(get, updates, is_leaf=is_subspace)
    nodes = jax.tree.leaves(updates, is_leaf=is_subspace)
    coeffs, derived = owners.coefficient_layout(coeffs, [s.view for s in nodes],
                                                [s.layout for s in nodes])
    with owners.deriving(derived):
      new_coeffs, inner_state = inner.update(coeffs, state.inner_state, None)
    out = jax.tree.map(lambda s, c: s.with_coeffs(c.astype(jnp.float32)),
                       updates, new_coeffs, is_leaf=is_subspace)
    return out, OnCoefficientsState(inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


@jax.jit
def _times(a: jax.Array, b: jax.Array) -> jax.Array:
  return linalg.matmul(a, b)


def dense_low_rank(s: Subspace) -> jax.Array:
  """``U @ coeffs`` in canonical layout (float32; traced once per shape,
  :func:`fisher_optax.grouping.shared`)."""
  return _times(s.basis, s.coeffs)


def to_leaf(s: Subspace, canonical: jax.Array) -> jax.Array:
  """Canonical ``batch + (m, n)`` array -> the parameter's layout and dtype. Where the
  source moved the gradient's columns (``s.layout``,
  :func:`fisher_optax.parallel.owners.relay_split`), the dense update is formed there
  and crosses back once; left to XLA, it was formed where the rows are, from the
  coefficients gathered whole."""
  if s.layout is not None:
    canonical = owners.relaid(canonical, list(s.layout))
  return lifting.from_canonical_as(canonical, s.view, jnp.dtype(s.dtype))


def project_back() -> optax.GradientTransformation:
  """Maps each :class:`Subspace` to the dense update ``U @ coeffs`` (GaLore's back-projection)."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda s: to_leaf(s, dense_low_rank(s)), updates,
                        is_leaf=is_subspace), state

  return optax.GradientTransformation(init_fn, update_fn)


def in_subspace(source: SubspaceSource, inner: optax.GradientTransformation, *,
                end: Optional[optax.GradientTransformation] = None
                ) -> optax.GradientTransformation:
  """The low-rank pipeline as one transformation, with an inner optimizer on the
  coefficients (as ``optax.contrib.galore(base_optimizer=...)``)::

    tx = fo.in_subspace(fo.low_rank_track(rank=128, interval=200), optax.adam(1e-3))

  is ``optax.chain(source, source.on_coefficients(inner), end)``: ``inner`` (any optax
  transformation not needing ``params``, learning rate included) acts on the ``r x n``
  coefficients only, and ``end`` (default :func:`project_back`; or
  :func:`~fisher_optax.compensate`, :func:`~fisher_optax.scale_by_subspace_ratio`) makes
  the dense update.
  """
  if not isinstance(source, SubspaceSource):
    raise ValueError("in_subspace needs a low-rank source (fisher_optax.low_rank_track or "
                     f"fisher_optax.random_project), got {type(source).__name__}")
  end = end if end is not None else project_back()
  return optax.chain(source, source.on_coefficients(inner), end)
