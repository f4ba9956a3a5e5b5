r"""How close each structured approximation comes to a layer's empirical Fisher, without
forming the Fisher.

For an ``m x n`` layer and gradient samples ``G_1..G_N`` (e.g. micro-batch gradients),
``F = (1/N) sum_k vec(G_k) vec(G_k)^T`` is ``mn x mn``: 17 TB in float64 for a
512 x 2048 layer. Every structure's optimum ``F~`` (paper Sec. 3-5, the same members as
``fisher_optax.fisher.fim``) and its error ``||F~ - F||_F`` follow from products with the
samples alone, through

.. math::

  \|\tilde F - F\|_F^2 = \|\tilde F\|_F^2 - 2 \langle \tilde F, F\rangle + \|F\|_F^2,
  \qquad \|F\|_F^2 = \|K\|_F^2 / N^2,\quad K_{kl} = \langle G_k, G_l\rangle,
  \qquad \langle \tilde F, F\rangle = \frac1N \sum_k \mathrm{vec}(G_k)^\top \tilde F\,
  \mathrm{vec}(G_k).

For the exact minimisers the cross term equals ``||F~||^2`` and the error is
``||F||^2 - ||F~||^2``; for a structure that is diagonal in a rotated basis (Adam,
Eigen-Adam, SOAP, Alice's core) the rotation is orthogonal, so its error is the diagonal
structure's error on the rotated samples.

=======================  =====================================  ========================
structure                ``||F~ - F||^2`` from                  cost (FLOPs), memory
=======================  =====================================  ========================
``diagonal`` (Adam)      ``||F||^2 - ||E[G^2]||^2``             ``N mn``; ``mn``
``whitening`` I (x) M    ``||F||^2 - n ||M||^2``, ``M =          ``2 N m^2 n``; ``m^2``
                         E[GG^T]/n`` (Prop. 3.2)
``normalization`` S(x)I  ``||F||^2 - m ||s||^2``                ``N mn``; ``n``
``two_sided`` S (x) Q    fixed point on ``P = E[G^2]``          ``N mn + 4 mn`` / iter.
``general`` S (x) M      fixed point, ``S`` diagonal            ``4 N m^2 n`` / iteration
``kronecker`` A (x) B    Van Loan: top singular pair of the     ``4 N mn (m + n)`` / iter.
                         rearranged ``F`` by power iteration    wide: ``4 N^2 d^3`` / iter.
                                                                (``d = min(m, n)``)
``shampoo``              ``R^1/2 (x) L^1/2`` (upper bound)      ``2 N mn (m + n)``, eighs
``eigen_adam``           diagonal of ``U^T G``, ``U =           ``4 N m^2 n + 9 m^3``
                         eig(E[GG^T])``
``soap``                 diagonal of ``U_L^T G U_R``            ``4 N mn (m + n)``, eighs
``alice``                rank-``r`` core + optimal              ``2 N m^2 n + 2 N rmn``
                         compensation (Thm. "Optimal
                         compensation")
``alice_no_comp``        rank-``r`` core alone                  as ``alice``
=======================  =====================================  ========================

Peak memory is the samples (``N mn``) plus the Gram matrix (``N^2``), the side
statistics (``m^2``, ``n^2``) and one rotated copy of the samples (``N mn``) for the
rotated structures; the Kronecker optimum of a wide layer takes the route through the
smaller side's ``Nd x Nd`` Gram matrix (two copies, at most 2 GiB each). Everything runs
in float64 numpy by default (``dtype=``); tests check
every structure against the dense ``fisher_optax.fisher.fim`` to 1e-8 relative.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from fisher_optax.fisher import fim

STRUCTURES = ("diagonal", "whitening", "normalization", "two_sided", "general", "kronecker",
              "shampoo", "eigen_adam", "soap", "alice", "alice_no_comp")
LOW_RANK = ("alice", "alice_no_comp")


@dataclasses.dataclass(frozen=True)
class StructureError:
  """One structure's fit to a layer's empirical Fisher.

  Attributes:
    structure: its name (``STRUCTURES``).
    error: ``||F~ - F||_F``.
    relative: ``||F~ - F||_F / ||F||_F``.
    numbers: how many numbers the structure ``F~`` itself holds (its statistics, not an
      optimizer's moments).
  """
  structure: str
  error: float
  relative: float
  numbers: int


class LayerSamples:
  """Gradient samples ``[N, m, n]`` of one layer and the statistics shared by structures
  (computed once, on first use). ``name`` labels errors.

  Samples whose largest entry lies outside ``2^(+-maxexp/8)`` of ``dtype`` (about
  ``1e+-38`` in float64) are held divided by ``2^exponent`` (exact); the statistics are
  those of the held samples, and :class:`StructureError`'s ``error`` is scaled back.
  All-zero samples raise a ``ValueError`` (``F = 0`` has no relative error)."""

  def __init__(self, samples, *, name: str = "layer", dtype=np.float64):
    g = np.asarray(samples)
    if g.ndim != 3:
      raise ValueError(f"{name}: samples must be [N, m, n], got shape {g.shape}")
    if g.shape[0] < 2:
      raise ValueError(f"{name}: an empirical Fisher needs at least two gradient samples, "
                       f"got {g.shape[0]}")
    if not np.all(np.isfinite(g)):
      raise ValueError(f"{name}: the gradient samples hold non-finite values")
    if min(g.shape[1:]) < 2:
      raise ValueError(f"{name}: a {g.shape[1]} x {g.shape[2]} leaf is no matrix for these "
                       "structures (both sides must be at least 2)")
    peak = float(np.max(np.abs(g)))
    if peak == 0.0:
      raise ValueError(f"{name}: every gradient sample is zero, so the empirical Fisher is 0 "
                       "and no structure has a relative error")
    self.name = name
    self.g = g.astype(dtype, copy=False)
    # Relative errors do not depend on the samples' scale, but F holds their squares and
    # ||F||^2 their fourth powers: samples far from 1 (|G| ~ 1e-150 or 1e150 in float64)
    # underflow or overflow. Such samples are rescaled by a power of two (exact), and the
    # absolute errors scaled back (F scales with its square).
    limit = np.finfo(dtype).maxexp // 8
    exponent = int(np.frexp(peak)[1])
    self.exponent = exponent if abs(exponent) > limit else 0
    if self.exponent:
      self.g = np.ldexp(self.g, -self.exponent)
    self.n_samples, self.m, self.n = g.shape
    self._cache = {}

  def _get(self, key, fn):
    if key not in self._cache:
      self._cache[key] = fn()
    return self._cache[key]

  @property
  def fisher_sq(self) -> float:
    """``||F||_F^2 = ||K||_F^2 / N^2`` from the ``N x N`` Gram matrix of the samples."""
    def compute():
      v = self.g.reshape(self.n_samples, -1)
      k = v @ v.T
      return float(np.sum(k * k)) / self.n_samples ** 2
    return self._get("fisher_sq", compute)

  @property
  def left(self) -> np.ndarray:
    """``E[G G^T]`` (``m x m``), one ``m x Nn`` product."""
    def compute():
      cat = np.moveaxis(self.g, 0, 1).reshape(self.m, -1)
      return cat @ cat.T / self.n_samples
    return self._get("left", compute)

  @property
  def right(self) -> np.ndarray:
    """``E[G^T G]`` (``n x n``), one ``Nm x n`` product."""
    def compute():
      stack = self.g.reshape(-1, self.n)
      return stack.T @ stack / self.n_samples
    return self._get("right", compute)

  @property
  def left_eigh(self) -> tuple:
    """``eigh(E[G G^T])``: eigenvalues ascending and eigenvectors, shared by the
    structures that rotate or take powers of the left side."""
    return self._get("left_eigh", lambda: fim.eigh_sym(self.left))

  @property
  def right_eigh(self) -> tuple:
    """``eigh(E[G^T G])``, as :attr:`left_eigh`."""
    return self._get("right_eigh", lambda: fim.eigh_sym(self.right))

  def eigvecs_desc(self, side: str) -> np.ndarray:
    """The eigenvectors of ``E[G G^T]`` (``side="left"``) or ``E[G^T G]`` (``"right"``),
    by descending eigenvalue (columns)."""
    return (self.left_eigh if side == "left" else self.right_eigh)[1][:, ::-1]

  @property
  def second_moment(self) -> np.ndarray:
    """``P = E[G * G]`` (``m x n``)."""
    return self._get("p", lambda: np.mean(self.g * self.g, axis=0))

  def rotated_diagonal_sq(self, u_left: Optional[np.ndarray], u_right: Optional[np.ndarray]):
    """``||E[(U_L^T G U_R)^2]||^2`` and that ``m' x n'`` diagonal, for orthonormal bases
    (``None``: the identity on that side)."""
    x = self.g
    if u_left is not None:
      x = np.einsum("ma,kmn->kan", u_left, x, optimize=True)
    if u_right is not None:
      x = x @ u_right
    d = np.mean(x * x, axis=0)
    return float(np.sum(d * d)), d


def _result(structure: str, s: LayerSamples, err_sq: float, numbers: int) -> StructureError:
  err = float(np.sqrt(max(err_sq, 0.0)))
  return StructureError(structure, float(np.ldexp(err, 2 * s.exponent)),
                        err / np.sqrt(s.fisher_sq), int(numbers))


def diagonal(s: LayerSamples) -> StructureError:
  """Adam's ``diag(E[vec(G)^2])``: ``||F||^2 - ||E[G^2]||^2``."""
  return _result("diagonal", s, s.fisher_sq - float(np.sum(s.second_moment ** 2)), s.m * s.n)


def whitening(s: LayerSamples) -> StructureError:
  """``I_n (x) M``, ``M = E[G G^T] / n``: ``||F||^2 - n ||M||^2``."""
  mm = s.left / s.n
  return _result("whitening", s, s.fisher_sq - s.n * float(np.sum(mm * mm)), s.m * s.m)


def normalization(s: LayerSamples) -> StructureError:
  """``S (x) I_m``, ``S = diag(E[G^T G]) / m``: ``||F||^2 - m ||s||^2``."""
  sv = np.diag(s.right) / s.m
  return _result("normalization", s, s.fisher_sq - s.m * float(np.sum(sv * sv)), s.n)


def _iterate(step, state, *, iters: int, tol: float):
  """Runs ``state, value = step(state)`` until ``value`` changes by less than ``tol``
  relative, at most ``iters`` times."""
  value = None
  for _ in range(iters):
    state, new = step(state)
    if value is not None and abs(new - value) <= tol * abs(new):
      return state
    value = new
  return state


def two_sided(s: LayerSamples, *, iters: int = 10_000, tol: float = 1e-14) -> StructureError:
  """RACS's ``S (x) Q`` (diagonal): the fixed point ``s = P^T q / ||q||^2,
  q = P s / ||s||^2`` of Prop. "Two-sided scaling" from ``q = 1``;
  ``||F~||^2 = ||q||^2 ||s||^2``, ``<F~, F> = q^T P s``."""
  p = s.second_moment

  def step(q):
    sv = p.T @ q / (q @ q)
    q = p @ sv / (sv @ sv)
    return q, float(q @ p @ sv)

  q = _iterate(step, np.ones(s.m), iters=iters, tol=tol)
  sv = p.T @ q / (q @ q)
  cross = float(q @ p @ sv)
  err_sq = s.fisher_sq - 2 * cross + float(q @ q) * float(sv @ sv)
  return _result("two_sided", s, err_sq, s.m + s.n)


def general(s: LayerSamples, *, iters: int = 300, tol: float = 1e-12) -> StructureError:
  """``S (x) M`` with diagonal ``S`` and SPD ``M``: the fixed point of Thm.
  "generalization to normalization and whitening", ``s_i = E[g_i^T M g_i] / ||M||^2``,
  ``M = E[G S G^T] / ||S||^2``, from ``M = I``; ``<F~, F> = sum_i s_i E[g_i^T M g_i]``."""
  g = s.g
  cat = np.moveaxis(g, 0, 1).reshape(s.m, -1)

  def quad(mm):  # E[g_i^T M g_i] for every column i
    mg = (mm @ cat).reshape(s.m, s.n_samples, s.n)
    return np.einsum("mkn,mkn->n", mg, np.moveaxis(g, 0, 1), optimize=True) / s.n_samples

  def step(mm):
    sv = quad(mm) / np.sum(mm * mm)
    mm = (np.moveaxis(g * sv, 0, 1).reshape(s.m, -1) @ cat.T) / s.n_samples / (sv @ sv)
    return mm, float(sv @ quad(mm))

  mm = _iterate(step, np.eye(s.m), iters=iters, tol=tol)
  qv = quad(mm)
  sv = qv / np.sum(mm * mm)
  err_sq = s.fisher_sq - 2 * float(sv @ qv) + float(sv @ sv) * float(np.sum(mm * mm))
  return _result("general", s, err_sq, s.n + s.m * s.m)


def kronecker(s: LayerSamples, *, iters: int = 300, tol: float = 1e-12,
              route: Optional[str] = None) -> StructureError:
  """The nearest Kronecker product ``A (x) B`` (Van Loan & Pitsianis): the rearranged
  Fisher ``R(F) = E[G^T (x) G^T]`` has ``||R|| = ||F||``, so the optimum is its top
  singular pair and ``||F - F~||^2 = ||F||^2 - sigma_1^2``.

  Two exact routes to ``sigma_1`` (``route``; default: the cheaper one for the shape):

  * ``"sides"``: power iteration ``A <- E[G^T B G]``, ``B <- E[G A G^T]`` (normalised),
    from Shampoo's ``A = E[G^T G]``; ``sigma_1 = E[tr(G^T B G A)]`` for unit ``A, B``.
    ``4 N mn (m + n)`` FLOPs per iteration, ``m^2 + n^2`` memory.
  * ``"gram"``: the same iteration with ``A`` eliminated, on the smaller side ``d``
    (``D`` the larger): ``B <- (1/N^2) sum_jk K_jk B K_jk^T`` with the blocks
    ``K_jk = G_j G_k^T`` of the samples' ``Nd x Nd`` Gram matrix, from Shampoo's
    ``B = E[G G^T]``; ``sigma_1^2`` is the Rayleigh quotient ``<B, T(B)>``.
    ``N^2 d^2 D`` FLOPs once and ``4 N^2 d^3`` per iteration, ``N^2 d^2`` memory: far
    cheaper for a wide layer (an output layer ``d_model x vocabulary``).
  """
  if route is None:
    route = "gram" if _gram_is_cheaper(s) else "sides"
  if route == "gram":
    sigma_sq = _kronecker_gram(s, iters=iters, tol=tol)
    return _result("kronecker", s, s.fisher_sq - sigma_sq, s.m * s.m + s.n * s.n)
  if route != "sides":
    raise ValueError(f"{s.name}: route must be 'sides' or 'gram', got {route!r}")
  g = s.g
  cat = np.moveaxis(g, 0, 1).reshape(s.m, -1)          # m x Nn
  stack = g.reshape(-1, s.n)                            # Nm x n

  def left_of(a):   # E[G A G^T]
    return (np.moveaxis(g @ a, 0, 1).reshape(s.m, -1) @ cat.T) / s.n_samples

  def right_of(b):  # E[G^T B G]
    bg = np.moveaxis((b @ cat).reshape(s.m, s.n_samples, s.n), 1, 0).reshape(-1, s.n)
    return stack.T @ bg / s.n_samples

  def step(a):
    b = left_of(a)
    b /= np.linalg.norm(b)
    a = right_of(b)
    sigma = float(np.linalg.norm(a))
    return a / sigma, sigma

  a = s.right / np.linalg.norm(s.right)
  a = _iterate(step, a, iters=iters, tol=tol)
  b = left_of(a)
  b /= np.linalg.norm(b)
  sigma = float(np.sum(right_of(b) * a))
  return _result("kronecker", s, s.fisher_sq - sigma ** 2, s.m * s.m + s.n * s.n)


def _gram_is_cheaper(s: LayerSamples, iterations: int = 30) -> bool:
  """Whether :func:`kronecker`'s ``"gram"`` route costs fewer FLOPs than ``"sides"`` over
  ``iterations`` power steps."""
  d, big, n = min(s.m, s.n), max(s.m, s.n), s.n_samples
  gram = n * n * d * d * big + iterations * 4 * n * n * d ** 3
  sides = iterations * 4 * n * s.m * s.n * (s.m + s.n)
  return gram < sides and (n * d) ** 2 <= _GRAM_MAX_ENTRIES


_GRAM_MAX_ENTRIES = 2 ** 28  # the Gram route's N d x N d matrix: at most 2 GiB in float64


def _kronecker_gram(s: LayerSamples, *, iters: int, tol: float) -> float:
  """``sigma_1^2`` of the rearranged Fisher by :func:`kronecker`'s ``"gram"`` route."""
  g = s.g if s.m <= s.n else np.swapaxes(s.g, 1, 2)   # [N, d, D], d the smaller side
  n, d, _ = g.shape
  x = g.reshape(n * d, -1)
  gram = x @ x.T                                        # block (j, k): G_j G_k^T
  rows = gram.reshape(n, d, n * d)                      # rows[j] = [K_j1, ..., K_jN]

  def apply(b):  # T(B) = (1/N^2) sum_jk K_jk B K_jk^T, as two large matrix products
    z = (gram.reshape(-1, d) @ b).reshape(n, d, n * d)  # z[j] = [K_j1 B, ..., K_jN B]
    return np.matmul(z, rows.transpose(0, 2, 1)).sum(axis=0) / n ** 2

  def step(b):
    t = apply(b)
    value = float(np.sum(b * t))                        # Rayleigh quotient, unit b
    return t / np.linalg.norm(t), value

  left = (s.left if s.m <= s.n else s.right)
  b = _iterate(step, left / np.linalg.norm(left), iters=iters, tol=tol)
  return float(np.sum(b * apply(b)))


def shampoo(s: LayerSamples) -> StructureError:
  """Shampoo's ``R^1/2 (x) L^1/2``, ``R = E[G^T G] / m``, ``L = E[G G^T] / n`` (the
  minimiser of an upper bound, Thm. "Shampoo pre-conditioner"):
  ``||F~||^2 = tr(R) tr(L)``, ``<F~, F> = tr(L^1/2 E[G R^1/2 G^T])``."""
  r_half = fim.psd_power_of(*s.right_eigh, 0.5) / np.sqrt(s.m)
  l_half = fim.psd_power_of(*s.left_eigh, 0.5) / np.sqrt(s.n)
  cat = np.moveaxis(s.g, 0, 1).reshape(s.m, -1)
  grg = np.moveaxis(s.g @ r_half, 0, 1).reshape(s.m, -1) @ cat.T / s.n_samples
  cross = float(np.sum(l_half * grg))
  norm_sq = float(np.trace(s.right) / s.m) * float(np.trace(s.left) / s.n)
  return _result("shampoo", s, s.fisher_sq - 2 * cross + norm_sq, s.m * s.m + s.n * s.n)


def eigen_adam(s: LayerSamples) -> StructureError:
  """Eigen-Adam's ``blockdiag(U D_i U^T)``, ``U = eig(E[G G^T])``,
  ``D_i = diag(E[(U^T g_i)^2])`` (1-step refinement): the diagonal structure of the
  rotated samples ``U^T G``."""
  u = s.eigvecs_desc("left")
  d_sq, _ = s.rotated_diagonal_sq(u, None)
  return _result("eigen_adam", s, s.fisher_sq - d_sq, s.m * s.m + s.m * s.n)


def soap(s: LayerSamples) -> StructureError:
  """SOAP's ``(U_R (x) U_L) diag(vec(D)) (U_R (x) U_L)^T``, ``D = E[(U_L^T G U_R)^2]``
  with the eigenbases of ``E[G G^T]`` and ``E[G^T G]``: the diagonal structure of the
  rotated samples."""
  ul = s.eigvecs_desc("left")
  ur = s.eigvecs_desc("right")
  d_sq, _ = s.rotated_diagonal_sq(ul, ur)
  return _result("soap", s, s.fisher_sq - d_sq, s.m * s.m + s.n * s.n + s.m * s.n)


def alice(s: LayerSamples, rank: int, *, compensation: bool = True) -> StructureError:
  """Alice's rank-``r`` structure (Sec. 5): ``blockdiag(U D_i U^T)`` on the top-``r``
  eigenvectors ``U`` of ``E[G G^T]``, ``D = E[(U^T G)^2]``, plus (with ``compensation``)
  the optimal compensation ``diag(p / (m - r)) (x) (I - U U^T)``,
  ``p_j = E[||g_j||^2 - ||U^T g_j||^2]`` (Thm. "Optimal compensation"):
  ``||F~ - F||^2 = ||F||^2 - ||D||^2 - ||p||^2 / (m - r)``."""
  if not 1 <= rank < s.m:
    raise ValueError(f"{s.name}: Alice's rank must be in [1, {s.m - 1}] for a {s.m} x {s.n} "
                     f"layer (its smaller side is {s.m}), got {rank}")
  u = s.eigvecs_desc("left")
  u = u[:, :rank]
  d_sq, d = s.rotated_diagonal_sq(u, None)
  err_sq = s.fisher_sq - d_sq
  numbers = s.m * rank + rank * s.n
  if compensation:
    p = np.sum(s.second_moment, axis=0) - np.sum(d, axis=0)
    err_sq -= float(np.sum(np.maximum(p, 0.0) ** 2)) / (s.m - rank)
    numbers += s.n
  return _result("alice" if compensation else "alice_no_comp", s, err_sq, numbers)


_FUNCTIONS = {"diagonal": diagonal, "whitening": whitening, "normalization": normalization,
              "two_sided": two_sided, "general": general, "kronecker": kronecker,
              "shampoo": shampoo, "eigen_adam": eigen_adam, "soap": soap}


def structure_errors(samples, *, rank: Optional[int] = None,
                     structures: Sequence[str] = STRUCTURES, name: str = "layer",
                     smaller_first: bool = True, dtype=np.float64) -> dict:
  """Every structure's :class:`StructureError` for one layer's gradient samples
  ``[N, m, n]``, without forming the ``mn x mn`` Fisher.

  Args:
    samples: ``N >= 2`` gradient samples of an ``m x n`` layer, finite.
    rank: Alice's rank ``r`` (required when ``structures`` holds a low-rank one).
    structures: which of ``STRUCTURES``.
    name: the layer's name, for error messages.
    smaller_first: transpose a tall layer so that ``m <= n``, as the optimizers do (the
      one-sided structures then act on the smaller side).
    dtype: the arithmetic's dtype (float64 by default).

  Raises:
    ValueError: fewer than two samples, non-finite values, a side shorter than 2, an
      unknown structure, or a rank that does not fit the layer; each names the layer.
  """
  g = np.asarray(samples)
  if smaller_first and g.ndim == 3 and g.shape[1] > g.shape[2]:
    g = np.swapaxes(g, 1, 2)
  s = LayerSamples(g, name=name, dtype=dtype)
  unknown = [k for k in structures if k not in STRUCTURES]
  if unknown:
    raise ValueError(f"{name}: unknown structure(s) {unknown}; known: {list(STRUCTURES)}")
  out = {}
  for k in structures:
    if k in LOW_RANK:
      if rank is None:
        raise ValueError(f"{name}: structure {k!r} needs rank=")
      out[k] = alice(s, rank, compensation=(k == "alice"))
    else:
      out[k] = _FUNCTIONS[k](s)
  return out
