"""Dense float64 numpy re-derivations of the paper's algorithms, one matrix at a time.

Written from the paper's listings (and the design decisions of docs/numerics.md), not from the library:
reconstructed states are built explicitly (``Q`` as an m x m matrix, the
compensation statistic as ``colsum(G^2) - colsum(sigma^2)``), so agreement with
the jitted float32 library checks the library's algebraic shortcuts too.

Conventions shared with the library by design decision (not shortcuts): steps
count from 1, refresh when (t - 1) % K == 0; eigen/singular vectors have their
largest-magnitude entry positive; tall matrices use the transpose.
"""

from __future__ import annotations

import math

import numpy as np


def canon(v):
  idx = np.argmax(np.abs(v), axis=0)
  s = np.sign(v[idx, np.arange(v.shape[1])])
  s[s == 0] = 1
  return v * s


def eig_desc(a):
  w, v = np.linalg.eigh(0.5 * (a + a.T))
  return w[::-1], canon(v[:, ::-1])


def limiter(norm, phi, gamma):
  eta = 1.0 if phi == 0 else gamma / max(norm / phi, gamma)
  return eta, eta * norm


def switch(Q, U, l, pick, t):
  """Alg. "Subspace switching" on an explicit ``Q`` from the old basis ``U`` (``m x r``):
  one subspace-iteration step, Rayleigh-Ritz, the top ``l`` Ritz vectors and ``r - l``
  columns of the complement's complete-QR basis drawn by ``pick(t, m - r, k)``."""
  m, r = U.shape
  U1, _ = np.linalg.qr(Q @ U)
  _, v = eig_desc(U1.T @ Q @ U1)
  ritz = U1 @ v
  kc = min(r - l, m - r)
  cols = [ritz[:, : r - kc]]
  if kc > 0:
    full, _ = np.linalg.qr(U1, mode="complete")
    cols.append(full[:, r:][:, pick(t, m - r, kc)])
  return canon(np.concatenate(cols, axis=1))


def subspace_iteration(C, U, r, iters, seed):
  """Warm-started subspace iteration with Rayleigh-Ritz on an explicit ``C = G G^T``
  (Golub and Van Loan, Sec. 8.2.4): ``iters`` steps ``U <- QR((C + delta I) U)``,
  ``delta = 1e-6 ||C U||_F``, then ``U <- U V`` with ``V`` the eigenvectors of
  ``U^T C U`` (descending, canonical signs). ``U=None`` (the first refresh): ``2 iters``
  steps from the orthonormalized Gaussian ``m x r`` matrix of
  ``numpy.random.default_rng(seed)`` (the library's fixed start)."""
  if U is None:
    U = np.linalg.qr(np.random.default_rng(seed).standard_normal((C.shape[0], r)))[0]
    iters = 2 * iters
  for _ in range(iters):
    Y = C @ U
    U, _ = np.linalg.qr(Y + 1e-6 * np.linalg.norm(Y) * U)
  _, v = eig_desc(U.T @ C @ U)
  return canon(U @ v)


def compensation(g, U, sigma, p, b1, d):
  """Paper Alg. "Compensation" (statistic as ``colsum(G^2) - colsum(sigma^2)``); a column
  whose residual is at float32 rounding level (``<= 1e-10`` of the column's squared norm)
  counts as 0 (library decision, ``fisher_optax.blocks.compensate``)."""
  resid = g - U @ sigma
  real = (resid ** 2).sum(0) > 1e-10 * (g ** 2).sum(0)
  p = b1 * p + (1 - b1) * np.where(real, (g ** 2).sum(0) - (sigma ** 2).sum(0), 0.0)
  safe = np.sqrt(np.maximum(p, 1e-300))
  return p, np.where(real[None, :], np.sqrt(d) * resid / safe[None, :], 0.0)


def two_sided_scaling(x, s_ema, q_ema, *, beta, iters, eps):
  """RACS's two-sided scaling of one matrix (paper Alg. "RACS"): ``iters`` fixed-point
  steps ``s = P^T q / ||q||^2``, ``q = P s / ||s||^2`` on ``P = X * X`` from ``q = 1``,
  EMAs of ``s`` and ``q`` with ``beta``, floors ``eps * max``, then
  ``X / sqrt(q) / sqrt(s)``. Returns the scaled matrix and the new EMAs."""
  p = x * x
  q = np.ones(x.shape[0])
  for _ in range(iters):
    s = p.T @ q / (q @ q)
    q = p @ s / (s @ s)
  s_ema = beta * s_ema + (1 - beta) * s
  q_ema = beta * q_ema + (1 - beta) * q
  ss = np.maximum(s_ema, eps * s_ema.max())
  qq = np.maximum(q_ema, eps * q_ema.max())
  return x / np.sqrt(qq)[:, None] / np.sqrt(ss)[None, :], s_ema, q_ema


class RacsRef:
  """Paper Alg. "RACS"."""

  def __init__(self, m, n, *, lr, beta=0.9, alpha=0.05, iters=5, gamma=1.01, eps=1e-8):
    self.s, self.q, self.phi = np.zeros(n), np.zeros(m), 0.0
    self.kw = dict(lr=lr, beta=beta, alpha=alpha, iters=iters, gamma=gamma, eps=eps)

  def step(self, g):
    k = self.kw
    g = np.asarray(g, np.float64)
    gt, self.s, self.q = two_sided_scaling(g, self.s, self.q, beta=k["beta"],
                                           iters=k["iters"], eps=k["eps"])
    eta, self.phi = limiter(np.linalg.norm(gt), self.phi, k["gamma"])
    return -k["lr"] * k["alpha"] * eta * gt


class _Transposing:
  """Applies a wide-matrix (m <= n) reference to the transpose of tall gradients."""

  def __init__(self, cls, m, n, **kw):
    self.t = m > n
    self.inner = cls(*(sorted((m, n))), **kw)

  def step(self, g, **kw):
    g = np.asarray(g, np.float64)
    if self.t:
      return self.inner.step(g.T, **kw).T
    return self.inner.step(g, **kw)


class AliceRef:
  """Paper Alg. "Alice" with Alg. "Subspace switching", "Subspace iteration", "Compensation".

  ``pick(t, num_complement, k)`` returns the sampled complement indices of the
  refresh at step ``t`` (the random draw is the library's; everything else is here).
  """

  def __init__(self, m, n, *, lr, rank, leading, interval, alpha=0.3, alpha_c=0.4, b1=0.9,
               b2=0.9, b3=0.999, gamma=1.01, eps=1e-8):
    assert m <= n
    self.r = min(rank, m)
    self.l = min(leading, self.r) if leading is not None else self.r
    self.m, self.n = m, n
    self.U = np.zeros((m, self.r))
    self.Qt = np.zeros((self.r, self.r))
    self.M = np.zeros((self.r, n))
    self.V = np.zeros((self.r, n))
    self.p = np.zeros(n)
    self.phi = 0.0
    self.t = 0
    self.kw = dict(lr=lr, interval=interval, alpha=alpha, alpha_c=alpha_c, b1=b1, b2=b2, b3=b3,
                   gamma=gamma, eps=eps)

  def _switch(self, Q, pick):
    return switch(Q, self.U, self.l, pick, self.t)

  def step(self, g, pick=None):
    k = self.kw
    self.t += 1
    t, r, m = self.t, self.r, self.m
    b1, b2, b3 = k["b1"], k["b2"], k["b3"]
    if (t - 1) % k["interval"] == 0:
      if t == 1:
        U = eig_desc(g @ g.T)[1][:, :r]
      else:
        Q = b3 * self.U @ self.Qt @ self.U.T + (1 - b3) * g @ g.T
        U = self._switch(Q, pick)
      self.Qt = U.T @ (self.U @ self.Qt @ self.U.T) @ U
      self.U = U
    U = self.U
    sigma = U.T @ g
    self.Qt = b3 * self.Qt + (1 - b3) * sigma @ sigma.T
    self.M = b1 * self.M + (1 - b1) * sigma
    self.V = b2 * self.V + (1 - b2) * sigma ** 2
    omega = self.M / (np.sqrt(self.V) + k["eps"])
    self.p, C = compensation(g, U, sigma, self.p, b1, m - r)
    eta, self.phi = limiter(np.linalg.norm(C), self.phi, k["gamma"])
    return -k["lr"] * k["alpha"] * (U @ omega + k["alpha_c"] * eta * C)


class AliceSoapRef:
  """:func:`fisher_optax.alice_soap` (docs/low_rank_soap.md), written out densely.

  Left side exactly as :class:`AliceRef` (``U``, ``Q~_L``, compensation ``C_L``); the
  core ``X = sigma^T`` (``n x r``) gets the same three steps on its rows: a tracked
  right basis ``V`` (``n x k``) refreshed with switching from the reconstructed
  ``Q_R = b3 V Q~_R V^T + (1 - b3) X X^T`` (an explicit ``n x n`` matrix here),
  Adam moments on ``tau = V^T X`` and the optimal compensation ``C_R`` of ``X - V tau``.
  ``pick`` / ``pick_right`` are the library's random complement draws.
  """

  def __init__(self, m, n, *, lr, rank, leading, interval, right_rank=None, alpha=0.3,
               alpha_c=0.4, b1=0.9, b2=0.9, b3=0.999, gamma=1.01, eps=1e-8):
    assert m <= n
    self.left = AliceRef(m, n, lr=lr, rank=rank, leading=leading, interval=interval,
                         b3=b3, gamma=gamma)
    r = self.left.r
    self.k = min(rank if right_rank is None else right_rank, n)
    self.l_right = min(leading, self.k)
    self.m, self.n, self.r = m, n, r
    self.V = np.zeros((n, self.k))
    self.Qr = np.zeros((self.k, self.k))
    self.M = np.zeros((self.k, r))
    self.N = np.zeros((self.k, r))
    self.p, self.q = np.zeros(n), np.zeros(r)
    self.phi_l, self.phi_r = 0.0, 0.0
    self.t = 0
    self.kw = dict(lr=lr, interval=interval, alpha=alpha, alpha_c=alpha_c, b1=b1, b2=b2, b3=b3,
                   gamma=gamma, eps=eps)

  def step(self, g, pick=None, pick_right=None):
    kw = self.kw
    self.t += 1
    t, m, n, r, k = self.t, self.m, self.n, self.r, self.k
    b1, b2, b3 = kw["b1"], kw["b2"], kw["b3"]
    left = self.left
    if (t - 1) % kw["interval"] == 0:  # left refresh (AliceRef's, reused)
      left.t = t
      if t == 1:
        U = eig_desc(g @ g.T)[1][:, :r]
      else:
        U = left._switch(b3 * left.U @ left.Qt @ left.U.T + (1 - b3) * g @ g.T, pick)
      left.Qt = U.T @ (left.U @ left.Qt @ left.U.T) @ U
      left.U = U
    U = left.U
    sigma = U.T @ g
    left.Qt = b3 * left.Qt + (1 - b3) * sigma @ sigma.T
    X = sigma.T                                   # n x r
    if (t - 1) % kw["interval"] == 0:
      if t == 1:
        V = eig_desc(X @ X.T)[1][:, :k]
      else:
        V = switch(b3 * self.V @ self.Qr @ self.V.T + (1 - b3) * X @ X.T, self.V,
                   self.l_right, pick_right, t)
      self.Qr = V.T @ (self.V @ self.Qr @ self.V.T) @ V
      self.V = V
    V = self.V
    tau = V.T @ X                                 # k x r
    self.Qr = b3 * self.Qr + (1 - b3) * tau @ tau.T
    self.M = b1 * self.M + (1 - b1) * tau
    self.N = b2 * self.N + (1 - b2) * tau ** 2
    omega = self.M / (np.sqrt(self.N) + kw["eps"])
    self.q, Cr = compensation(X, V, tau, self.q, b1, n - k)
    eta_r, self.phi_r = limiter(np.linalg.norm(Cr), self.phi_r, kw["gamma"])
    if t == 1:  # the first step sets up the bases: no core update (library decision)
      omega = np.zeros_like(omega)
    core = (V @ omega + kw["alpha_c"] * eta_r * Cr).T  # r x n
    self.p, Cl = compensation(g, U, sigma, self.p, b1, m - r)
    eta_l, self.phi_l = limiter(np.linalg.norm(Cl), self.phi_l, kw["gamma"])
    return -kw["lr"] * kw["alpha"] * (U @ core + kw["alpha_c"] * eta_l * Cl)


class GaloreRef:
  """GaLore release (paper App. Alg. "GaLore"); ``fira=True`` adds Fira's compensation."""

  def __init__(self, m, n, *, lr, rank, interval, scale=0.3, b1=0.9, b2=0.999, eps=1e-6,
               gamma=1.01, fira=False, refresh=None):
    assert m <= n
    # ``refresh``: the library's policy object; the release's SVD for ``svd_refresh()``,
    # else (the default, ``subspace_refresh``) warm-started subspace iteration
    self.svd = type(refresh).__name__ == "SvdRefresh"
    self.iters, self.seed = getattr(refresh, "iters", 2), getattr(refresh, "seed", 0)
    self.r = min(rank, m)
    self.U = None
    self.M = np.zeros((self.r, n))
    self.V = np.zeros((self.r, n))
    self.phi = 0.0
    self.t = 0
    self.fira = fira
    self.kw = dict(lr=lr, interval=interval, scale=scale, b1=b1, b2=b2, eps=eps, gamma=gamma)

  def step(self, g, pick=None):
    k = self.kw
    self.t += 1
    t = self.t
    if (t - 1) % k["interval"] == 0:
      if self.svd:
        u, _, _ = np.linalg.svd(g, full_matrices=False)
        self.U = canon(u[:, : self.r])
      else:
        self.U = subspace_iteration(g @ g.T, self.U, self.r, self.iters, self.seed)
    U = self.U
    sigma = U.T @ g
    self.M = k["b1"] * self.M + (1 - k["b1"]) * sigma
    self.V = k["b2"] * self.V + (1 - k["b2"]) * sigma ** 2
    omega = self.M / (np.sqrt(self.V) + k["eps"])
    step = k["lr"] * np.sqrt(1 - k["b2"] ** t) / (1 - k["b1"] ** t)
    upd = k["scale"] * U @ omega
    if self.fira:
      factor = np.linalg.norm(omega, axis=0) / (np.linalg.norm(sigma, axis=0) + 1e-8)
      S = (g - k["scale"] * U @ sigma) * factor[None, :]
      eta, self.phi = limiter(np.linalg.norm(S), self.phi, k["gamma"])
      upd = upd + eta * S
    return -step * upd


def make(name, m, n, **kw):
  """Reference for one matrix of shape (m, n) (either orientation)."""
  if name == "racs":
    return RacsRef(m, n, **kw)
  if name in ("alice", "alice0"):
    if name == "alice0":
      kw["b3"] = 0.0
    return _Transposing(AliceRef, m, n, **kw)
  if name in ("galore", "fira"):
    return _Transposing(GaloreRef, m, n, fira=(name == "fira"), **kw)
  if name == "alice_soap":
    return _Transposing(AliceSoapRef, m, n, **kw)
  raise ValueError(name)


class EigenAdamRef:
  """Paper App. Alg. "Alice-C/AdaDiag/one-side SOAP" (first moment in the original space)."""

  def __init__(self, m, n, *, lr, interval, b1=0.9, b2=0.9, b3=0.999, eps=1e-8,
               refresh="eigh"):
    assert m <= n
    self.Q, self.mom = np.zeros((m, m)), np.zeros((m, n))
    self.v, self.U, self.t = np.zeros((m, n)), None, 0
    self.kw = dict(lr=lr, interval=interval, b1=b1, b2=b2, b3=b3, eps=eps, refresh=refresh)

  def step(self, g, pick=None):
    k = self.kw
    self.t += 1
    self.Q = k["b3"] * self.Q + (1 - k["b3"]) * g @ g.T
    self.mom = k["b1"] * self.mom + (1 - k["b1"]) * g
    if (self.t - 1) % k["interval"] == 0:
      if self.U is None or k["refresh"] == "eigh":
        self.U = eig_desc(self.Q)[1]
      else:  # SOAP's refresh: sort by the Rayleigh quotients, one power step, V follows
        idx = np.argsort(-np.diag(self.U.T @ self.Q @ self.U), kind="stable")
        self.v = self.v[idx]
        self.U = np.linalg.qr(self.Q @ self.U[:, idx])[0]
    mt = self.U.T @ self.mom
    self.v = k["b2"] * self.v + (1 - k["b2"]) * (self.U.T @ g) ** 2
    return -k["lr"] * self.U @ (mt / (np.sqrt(self.v) + k["eps"]))


class SoapRef:
  """The SOAP authors' reference optimizer (step order of its ``step`` and
  ``update_preconditioner``), 2-D case, no weight decay, no merging."""

  def __init__(self, m, n, *, lr, b1=0.95, b2=0.95, shampoo_beta=None, eps=1e-8,
               precondition_frequency=10, max_precond_dim=10000):
    self.sb = b2 if shampoo_beta is None else shampoo_beta
    self.GG = [np.zeros((m, m)) if m <= max_precond_dim else None,
               np.zeros((n, n)) if n <= max_precond_dim else None]
    self.Q = None
    self.exp_avg, self.exp_avg_sq = np.zeros((m, n)), np.zeros((m, n))
    self.step_n = 0
    self.kw = dict(lr=lr, b1=b1, b2=b2, eps=eps, freq=precondition_frequency)

  def project(self, x):
    if self.Q[0] is not None:
      x = self.Q[0].T @ x
    if self.Q[1] is not None:
      x = x @ self.Q[1]
    return x

  def project_back(self, x):
    if self.Q[0] is not None:
      x = self.Q[0] @ x
    if self.Q[1] is not None:
      x = x @ self.Q[1].T
    return x

  def update_preconditioner(self, g):
    if self.Q is not None:
      self.exp_avg = self.project_back(self.exp_avg)
    outer = [g @ g.T, g.T @ g]
    for i in range(2):
      if self.GG[i] is not None:
        self.GG[i] = self.sb * self.GG[i] + (1 - self.sb) * outer[i]
    if self.Q is None:
      self.Q = [None if G is None else eig_desc(G)[1] for G in self.GG]
    if self.step_n > 0 and self.step_n % self.kw["freq"] == 0:
      new = []
      for i, (G, O) in enumerate(zip(self.GG, self.Q)):
        if G is None:
          new.append(None)
          continue
        est = np.diag(O.T @ G @ O)
        idx = np.argsort(-est, kind="stable")
        self.exp_avg_sq = np.take(self.exp_avg_sq, idx, axis=i)
        q, _ = np.linalg.qr(G @ O[:, idx])
        new.append(q)
      self.Q = new
    if self.step_n > 0:
      self.exp_avg = self.project(self.exp_avg)

  def step(self, g, pick=None):
    k = self.kw
    if self.Q is None:
      self.update_preconditioner(g)
      return np.zeros_like(g)
    gp = self.project(g)
    self.step_n += 1
    self.exp_avg = k["b1"] * self.exp_avg + (1 - k["b1"]) * gp
    self.exp_avg_sq = k["b2"] * self.exp_avg_sq + (1 - k["b2"]) * gp ** 2
    denom = np.sqrt(self.exp_avg_sq) + k["eps"]
    step_size = k["lr"] * np.sqrt(1 - k["b2"] ** self.step_n) / (1 - k["b1"] ** self.step_n)
    upd = -step_size * self.project_back(self.exp_avg / denom)
    self.update_preconditioner(g)
    return upd


def mpow(a, p):
  w, v = np.linalg.eigh(0.5 * (a + a.T))
  return (v * w ** p) @ v.T


class ShampooRef:
  """Paper App. Alg. "Shampoo" with inverse roots recomputed every ``interval`` steps."""

  def __init__(self, m, n, *, lr, eps=1e-6, interval=10, refresh="eigh"):
    self.L, self.R = eps * np.eye(m), eps * np.eye(n)
    self.t, self.U = 0, None
    self.kw = dict(lr=lr, interval=interval, refresh=refresh)

  def step(self, g, pick=None):
    self.t += 1
    self.L = self.L + g @ g.T
    self.R = self.R + g.T @ g
    if (self.t - 1) % self.kw["interval"] == 0:
      if self.U is None or self.kw["refresh"] == "eigh":
        self.Lr, self.Rr = mpow(self.L, -0.25), mpow(self.R, -0.25)
        self.U = [eig_desc(self.L)[1], eig_desc(self.R)[1]]
      else:  # one power step on the sorted old basis; Rayleigh quotients as eigenvalues
        self.U = [np.linalg.qr(a @ u[:, np.argsort(-np.diag(u.T @ a @ u), kind="stable")])[0]
                  for a, u in zip((self.L, self.R), self.U)]
        self.Lr, self.Rr = [(u * np.diag(u.T @ a @ u) ** -0.25) @ u.T
                            for a, u in zip((self.L, self.R), self.U)]
    return -self.kw["lr"] * self.Lr @ g @ self.Rr


class NorMuonRef:
  """NorMuon (arXiv:2510.05491, Alg. 1) with the library's momentum (optax.contrib's
  bias-corrected Nesterov form) and Muon's quintic Newton--Schulz on the smaller side:
  per fan-out unit (column) an EMA of the mean square over fan-in, then RMS 0.2 * lr."""

  COEFFS = (3.4445, -4.7750, 2.0315)

  def __init__(self, m, n, *, lr, beta=0.95, b2=0.95, steps=5, rms=0.2, eps=1e-8,
               weight_decay=None):
    self.M, self.v, self.t = np.zeros((m, n)), np.zeros(n), 0
    self.kw = dict(lr=lr, beta=beta, b2=b2, steps=steps, rms=rms, eps=eps)

  def ns(self, x):
    k = self.kw
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    c = np.max(np.abs(x))
    x = x / (c if c > 0 else 1.0)
    x = x / (np.linalg.norm(x) + k["eps"])
    a, b, cc = self.COEFFS
    for _ in range(k["steps"]):
      s = x @ x.T
      x = a * x + (b * s + cc * s @ s) @ x
    return x.T if tall else x

  def step(self, g, pick=None):
    k = self.kw
    self.t += 1
    beta = k["beta"]
    self.M = beta * self.M + (1 - beta) * g
    x = (beta * self.M / (1 - beta ** (self.t + 1)) + (1 - beta) * g / (1 - beta ** self.t))
    o = self.ns(x)
    self.v = k["b2"] * self.v + (1 - k["b2"]) * np.mean(o ** 2, axis=0)
    o = o / (np.sqrt(self.v) + k["eps"])[None, :]
    o = k["rms"] * np.sqrt(o.size) * o / np.linalg.norm(o)
    return -k["lr"] * o


class WhiteningCompositionRef(NorMuonRef):
  """RACS's two-sided scaling (paper Alg. "RACS" l.5-8: EMA ``beta`` of the fixed point
  of ``X * X``, floors ``eps * max``) composed with Muon's whitening, on the momentum
  before whitening (``order="before"``) or on the whitened update after it
  (``"after"``); then RMS ``0.2 * lr``. The momentum and Newton--Schulz are
  :class:`NorMuonRef`'s."""

  def __init__(self, m, n, *, lr, order, beta=0.95, scale_beta=0.9, iters=5, eps=1e-8,
               rms=0.2):
    super().__init__(m, n, lr=lr, beta=beta, rms=rms)
    self.s, self.q = np.zeros(n), np.zeros(m)
    self.order, self.scale_kw = order, dict(beta=scale_beta, iters=iters, eps=eps)

  def two_sided(self, x):
    out, self.s, self.q = two_sided_scaling(x, self.s, self.q, **self.scale_kw)
    return out

  def step(self, g, pick=None):
    k = self.kw
    self.t += 1
    beta = k["beta"]
    self.M = beta * self.M + (1 - beta) * g
    x = (beta * self.M / (1 - beta ** (self.t + 1)) + (1 - beta) * g / (1 - beta ** self.t))
    o = self.ns(self.two_sided(x)) if self.order == "before" else self.two_sided(self.ns(x))
    return -k["lr"] * k["rms"] * np.sqrt(o.size) * o / np.linalg.norm(o)


_make_base = make


def make(name, m, n, **kw):  # noqa: F811  (extends the low-rank references above)
  if name == "eigen_adam":
    return _Transposing(EigenAdamRef, m, n, **kw)
  if name == "soap":
    return SoapRef(m, n, **kw)
  if name == "shampoo":
    return ShampooRef(m, n, **kw)
  if name == "normuon":
    return NorMuonRef(m, n, **kw)
  return _make_base(name, m, n, **kw)


class ApolloRef:
  """APOLLO release (``apollo_torch/apollo.py``): Adam on ``U^T G``, channel/tensor norm
  ratio applied to the raw gradient, limiter, ``sqrt(scale)``, step-size bias correction.
  ``basis(t)`` gives the Gaussian projection of step ``t`` (the library's seeded draw)."""

  def __init__(self, m, n, *, lr, rank, kind, scale, basis, b1=0.9, b2=0.999, eps=1e-6,
               gamma=1.01):
    assert m <= n
    r = min(rank, m)
    self.M, self.V = np.zeros((r, n)), np.zeros((r, n))
    self.phi, self.t, self.basis = 0.0, 0, basis
    self.kw = dict(lr=lr, kind=kind, scale=scale, b1=b1, b2=b2, eps=eps, gamma=gamma)

  def step(self, g, pick=None):
    k = self.kw
    self.t += 1
    U = np.asarray(self.basis(self.t), np.float64)
    sigma = U.T @ g
    self.M = k["b1"] * self.M + (1 - k["b1"]) * sigma
    self.V = k["b2"] * self.V + (1 - k["b2"]) * sigma ** 2
    ng = self.M / (np.sqrt(self.V) + k["eps"])
    if k["kind"] == "channel":
      s = np.linalg.norm(ng, axis=0) / (np.linalg.norm(sigma, axis=0) + 1e-8)
    else:
      s = np.linalg.norm(ng) / (np.linalg.norm(sigma) + 1e-8)
    scaled = g * s
    eta, self.phi = limiter(np.linalg.norm(scaled), self.phi, k["gamma"])
    step = k["lr"] * np.sqrt(1 - k["b2"] ** self.t) / (1 - k["b1"] ** self.t)
    return -step * np.sqrt(k["scale"]) * eta * scaled


class DionRef:
  """Dion (arXiv:2504.05295, Alg. 1) as the authors' single-device reference
  (``microsoft/dion``, ``dion/dion_reference.py``: ``Dion._init_opt_state_dion``,
  ``dion_update``, ``power_iteration`` with one iteration, ``orthogonalize`` with
  ``qr_method="qr"``, ``fix_all_zero_or_nan``), transcribed in float64 numpy.

  The reference holds ``X`` as PyTorch does, ``(d_out, d_in)``; ``step`` takes and
  returns the library's layout, a Flax kernel ``(d_in, d_out)`` (``X`` transposed).
  ``q0``: the initial ``Q`` (the reference's ``torch.randn``), on the smaller side as
  the reference keeps it."""

  def __init__(self, d_in, d_out, *, lr, rank, q0, mu=0.95, eps=1e-8, weight_decay=0.0):
    m, n = d_out, d_in                      # X.shape
    self.transpose = m < n                  # the reference's is_transposed
    if isinstance(rank, float):             # rank_fraction, rank_multiple_of = 1
      r = min(math.ceil(rank * min(m, n)), m, n)
    else:
      r = min(rank, m, n)
    self.Q = np.array(q0, np.float64)
    assert self.Q.shape == ((m, r) if self.transpose else (n, r)), (self.Q.shape, m, n, r)
    self.M = np.zeros((m, n))
    self.kw = dict(lr=lr, mu=mu, eps=eps, weight_decay=weight_decay)

  def step(self, g, x=None):
    k = self.kw
    G = np.asarray(g, np.float64).T         # library layout -> (d_out, d_in)
    self.M = self.M + G
    B = self.M.T if self.transpose else self.M
    P = B @ self.Q
    P, _ = np.linalg.qr(P)                  # orthogonalize(qr_method="qr")
    R = B.T @ P
    if np.all(B == 0):                      # fix_all_zero_or_nan
      P, R = np.zeros_like(P), self.Q
    self.M = self.M - (1 - k["mu"]) * (R @ P.T if self.transpose else P @ R.T)
    self.Q = R / (np.linalg.norm(R, axis=0, keepdims=True) + k["eps"])
    fan_out, fan_in = self.M.shape
    scaled_lr = np.sqrt(fan_out / fan_in) * k["lr"]
    upd = self.Q @ P.T if self.transpose else P @ self.Q.T
    out = -scaled_lr * upd
    if x is not None:                       # X <- X (1 - lr wd) first
      out = out - k["lr"] * k["weight_decay"] * np.asarray(x, np.float64).T
    return out.T
