"""Dion (arXiv:2504.05295): the power-tracking block and ``fo.dion`` against a float64
transcription of the authors' reference (``tests/reference.py``: ``DionRef``), its
edge cases and its algebra."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo
from fisher_optax import linalg
from tests import reference
from tests.registry import LR, STACK
from tests.util import structured_grads


def _bases(state):
  """The ``basis`` tree of the ``PowerTrackState`` inside a named optimizer's state."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fo.PowerTrackState))
           if isinstance(s, fo.PowerTrackState)]
  assert len(found) == 1
  return found[0].basis


def _run(shape, grads, *, params=None, **kw):
  """The library's updates (float64 copies) and the reference's, over ``grads`` for one
  leaf ``w`` of ``shape`` (a stack: one reference per matrix, each from the library's
  initial ``Q`` of that matrix)."""
  params = {"w": jnp.zeros(shape, jnp.float32) if params is None else params}
  tx = fo.dion(LR, dims=STACK, **kw)
  state = tx.init(params)
  q0 = np.asarray(_bases(state)["w"], np.float64)
  *batch, d_in, d_out = shape
  nb = int(np.prod(batch)) if batch else 1
  q0 = q0.reshape((nb,) + q0.shape[-2:])
  ref_kw = {k: v for k, v in kw.items() if k in ("rank", "mu", "eps", "weight_decay")}
  refs = [reference.DionRef(d_in, d_out, lr=LR, q0=q0[b], **ref_kw) for b in range(nb)]
  update = jax.jit(tx.update)
  x = np.asarray(params["w"], np.float64).reshape((nb, d_in, d_out))
  lib, ref = [], []
  for g in grads:
    u, state = update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    lib.append(np.asarray(u["w"], np.float64))
    g = np.asarray(np.asarray(g, np.float32), np.float64).reshape((nb, d_in, d_out))
    ref.append(np.stack([r.step(g[b], x[b]) for b, r in enumerate(refs)]).reshape(shape))
  return lib, ref


def _check(lib, ref, tol=1e-4):
  for t, (a, b) in enumerate(zip(lib, ref), start=1):
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < tol, f"step {t}: relative error {err:.2e}"


@pytest.mark.parametrize("rank", [pytest.param(0.5, marks=pytest.mark.slow), 2, 100],
                         ids=["half", "r2", "full"])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8), (3, 6, 10)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_the_reference_over_12_steps(shape, rank):
  """Wide, tall (the reference transposes it), square and a stack; a fraction of
  ``min(m, n)``, an integer rank and one above ``min(m, n)`` (full rank)."""
  lib, ref = _run(shape, structured_grads(shape, 12, seed=2), rank=rank)
  _check(lib, ref)


def test_matches_the_reference_on_a_larger_matrix_with_weight_decay():
  """64 x 96 at rank 1/4 (16), mu 0.9, decoupled weight decay on non-zero weights."""
  shape = (64, 96)
  w = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 0.1, jnp.float32)
  lib, ref = _run(shape, structured_grads(shape, 12, seed=4), params=w, rank=0.25, mu=0.9,
                  weight_decay=0.1)
  _check(lib, ref)


def test_zero_gradients_keep_q_and_give_no_update_as_the_reference():
  """Zero gradients first (the reference's ``fix_all_zero_or_nan``: ``P = 0``, ``Q``
  kept with unit columns), then ordinary ones: equal to the reference throughout."""
  shape = (6, 10)
  grads = [np.zeros(shape)] * 2 + structured_grads(shape, 5, seed=5)
  lib, ref = _run(shape, grads, rank=3)
  for a in lib[:2]:
    assert np.all(a == 0)
  _check(lib[2:], ref[2:])


@pytest.mark.parametrize("qr", ["backend", "cholesky"])
def test_a_momentum_of_rank_below_r(qr, monkeypatch):
  """Rank-1 gradients at rank 3: ``B^T Q`` has rank 1. Its other QR columns are whatever
  the QR makes of rounding (the reference's too: ``Q``'s unit-column normalization then
  lifts them to unit size, as orthonormalization does with every direction), so only
  the gradient's own direction is compared with the reference; the update stays finite
  with at most ``r`` unit components. ``cholesky``: the accelerators' QR, which fails on
  the rank-deficient operand and takes the shifted factor."""
  if qr == "cholesky":
    monkeypatch.setattr(linalg, "positive_qr", linalg.cholesky_qr)
    jax.clear_caches()
  shape = (6, 10)
  rng = np.random.default_rng(6)
  u, v = rng.standard_normal(6), rng.standard_normal(10)
  grads = [np.outer(u, v) * (1 + 0.1 * t) for t in range(6)]
  lib, ref = _run(shape, grads, rank=3)
  u, v = u / np.linalg.norm(u), v / np.linalg.norm(v)
  bound = LR * np.sqrt(10 / 6) * np.sqrt(3) * 1.01
  for a, b in zip(lib, ref):
    assert np.all(np.isfinite(a)) and np.linalg.norm(a) < bound
    np.testing.assert_allclose(u @ a @ v, u @ b @ v, rtol=1e-3)
  jax.clear_caches()


def test_the_accelerator_qr_matches_the_reference(monkeypatch):
  """The batched Cholesky QR that accelerators run, forced here: the same updates."""
  monkeypatch.setattr(linalg, "positive_qr", linalg.cholesky_qr)
  jax.clear_caches()
  for shape, rank in [((6, 10), 3), ((10, 6), 0.5), ((3, 6, 10), 2)]:
    lib, ref = _run(shape, structured_grads(shape, 12, seed=2), rank=rank)
    _check(lib, ref)
  jax.clear_caches()


def test_full_rank_error_feedback_is_plain_momentum():
  """At ``r = min(m, n)`` the factor takes all of ``B`` (``P P^T B^T = B^T``), so error
  feedback keeps ``M = mu B = mu (M + G)``; the update is ``Q P^T`` with ``Q`` the
  unit-column ``B P``: its columns span ``B``'s column space and it has rank ``m``."""
  params = {"w": jnp.zeros((5, 9))}
  tx = fo.power_track(rank=5, mu=0.8)
  state = tx.init(params)
  m = np.zeros((5, 9))
  for g in structured_grads((5, 9), 4, seed=7):
    u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state)
    m = 0.8 * (m + g)
    np.testing.assert_allclose(np.asarray(state.momentum["w"]), m, rtol=1e-4, atol=1e-5)
    assert np.linalg.matrix_rank(np.asarray(u["w"], np.float64), tol=1e-4) == 5


def test_error_feedback_keeps_what_the_factor_does_not_take():
  """``M_new = B - (1 - mu) R P^T`` with ``P`` orthonormal and ``R = B P``: the part of
  ``B`` outside ``span(P)`` stays whole, the part inside decays by ``mu``; the update
  has rank ``r`` and unit-norm columns of ``Q`` (the state)."""
  shape, r, mu = (6, 12), 2, 0.9
  tx = fo.power_track(rank=r, mu=mu)
  state = tx.init({"w": jnp.zeros(shape)})
  g = structured_grads(shape, 1, seed=8)[0]
  u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state)
  q = np.asarray(state.basis["w"], np.float64)
  u = np.asarray(u["w"], np.float64)
  p = u.T @ np.linalg.pinv(q.T)                         # u = Q P^T
  np.testing.assert_allclose(p.T @ p, np.eye(r), atol=1e-4)
  np.testing.assert_allclose(np.linalg.norm(q, axis=0), 1.0, rtol=1e-5)
  m_new = np.asarray(state.momentum["w"], np.float64)
  inside = g @ p @ p.T
  np.testing.assert_allclose(m_new, g - (1 - mu) * inside, atol=1e-4)
  assert np.linalg.matrix_rank(u, tol=1e-5) == r


@pytest.mark.parametrize("rank, why", [(0, "integer"), (-1, "integer"), (1.5, "fraction"),
                                       (0.0, "fraction"), (True, "integer")])
def test_bad_ranks_name_the_fix(rank, why):
  with pytest.raises(ValueError, match=why):
    fo.dion(LR, rank=rank)


def test_rank_as_a_fraction_rounds_up_and_an_integer_clips():
  params = {"a": jnp.zeros((12, 40)), "b": jnp.zeros((40, 7)), "c": jnp.zeros((3, 3))}
  for rank, want in [(0.25, {"a": 3, "b": 2, "c": 1}), (5, {"a": 5, "b": 5, "c": 3}),
                     (1.0, {"a": 12, "b": 7, "c": 3})]:
    bases = _bases(fo.dion(LR, rank=rank, mask=lambda p: jax.tree.map(lambda _: True, p))
                   .init(params))
    assert {k: v.shape for k, v in bases.items()} == {
        "a": (12, want["a"]), "b": (7, want["b"]), "c": (3, want["c"])}


def test_state_is_momentum_plus_the_smaller_side_basis():
  """``mn + min(m, n) r`` per matrix (``fo.paper_state_numbers``), in the parameters'
  layout for the momentum, float32 for bfloat16 parameters."""
  params = {"w": jnp.zeros((16, 48), jnp.bfloat16)}
  state = fo.dion(LR, rank=4).init(params)
  structured = [x for x in jax.tree.leaves(state) if x.ndim == 2]
  assert sum(x.size for x in structured) == fo.paper_state_numbers("dion", 16, 48, 4)[0]
  assert all(x.dtype == jnp.float32 for x in structured)


def test_the_initial_q_follows_the_documented_key():
  """Matrix ``j`` of the tree draws ``Q ~ N(0, 1)`` from ``fold_in(fold_in(PRNGKey(seed),
  0), j)``: what a run reproducing a reference run copies into the reference's state."""
  params = {"a": jnp.zeros((6, 10)), "b": jnp.zeros((2, 4, 5))}
  bases = _bases(fo.dion(LR, rank=2, seed=3, dims=STACK, stack_matrices=False).init(params))
  key = jax.random.fold_in(jax.random.PRNGKey(3), 0)
  want = [jax.random.normal(jax.random.fold_in(key, j), (m, 2)) for j, m in
          [(0, 6), (1, 4), (2, 4)]]
  np.testing.assert_array_equal(np.asarray(bases["a"]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(bases["b"]), np.stack(want[1:]))


def test_inject_hyperparams_with_a_scheduled_learning_rate_and_traced_mu():
  params = {"w": jnp.zeros((6, 10))}
  grads = structured_grads((6, 10), 3, seed=9)
  tx = fo.inject_hyperparams(fo.dion)(learning_rate=optax.linear_schedule(0.01, 0.0, 3),
                                      rank=0.5, mu=0.9)
  plain = fo.dion(optax.linear_schedule(0.01, 0.0, 3), rank=0.5, mu=0.9)
  s1, s2 = tx.init(params), plain.init(params)
  for g in grads:
    u1, s1 = jax.jit(tx.update)({"w": jnp.asarray(g, jnp.float32)}, s1, params)
    u2, s2 = jax.jit(plain.update)({"w": jnp.asarray(g, jnp.float32)}, s2, params)
    np.testing.assert_allclose(np.asarray(u1["w"]), np.asarray(u2["w"]), rtol=1e-5,
                               atol=1e-9)
