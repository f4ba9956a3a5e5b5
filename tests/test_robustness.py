"""Bad inputs, numerics and clear errors across every optimizer (issue: robustness)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fisher_optax as fo
from tests import registry

ALL = registry.NAMES
SHAPES = {"w": (6, 10), "t": (10, 6), "st": (2, 5, 7), "sq": (3, 3), "row": (1, 8),
          "col": (8, 1), "v": (5,), "s": ()}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# float16 takes the same low-precision path as bfloat16 (cast to float32 and back): it
# runs with ``-m slow``
DTYPE_PARAMS = [jnp.float32, jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)]


def _kw(name, rank=5):
  """The registry's settings with ``rank`` above min(m, n) of the 3 x 3 and 1 x n leaves."""
  return registry.kwargs(name, rank=rank)


def _grads(kind, dtype, t, shapes=SHAPES):
  out = {}
  for i, (k, s) in enumerate(shapes.items()):
    rng = np.random.default_rng(t * 10 + i)
    g = rng.standard_normal(s)
    if kind == "zero":
      g = g * 0
    elif kind == "tiny":
      g = g * 1e-30
    elif kind == "huge":
      g = g * min(1e18, float(jnp.finfo(dtype).max) / 100)
    elif kind == "sparse":
      g = g * (rng.random(s) < 0.1)
    out[k] = jnp.asarray(g, dtype)
  return out


def _finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating))


@pytest.mark.parametrize("dtype", DTYPE_PARAMS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", registry.params(default=["galore"]))
def test_finite_updates_and_state_for_extreme_gradients(name, dtype):
  """zero, tiny (1e-30), huge (1e18; float16: its max / 100) and sparse gradients, over
  1 x n, n x 1, 3 x 3 with rank 5 > 3, stacks, vectors and scalars."""
  tx = getattr(fo, name)(0.01, **_kw(name))
  params = {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}
  update = jax.jit(tx.update)
  for kind in ("zero", "tiny", "huge", "sparse"):
    state = tx.init(params)
    for t in range(3):  # refresh at steps 1 and 3
      u, state = update(_grads(kind, dtype, t), state, params)
      assert _finite(u), (kind, t)
      assert all(x.dtype == dtype for x in jax.tree.leaves(u))
    assert _finite(state), kind
  zero_u, _ = update(_grads("zero", dtype, 0), tx.init(params), params)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(zero_u))


@pytest.mark.parametrize("name", registry.params(ALL, default=["racs", "alice", "galore"]))
def test_degenerate_shapes_on_the_structured_path(name):
  """1 x n, n x 1 and 3 x 3 (rank 5) forced onto the structured rule by ``mask``. Under a
  constant gradient ``G`` every optimizer here preconditions (a momentum of) ``G`` with a
  positive semi-definite operator, orthogonalises it or projects it: by the third step
  each leaf's update is a descent direction, ``<U, G> < 0``."""
  shapes = {"row": (1, 8), "col": (8, 1), "sq": (3, 3), "st": (2, 1, 4)}
  tx = getattr(fo, name)(0.01, **_kw(name), mask=lambda p: jax.tree.map(lambda _: True, p))
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  g = _grads("normal", jnp.float32, 0, shapes)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3):
    u, state = update(g, state, params)
  assert _finite(state)
  for k in shapes:
    assert float(jnp.vdot(u[k], g[k])) < 0, (k, u[k])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("stack", [False, True])
def test_a_tree_without_matrices_goes_to_the_fallback(name, stack):
  """Only vectors and scalars: every leaf takes the fallback (Adam); the structured rule,
  refreshes and random draws included, runs on nothing and must not fail."""
  params = {"b": jnp.zeros((5,)), "s": jnp.zeros(())}
  tx = getattr(fo, name)(0.01, **_kw(name), stack_matrices=stack)
  ref = optax.adam(0.01)
  state, ref_state = tx.init(params), ref.init(params)
  for t in range(3):
    g = {"b": jnp.full((5,), 0.1 * (t + 1)), "s": jnp.asarray(-0.2)}
    u, state = jax.jit(tx.update)(g, state, params)
    want, ref_state = ref.update(g, ref_state, params)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("name", registry.params(default=["racs", "galore"]))
def test_nan_gradients_visible_unwrapped_and_skipped_with_apply_if_finite(name):
  shapes = {"w": (6, 10), "v": (5,)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  good = [_grads("normal", jnp.float32, t, shapes) for t in range(4)]
  bad = dict(good[1], w=good[1]["w"].at[2, 3].set(jnp.nan))
  # unwrapped: the bad step shows up as non-finite updates (never silently finite)
  tx = getattr(fo, name)(0.01, **_kw(name))
  update = jax.jit(tx.update)
  s = tx.init(params)
  _, s = update(good[0], s, params)
  u, _ = update(bad, s, params)
  assert not bool(jnp.all(jnp.isfinite(u["w"])))
  # wrapped: skipped, state untouched, training continues finite
  tx = optax.apply_if_finite(getattr(fo, name)(0.01, **_kw(name)), max_consecutive_errors=5)
  update = jax.jit(tx.update)
  s = tx.init(params)
  _, s = update(good[0], s, params)
  u, s_bad = update(bad, s, params)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
  for a, b in zip(jax.tree.leaves(s_bad.inner_state), jax.tree.leaves(s.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for g in good[2:]:
    u, s_bad = update(g, s_bad, params)
    assert _finite(u) and _finite(s_bad.inner_state)


def test_failed_decomposition_keeps_previous_basis(monkeypatch):
  """eigh returning NaN at a refresh: rotate and low_rank_track keep their bases (and
  Shampoo its eigenvalues, so the update stays finite)."""
  from fisher_optax import linalg
  params = {"w": jnp.zeros((6, 10))}
  g = _grads("normal", jnp.float32, 0, {"w": (6, 10)})
  rotate_left = lambda s: optax.tree_utils.tree_get(s, "RotateState").left  # noqa: E731
  # per-leaf layout: the state read by leaf name
  for tx, field in [(fo.eigen_adam(0.01, interval=1, stack_matrices=False),
                     lambda s: rotate_left(s).basis),
                    (fo.shampoo(0.01, interval=1, stack_matrices=False),
                     lambda s: rotate_left(s).eig),
                    (fo.alice0(0.01, rank=3, leading=1, interval=1, stack_matrices=False),
                     lambda s: optax.tree_utils.tree_get(s, "basis"))]:
    s = tx.init(params)
    _, s = tx.update(g, s, params)
    before = np.asarray(field(s)["w"])
    real = linalg.eigh_desc
    monkeypatch.setattr(linalg, "eigh_desc",
                        lambda a, **kw: tuple(x * jnp.nan for x in real(a, **kw)))
    u2, s2 = tx.update(g, s, params)
    monkeypatch.undo()
    np.testing.assert_array_equal(np.asarray(field(s2)["w"]), before)
    assert _finite(u2)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(ALL), m=st.integers(1, 9), n=st.integers(1, 9),
       stack=st.sampled_from([(), (2,)]), dtype=st.sampled_from(DTYPES),
       log_scale=st.integers(-20, 15), seed=st.integers(0, 2 ** 16))
def test_property_finite_dtype_and_deterministic(name, m, n, stack, dtype, log_scale, seed):
  scale = min(10.0 ** log_scale, float(jnp.finfo(dtype).max) / 1e3)
  shape = stack + (m, n)
  params = {"w": jnp.zeros(shape, dtype), "b": jnp.zeros((n,), dtype)}
  mask = {"w": True, "b": False}
  rng = np.random.default_rng(seed)
  grads = [{k: jnp.asarray(rng.standard_normal(p.shape) * scale, dtype)
            for k, p in params.items()} for _ in range(3)]

  def run():  # a fresh transformation and jit each time: two independent builds
    tx = getattr(fo, name)(0.01, **_kw(name, rank=3), mask=mask)
    s = tx.init(params)
    update = jax.jit(tx.update)
    outs = []
    for g in grads:
      u, s = update(g, s, params)
      outs.append(u)
    return outs, s

  a, sa = run()
  b, _ = run()
  for ua, ub in zip(a, b):
    for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub)):
      assert x.dtype == dtype
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
      assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
  assert _finite(sa)


def _quadratic(seed=0, m=8, n=12, cond=1e3):
  rng = np.random.default_rng(seed)
  def spd(d):
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.logspace(0, np.log10(cond) / 2, d)) @ q.T
  a, b = spd(m), spd(n)
  w_star = rng.standard_normal((m, n))
  return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.asarray(w_star, jnp.float32)


@pytest.mark.parametrize("name,kw", [("racs", dict(alpha=0.5)),
                                     ("alice", dict(rank=4, leading=2, interval=50))])
def test_10k_steps_on_ill_conditioned_quadratic(name, kw):
  """f(W) = 1/2 <W - W*, A (W - W*) B> with cond(A (x) B) = 1e3: 10,000 jitted steps stay
  finite and converge."""
  a, b, w_star = _quadratic()
  loss = lambda w: 0.5 * jnp.sum((w - w_star) * (a @ (w - w_star) @ b))
  steps = 10_000
  sched = optax.cosine_decay_schedule(0.02, steps, alpha=0.001)
  tx = getattr(fo, name)(sched, **kw)
  w0 = {"w": jnp.zeros_like(w_star)}

  @jax.jit
  def train(w):
    def body(carry, _):
      w, s = carry
      g = jax.grad(lambda p: loss(p["w"]))(w)
      u, s = tx.update(g, s, w)
      return (optax.apply_updates(w, u), s), loss(w["w"])
    (w, s), losses = jax.lax.scan(body, (w, tx.init(w)), None, length=steps)
    return w, s, losses

  w, s, losses = train(w0)
  losses = np.asarray(losses)
  assert np.isfinite(losses).all() and _finite(s) and _finite(w)
  assert losses[-1] < 1e-3 * losses[0], (losses[0], losses[-1])


@pytest.mark.parametrize("name,dtype", [
    pytest.param(n, d, id=f"{n}-{jnp.dtype(d).name}",
                 marks=() if (n, d) == ("eigen_adam", jnp.float32) else pytest.mark.slow)
    for n in ("eigen_adam", "shampoo") for d in (jnp.float32, jnp.bfloat16)])
def test_power_qr_refresh_with_extreme_gradients_and_degenerate_shapes(name, dtype):
  """``refresh="power_qr"``: the extreme gradients above over 5 steps (refreshes at 1 by
  eigh, at 3 and 5 by the power step) keep updates and state finite, in the leaves'
  dtype; a zero gradient gives a zero update; on 1 x n, n x 1, 3 x 3 and stacks forced
  onto the structured rule the third update is a descent direction."""
  kw = dict(_kw(name), refresh="power_qr")
  tx = getattr(fo, name)(0.01, **kw)
  params = {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}
  update = jax.jit(tx.update)
  for kind in ("zero", "tiny", "huge", "sparse"):
    state = tx.init(params)
    for t in range(5):
      u, state = update(_grads(kind, dtype, t), state, params)
      assert _finite(u), (kind, t)
      assert all(x.dtype == dtype for x in jax.tree.leaves(u))
      if kind == "zero":
        assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
    assert _finite(state), kind
  shapes = {"row": (1, 8), "col": (8, 1), "sq": (3, 3), "st": (2, 1, 4)}
  tx = getattr(fo, name)(0.01, **kw, mask=lambda p: jax.tree.map(lambda _: True, p))
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  g = _grads("normal", jnp.float32, 0, shapes)
  state, update = tx.init(params), jax.jit(tx.update)
  for _ in range(3):
    u, state = update(g, state, params)
  assert _finite(state)
  for k in shapes:
    assert float(jnp.vdot(u[k], g[k])) < 0, (k, u[k])


@pytest.mark.parametrize("name", ["eigen_adam", "shampoo"])
def test_power_qr_refresh_with_nan_gradients(name):
  """A NaN entry shows up in the update; under ``apply_if_finite`` the step is skipped
  and the power-step refreshes after it stay finite."""
  kw = dict(_kw(name), refresh="power_qr")
  shapes = {"w": (6, 10), "v": (5,)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  good = [_grads("normal", jnp.float32, t, shapes) for t in range(6)]
  bad = dict(good[1], w=good[1]["w"].at[2, 3].set(jnp.nan))
  tx = getattr(fo, name)(0.01, **kw)
  s = tx.init(params)
  _, s = jax.jit(tx.update)(good[0], s, params)
  u, _ = jax.jit(tx.update)(bad, s, params)
  assert not bool(jnp.all(jnp.isfinite(u["w"])))
  tx = optax.apply_if_finite(getattr(fo, name)(0.01, **kw), max_consecutive_errors=5)
  update = jax.jit(tx.update)
  s = tx.init(params)
  _, s = update(good[0], s, params)
  u, s = update(bad, s, params)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
  for g in good[2:]:  # refreshes at the 3rd and 5th applied steps: power steps
    u, s = update(g, s, params)
    assert _finite(u) and _finite(s.inner_state)
