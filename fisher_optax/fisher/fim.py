"""The paper's theory made runnable: empirical Fisher matrices and structured optima.

For a small layer (``m x n``, ``mn`` up to a few thousand) and gradient samples
``G_1..G_N`` (expectations are sample means), this module builds the empirical FIM
``F = E[vec(G) vec(G)^T]`` (``vec`` stacks columns, as the paper) and, for each
structure of paper Sec. 3-5, the optimal (or the paper's approximate) member ``F~``
of the family ``min_{F~} ||F~ - F||_F`` (paper Eq. "UFE"), its Frobenius error and
the square-root natural-gradient direction ``devec(F~^{-1/2} vec(G))`` it implies
(pseudo-inverse on the null space of ``F~``).

Kronecker convention: ``(A (x) B) vec(X) = vec(B X A^T)``, so ``S (x) M`` acts as
``G -> M G S`` (``S``: n x n, ``M``: m x m).

========================  ===================================  =========================
structure                 closed form (paper)                  optimizer
========================  ===================================  =========================
``diagonal``              ``diag(E[vec(G)^2])`` (Prop. diag)   Adam
``whitening`` I (x) M     ``M = E[G G^T] / n`` (Prop. 3.2)     whitening (Muon/SWAN)
``normalization`` S (x) I ``S = diag(E[g_i^T g_i]) / m``       column normalisation
``two_sided`` S (x) Q     fixed point / rank-1 of ``E[G*G]``   RACS
``general`` S (x) M       fixed point (Thm. "generalization")  --
``shampoo``               ``R^1/2 (x) L^1/2``, ``R = E[G^T G]/m``,  Shampoo
                          ``L = E[G G^T]/n`` (upper bound)
``eigen_adam``            ``U = eig(E[GG^T])``, ``D_i =``      Eigen-Adam
                          ``diag(E[(U^T g_i)^2])`` (1-step)
``soap``                  ``U_L, U_R`` eigenbases, ``D =``     SOAP
                          ``diag(E[vec(U_L^T G U_R)^2])``
========================  ===================================  =========================

Exact minimisers: diagonal, whitening, normalization, two_sided, general. Shampoo
minimises an upper bound; Eigen-Adam and SOAP are one step of alternating
minimisation: for those the paper guarantees no ordering of errors (tests show the
actual behaviour). Everything here is float64 numpy: it is a reference, not a hot path.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

Array = np.ndarray


def vec(g: Array) -> Array:
  """Column-stacking ``vec`` (paper notation)."""
  return np.asarray(g, np.float64).reshape(-1, order="F")


def devec(v: Array, m: int, n: int) -> Array:
  return np.asarray(v).reshape((m, n), order="F")


def _stack(samples) -> Array:
  g = np.asarray(samples, np.float64)
  if g.ndim != 3:
    raise ValueError(f"samples must be [N, m, n], got shape {g.shape}")
  m, n = g.shape[1:]
  if m * n > 4096:
    raise ValueError(f"m*n = {m * n} > 4096: the dense FIM would be too large")
  return g


def empirical_fim(samples) -> Array:
  """``F = E[vec(G) vec(G)^T]`` (``mn x mn``) from samples ``[N, m, n]``."""
  g = _stack(samples)
  v = np.stack([vec(x) for x in g])
  return v.T @ v / len(g)


def _psd_power(a: Array, p: float, rtol: float = 1e-10) -> Array:
  """``a^p`` for a symmetric PSD matrix; eigenvalues below ``rtol * max`` are treated as 0
  (pseudo-inverse for negative ``p``)."""
  return psd_power_of(*eigh_sym(a), p, rtol)


def eigh_sym(a: Array) -> tuple:
  """``eigh`` of the symmetric part of ``a`` (eigenvalues ascending, eigenvectors)."""
  return np.linalg.eigh(0.5 * (a + a.T))


def psd_power_of(w: Array, v: Array, p: float, rtol: float = 1e-10) -> Array:
  """``a^p`` of a symmetric PSD matrix from its eigendecomposition ``(w, v)``;
  eigenvalues below ``rtol * max`` count as 0 (shared with ``structure_errors``)."""
  keep = w > rtol * max(w.max(), 0.0) if w.size else w > 0
  wp = np.zeros_like(w)
  wp[keep] = w[keep] ** p
  return (v * wp) @ v.T


def _eig_desc(a: Array) -> Array:
  return eigh_sym(a)[1][:, ::-1]


def blockdiag(blocks: Sequence[Array]) -> Array:
  d = sum(b.shape[0] for b in blocks)
  out = np.zeros((d, d))
  i = 0
  for b in blocks:
    k = b.shape[0]
    out[i:i + k, i:i + k] = b
    i += k
  return out


@dataclasses.dataclass
class Approximation:
  """A structured approximation ``F~`` of an empirical FIM.

  Attributes:
    name: the structure.
    matrix: the dense ``F~`` (``mn x mn``).
    error: ``||F~ - F||_F``.
    direction: ``G -> devec(F~^{-1/2} vec(G))``, the square-root NGD direction.
    factors: the structure's parameters (e.g. ``{"s": ..., "q": ...}``).
  """
  name: str
  matrix: Array
  error: float
  direction: Callable[[Array], Array]
  factors: dict


def _make(name, f_approx, fim, m, n, factors, direction=None):
  if direction is None:
    inv_sqrt = _psd_power(f_approx, -0.5)
    direction = lambda g: devec(inv_sqrt @ vec(g), m, n)
  return Approximation(name, f_approx, float(np.linalg.norm(f_approx - fim)), direction,
                       factors)


def diagonal(samples) -> Approximation:
  """Adam: ``F~ = diag(E[vec(G)^2])`` (Prop. "diagonal approximation")."""
  g = _stack(samples)
  _, m, n = g.shape
  d = np.mean(g ** 2, axis=0)
  f = np.diag(vec(d))
  safe = np.where(d > 0, d, 1.0)
  return _make("diagonal", f, empirical_fim(g), m, n, {"d": d},
               lambda x: np.where(d > 0, x / np.sqrt(safe), 0.0))


def whitening(samples) -> Approximation:
  """``I_n (x) M`` with ``M = E[G G^T] / n``; direction ``M^{-1/2} G``."""
  g = _stack(samples)
  _, m, n = g.shape
  mm = np.mean(g @ np.swapaxes(g, 1, 2), axis=0) / n
  return _make("whitening", np.kron(np.eye(n), mm), empirical_fim(g), m, n, {"M": mm},
               lambda x: _psd_power(mm, -0.5) @ x)


def normalization(samples) -> Approximation:
  """``S (x) I_m`` with ``S = diag(E[g_i^T g_i]) / m``; direction ``G S^{-1/2}``."""
  g = _stack(samples)
  _, m, n = g.shape
  s = np.mean(np.sum(g ** 2, axis=1), axis=0) / m
  safe = np.where(s > 0, s, 1.0)
  return _make("normalization", np.kron(np.diag(s), np.eye(m)), empirical_fim(g), m, n,
               {"s": s}, lambda x: np.where(s > 0, x / np.sqrt(safe), 0.0))


def two_sided(samples, iters: int = 500) -> Approximation:
  """RACS ``S (x) Q`` (diagonal ``S, Q``): fixed point of Prop. "Two-sided scaling",
  ``s = P^T q / ||q||^2, q = P s / ||s||^2`` with ``P = E[G * G]``, from ``q = 1``.
  Direction ``Q^{-1/2} G S^{-1/2}``."""
  g = _stack(samples)
  _, m, n = g.shape
  p = np.mean(g ** 2, axis=0)
  q = np.ones(m)
  for _ in range(iters):
    s = p.T @ q / (q @ q)
    q = p @ s / (s @ s)
  f = np.kron(np.diag(s), np.diag(q))
  return _make("two_sided", f, empirical_fim(g), m, n, {"s": s, "q": q},
               lambda x: x / np.sqrt(np.outer(q, s)))


def general(samples, iters: int = 500) -> Approximation:
  """``S (x) M`` (diagonal ``S``, SPD ``M``): fixed point of Thm. "generalization to
  normalization and whitening", ``s_i = E[g_i^T M g_i] / ||M||_F^2``,
  ``M = E[G S G^T] / ||S||_F^2``. Direction ``M^{-1/2} G S^{-1/2}``."""
  g = _stack(samples)
  _, m, n = g.shape
  mm = np.eye(m)
  for _ in range(iters):
    s = np.mean(np.einsum("kai,ab,kbi->ki", g, mm, g), axis=0) / np.sum(mm * mm)
    mm = np.mean(np.einsum("kai,i,kbi->kab", g, s, g), axis=0) / np.sum(s * s)
  f = np.kron(np.diag(s), mm)
  return _make("general", f, empirical_fim(g), m, n, {"s": s, "M": mm},
               lambda x: _psd_power(mm, -0.5) @ x / np.sqrt(s)[None, :])


def shampoo(samples) -> Approximation:
  """``R^1/2 (x) L^1/2`` with ``R = E[G^T G] / m``, ``L = E[G G^T] / n`` (Thm. "Shampoo
  pre-conditioner": the minimiser of an upper bound). Direction ``L^-1/4 G R^-1/4``."""
  g = _stack(samples)
  _, m, n = g.shape
  r = np.mean(np.swapaxes(g, 1, 2) @ g, axis=0) / m
  l = np.mean(g @ np.swapaxes(g, 1, 2), axis=0) / n
  f = np.kron(_psd_power(r, 0.5), _psd_power(l, 0.5))
  return _make("shampoo", f, empirical_fim(g), m, n, {"L": l, "R": r},
               lambda x: _psd_power(l, -0.25) @ x @ _psd_power(r, -0.25))


def eigen_adam(samples) -> Approximation:
  """Shared-eigenspace block diagonal ``blockdiag(U D_i U^T)`` by the 1-step refinement
  (Thm. "1-iteration refinement"): ``U = eig(E[GG^T])``, ``D_i = diag(E[(U^T g_i)^2])``.
  Direction ``U (U^T G) / sqrt(E[(U^T G)^2])``."""
  g = _stack(samples)
  _, m, n = g.shape
  u = _eig_desc(np.mean(g @ np.swapaxes(g, 1, 2), axis=0))
  d = np.mean((u.T @ g) ** 2, axis=0)  # m x n: column i is diag(D_i)
  f = blockdiag([u @ np.diag(d[:, i]) @ u.T for i in range(n)])
  safe = np.where(d > 0, d, 1.0)
  return _make("eigen_adam", f, empirical_fim(g), m, n, {"U": u, "D": d},
               lambda x: u @ np.where(d > 0, (u.T @ x) / np.sqrt(safe), 0.0))


def soap(samples) -> Approximation:
  """``(U_R (x) U_L) D~ (U_R (x) U_L)^T`` (paper Sec. 3.5, 1-step refinement):
  ``U_L = eig(E[GG^T])``, ``U_R = eig(E[G^T G])``, ``D~ = diag(E[vec(U_L^T G U_R)^2])``.
  Direction ``U_L ((U_L^T G U_R) / sqrt(D)) U_R^T``."""
  g = _stack(samples)
  _, m, n = g.shape
  ul = _eig_desc(np.mean(g @ np.swapaxes(g, 1, 2), axis=0))
  ur = _eig_desc(np.mean(np.swapaxes(g, 1, 2) @ g, axis=0))
  d = np.mean((ul.T @ g @ ur) ** 2, axis=0)
  k = np.kron(ur, ul)
  f = k @ np.diag(vec(d)) @ k.T
  safe = np.where(d > 0, d, 1.0)
  return _make("soap", f, empirical_fim(g), m, n, {"U_L": ul, "U_R": ur, "D": d},
               lambda x: ul @ np.where(d > 0, (ul.T @ x @ ur) / np.sqrt(safe), 0.0) @ ur.T)


def _top(a: Array, r: int) -> Array:
  return _eig_desc(a)[:, :r]


def _complement_scale(stat: Array, d: int) -> Array:
  """The compensation theorem's ``E[...] / d`` variances, 0 where there is nothing."""
  return np.maximum(stat, 0.0) / d if d > 0 else np.zeros_like(stat)


def alice(samples, rank: int) -> Approximation:
  """Alice's structure (paper Sec. 5, Eq. "alice update decomposition" and Thm. "Optimal
  compensation") with the rank-``r`` eigenbasis ``U`` of ``E[GG^T]``:
  ``blockdiag(U D_i U^T) + diag(p / (m - r)) (x) (I - U U^T)``, ``D_i =
  diag(E[(U^T g_i)^2])``, ``p_j = E[||g_j||^2 - ||U^T g_j||^2]``. The second term is the
  compensation's structure ``S^-2 (x) U_c U_c^T`` at its optimal ``S``."""
  g = _stack(samples)
  _, m, n = g.shape
  r = min(rank, m)
  u = _top(np.mean(g @ np.swapaxes(g, 1, 2), axis=0), r)
  sig = u.T @ g
  d = np.mean(sig ** 2, axis=0)  # r x n
  core = blockdiag([u @ np.diag(d[:, i]) @ u.T for i in range(n)])
  p = _complement_scale(np.mean(np.sum(g ** 2, 1) - np.sum(sig ** 2, 1), axis=0), m - r)
  f = core + np.kron(np.diag(p), np.eye(m) - u @ u.T)
  return _make("alice", f, empirical_fim(g), m, n, {"U": u, "D": d, "p": p})


def alice_soap(samples, rank: int, right_rank: int | None = None) -> Approximation:
  """:func:`fisher_optax.alice_soap`'s structure (docs/low_rank_soap.md): SOAP's
  ``(V (x) U) D (V (x) U)^T`` on rank-``r`` left and rank-``k`` right bases, plus the
  optimal compensations of the right complement inside ``span(U)`` and of the left
  complement::

    F~ = (V (x) U) diag(vec(D)) (V (x) U)^T            D = E[(U^T G V)^2]      (r x k)
       + (I - V V^T) (x) U diag(q / (n - k)) U^T       q_i = E[||sigma_i||^2 - ||(sigma V)_i||^2]
       + diag(p / (m - r)) (x) (I - U U^T)             p_j = E[||g_j||^2 - ||sigma_j||^2]

  with ``U = eig_r(E[G G^T])``, ``sigma = U^T G``, ``V = eig_k(E[sigma^T sigma])``. The
  three terms act on orthogonal subspaces of ``R^{mn}``; at ``r = m, k = n`` only the
  first remains and it is :func:`soap`."""
  g = _stack(samples)
  _, m, n = g.shape
  r = min(rank, m)
  k = min(rank if right_rank is None else right_rank, n)
  u = _top(np.mean(g @ np.swapaxes(g, 1, 2), axis=0), r)
  sig = u.T @ g  # N x r x n
  v = _top(np.mean(np.swapaxes(sig, 1, 2) @ sig, axis=0), k)
  core = sig @ v  # N x r x k
  d = np.mean(core ** 2, axis=0)
  kr = np.kron(v, u)
  q = _complement_scale(np.mean(np.sum(sig ** 2, 2) - np.sum(core ** 2, 2), axis=0), n - k)
  p = _complement_scale(np.mean(np.sum(g ** 2, 1) - np.sum(sig ** 2, 1), axis=0), m - r)
  f = (kr @ np.diag(vec(d)) @ kr.T
       + np.kron(np.eye(n) - v @ v.T, u @ np.diag(q) @ u.T)
       + np.kron(np.diag(p), np.eye(m) - u @ u.T))
  return _make("alice_soap", f, empirical_fim(g), m, n, {"U": u, "V": v, "D": d, "q": q, "p": p})


LOW_RANK_STRUCTURES = {"alice": alice, "alice_soap": alice_soap}


STRUCTURES = {"diagonal": diagonal, "whitening": whitening, "normalization": normalization,
              "two_sided": two_sided, "general": general, "shampoo": shampoo,
              "eigen_adam": eigen_adam, "soap": soap}


def all_structures(samples) -> dict[str, Approximation]:
  """Every structure of :data:`STRUCTURES` for the same samples."""
  return {k: f(samples) for k, f in STRUCTURES.items()}


def complement_fim(samples, u: Array) -> Array:
  """``F~_c = blockdiag(U_c D_{c,i} U_c^T)`` with ``D_{c,i} = diag(E[(U_c^T g_i)^2])``: the
  part of the Eigen-Adam FIM that a rank-``r`` basis ``U`` discards (paper Eq. "alice update
  decomposition"); ``U_c`` is the complement of the eigenbasis ``U``."""
  g = _stack(samples)
  _, m, n = g.shape
  full = _eig_desc(np.mean(g @ np.swapaxes(g, 1, 2), axis=0))
  r = u.shape[1]
  # the complement inside the eigenbasis that contains U
  uc = full[:, r:] if np.allclose(np.abs(full[:, :r].T @ u), np.eye(r), atol=1e-6) else \
      np.linalg.qr(np.concatenate([u, np.eye(m)], 1))[0][:, r:m]
  d = np.mean((uc.T @ g) ** 2, axis=0)
  return blockdiag([uc @ np.diag(d[:, i]) @ uc.T for i in range(n)])


def compensation_optimum(samples, u: Array) -> Array:
  """Thm. "Optimal compensation": ``diag(S) = sqrt(m - r) / sqrt(E[1^T G^2 - 1^T (U^T G)^2])``."""
  g = _stack(samples)
  m, r = u.shape
  stat = np.mean(np.sum(g ** 2, axis=1) - np.sum((u.T @ g) ** 2, axis=1), axis=0)
  return np.sqrt(m - r) / np.sqrt(stat)


def compensation_error(samples, u: Array, s: Array) -> float:
  """``||S^-2 (x) U_c U_c^T - F~_c||_F`` for a positive diagonal ``S = diag(s)``."""
  g = _stack(samples)
  m, r = u.shape
  proj = np.eye(m) - u @ u.T
  return float(np.linalg.norm(np.kron(np.diag(s ** -2.0), proj) - complement_fim(g, u)))
