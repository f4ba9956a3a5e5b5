"""Named optimizers against dense float64 re-derivations, and their optax integration."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo
from tests import registry
from tests.registry import LR, STACK
from tests.util import (SHAPES, TREE, check_tree_against_references, grads_at, run_library,
                        run_opt, run_reference, small_params, structured_grads)

# the dense references outside the rotation family (rotation: tests/test_rotate.py)
REFERENCED = [n for n, kw in registry.WITH_REFERENCE.items()
              if registry.CASES[n].family != "rotation"]


# every case in the default run but three of Alice-SOAP's (about 2 s each on 2 cores), which
# CI's slow step runs; its tall matrix stays in the default run
@pytest.mark.parametrize("name,shape", [
    pytest.param(n, s, id=f"{n}-{'x'.join(map(str, s))}",
                 marks=pytest.mark.slow if n == "alice_soap" and tuple(s) != (10, 6) else ())
    for n in REFERENCED for s in SHAPES])
def test_matches_dense_float64_reference(name, shape):
  """7 steps, interval 3: refreshes at t = 1, 4, 7; m < n, m > n and a stack."""
  grads = structured_grads(shape, 7, seed=1)
  kw = registry.WITH_REFERENCE[name]
  lib = run_library(name, shape, grads, **kw)
  ref = run_reference(name, shape, grads, **kw)
  for t, (a, b) in enumerate(zip(lib, ref), start=1):
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 1e-4, f"{name} step {t}: relative error {err:.2e}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["galore", "fira"])
def test_exact_svd_refresh_matches_the_release(name, shape):
  """``refresh=fo.svd_refresh()``: the released GaLore / Fira (float64 SVD at every
  refresh), 7 steps, refreshes at t = 1, 4, 7."""
  grads = structured_grads(shape, 7, seed=1)
  kw = dict(registry.WITH_REFERENCE[name], refresh=fo.svd_refresh())
  lib = run_library(name, shape, grads, **kw)
  ref = run_reference(name, shape, grads, **kw)
  for t, (a, b) in enumerate(zip(lib, ref), start=1):
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 1e-4, f"{name} step {t}: relative error {err:.2e}"


@pytest.mark.parametrize("name", registry.params(REFERENCED, default=["racs", "alice", "galore"]))
def test_tree_of_same_shape_leaves_matches_dense_references(name):
  """7 steps, refreshes at t = 1, 4, 7, on a tree whose same-shape matrices are stacked."""
  kw = registry.WITH_REFERENCE[name]
  check_tree_against_references(name, TREE, kw, kw, 7, 1e-4)


# ----------------------------------------------------------- optax.contrib.galore


@pytest.mark.parametrize("b1,steps", [(0.9, 3), (0.0, 7)])
def test_galore_equals_optax_contrib_galore_on_square_matrices(b1, steps):
  """Same rank, interval, scale and Adam betas/eps: equal updates.

  Differences, by design: (1) ``optax.contrib.galore`` projects the *larger* side of a
  non-square matrix (``use_left = m >= n``) while the GaLore release and fo.galore
  project the smaller one, so only square matrices are comparable; (2) fo fixes the
  sign of singular vectors, contrib keeps LAPACK's, so with ``b1 > 0`` the first
  moment carried across a re-projection differs -- we compare the first interval for
  b1 = 0.9 and across two re-projections for b1 = 0 (sign-invariant); (3) eps enters as
  in torch AdamW (``eps * sqrt(1 - b2^t)`` in optax terms): negligible here.
  """
  grads = structured_grads((8, 8), steps, seed=3)
  kw = dict(rank=3, scale=0.25)
  ours = run_opt(fo.galore(LR, interval=3, b1=b1, b2=0.99, eps=1e-8, refresh=fo.svd_refresh(),
                           **kw), grads, (8, 8))
  # optax's products follow JAX's default precision (TensorFloat-32 on NVIDIA GPUs); ours
  # are float32 on every backend
  with jax.default_matmul_precision("float32"):
    theirs = run_opt(optax.contrib.galore(
        LR, update_proj_gap=3, base_optimizer=optax.scale_by_adam(b1=b1, b2=0.99, eps=1e-8),
        **kw), grads, (8, 8))
  for t, (a, b) in enumerate(zip(ours, theirs), start=1):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7, err_msg=f"step {t}")


def test_galore_projects_smaller_side_unlike_optax_contrib():
  p = {"w": jnp.zeros((6, 20))}
  ours = optax.tree_utils.tree_get(fo.galore(LR, rank=2, stack_matrices=False).init(p),
                                   "basis")
  theirs = optax.tree_utils.tree_get(optax.contrib.galore(LR, rank=2).init(p), "projector")
  assert ours["w"].shape == (6, 2)      # release: basis on the smaller side, moments 2 x 20
  assert theirs["w"].shape == (20, 2)   # contrib: basis on the larger side, moments 6 x 2


# ------------------------------------------------------------------ state sizes


# the registry's optimizers for which the paper gives a state-size formula (not the
# whitening family)
@pytest.mark.parametrize("name", [n for n in registry.NAMES
                                  if registry.CASES[n].family != "whitening"])
@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (3, 16, 40)], ids=str)
def test_state_sizes_equal_paper_formulas(name, shape):
  rank = 5
  kw = {k: v for k, v in dict(rank=rank, leading=2).items() if k in registry.CASES[name].kwargs}
  opt = getattr(fo, name)(LR, dims=STACK, **kw)
  state = jax.eval_shape(opt.init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
  formula, extra = fo.paper_state_numbers(name, shape[-2], shape[-1], rank)
  nmat = int(np.prod(shape[:-2]))
  # array leaves larger than a scalar per matrix: counters (1 int each) and keys (2) excluded
  arrays = [x for x in jax.tree.leaves(state) if x.size > 2]
  per_matrix_scalars = [x for x in jax.tree.leaves(state) if x.shape == shape[:-2] and x.ndim]
  total = sum(x.size for x in arrays if x.shape != shape[:-2])
  # the fallback Adam state of a matrix-only tree is empty apart from counters
  assert total == nmat * formula, (name, total, nmat * formula)
  if nmat > 1:
    assert sum(x.size for x in per_matrix_scalars) == nmat * extra
  assert fo.state_bytes(state) == 4 * fo.state_numbers(state)  # float32 state, int32 counters


# -------------------------------------------------------------- optax integration


@pytest.mark.parametrize("name", registry.params(default=["racs", "galore", "normuon"]))
def test_compiles_once_and_not_again_at_refresh(name):
  opt = registry.make(name)
  params = small_params()
  traces = []

  @jax.jit
  def step(g, s):
    traces.append(1)
    return opt.update(g, s, params)

  s = opt.init(params)
  for t in range(6):  # refreshes at t = 1, 3, 5
    u, s = step(grads_at(params, t), s)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
  assert len(traces) == 1


def _lowered_fingerprints(names) -> str:
  """``name stacked sha256`` of each optimizer's lowered update on a tree with two
  numbered layers of same-shape leaves, per-leaf and stacked, a line each."""
  import hashlib
  layer = lambda: {"q": jnp.zeros((8, 8)), "k": jnp.zeros((8, 8)),  # noqa: E731
                   "up": jnp.zeros((8, 12)), "down": jnp.zeros((12, 8)),
                   "norm": jnp.zeros((8,))}
  tree = {"w": jnp.zeros((6, 10)), "stack": jnp.zeros((2, 8, 5)), "b": jnp.zeros((6,)),
          "layers": {"0": layer(), "1": layer()}}
  lines = []
  for name in names:
    for stacked in (False, True):
      opt = registry.make(name, stack_matrices=stacked)
      state = jax.eval_shape(opt.init, tree)
      text = jax.jit(opt.update).lower(tree, state, tree).as_text()
      lines.append(f"{name} {stacked} {hashlib.sha256(text.encode()).hexdigest()}")
  return "\n".join(lines)


# three optimizers that run every shared layer (routing, grouping, stacking, refresh
# conditionals, random draws) and three families of blocks, then the rest; both with
# -m slow (each spawns processes that lower every program again)
_LOWERED_BY_DEFAULT = ["racs", "alice", "soap"]


@pytest.mark.parametrize("names", [
    pytest.param(_LOWERED_BY_DEFAULT, marks=pytest.mark.slow),
    pytest.param([n for n in registry.NAMES if n not in _LOWERED_BY_DEFAULT],
                 marks=pytest.mark.slow)], ids=["default", "others"])
def test_every_optimizer_lowers_to_the_same_program_in_every_process(names):
  """Each optimizer's update lowers to the same program in a process with another
  string-hash seed (the iteration order of Python sets and dicts of strings), in both
  layouts: what every host of a multi-host ``jax.jit`` must agree on, and what JAX's
  persistent compilation cache keys on."""
  here = _lowered_fingerprints(names)
  seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import warnings; warnings.simplefilter('ignore')\n"
          "from tests.test_optimizers import _lowered_fingerprints\n"
          f"print(_lowered_fingerprints({list(names)!r}))")
  there = subprocess.run([sys.executable, "-c", code], cwd=root,
                         env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root),
                         capture_output=True, text=True, check=True).stdout.strip()
  assert [line.split()[:2] for line in here.splitlines()] == [
      [n, str(st)] for n in names for st in (False, True)]
  assert here == there


@pytest.mark.parametrize("name", registry.params(default=["racs"]))
def test_chain_inject_hyperparams_multisteps_and_schedules(name):
  params = small_params()
  kw = registry.kwargs(name)
  factory = getattr(fo, name)
  sched = optax.warmup_cosine_decay_schedule(0.0, LR, 2, 10, LR * 0.1)
  variants = [
      optax.chain(optax.clip_by_global_norm(1.0), factory(sched, **kw)),
      fo.inject_hyperparams(factory)(learning_rate=LR, **kw),
      optax.MultiSteps(factory(LR, **kw), every_k_schedule=2),
  ]
  for opt in variants:
    s = opt.init(params)
    upd = jax.jit(opt.update)
    for t in range(4):
      u, s = upd(grads_at(params, t), s, params)
      assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
  # inject_hyperparams: the learning rate can be changed in the state
  opt = fo.inject_hyperparams(factory)(learning_rate=LR, **kw)
  s, upd = opt.init(params), jax.jit(opt.update)
  u1, _ = upd(grads_at(params, 0), s, params)
  s.hyperparams["learning_rate"] = jnp.asarray(2 * LR)
  u2, _ = upd(grads_at(params, 0), s, params)
  np.testing.assert_allclose(np.asarray(u2["w"]), 2 * np.asarray(u1["w"]), rtol=1e-5)


@pytest.mark.parametrize("name", registry.params())
def test_extra_args_and_state_stable_under_lax_cond(name):
  """As optax contrib's common tests: ``update`` accepts extra keyword arguments (e.g. the
  loss ``value``), and its new state has the structure, shapes and dtypes of the old, so
  ``lax.cond`` can choose between them (as ``optax.MultiSteps`` and skip-step logic do)."""
  opt = registry.make(name)
  params = small_params()
  state = opt.init(params)

  @jax.jit
  def step(g, s, skip):
    new = opt.update(g, s, params, value=jnp.asarray(1.0), some_extra_arg=3)[1]
    return jax.lax.cond(skip, lambda: s, lambda: new)

  for t in range(4):  # refreshes at t = 1, 3
    new = step(grads_at(params, t), state, t == 2)
    assert (jax.tree.structure(new) == jax.tree.structure(state))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)):
      assert a.shape == b.shape and a.dtype == b.dtype
    if t == 2:
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state = new


@pytest.mark.parametrize("name", registry.params(default=["racs", "galore"]))
def test_bf16_params_get_bf16_updates(name):
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), small_params())
  opt = registry.make(name)
  s = opt.init(params)
  for t in range(3):
    u, s = jax.jit(opt.update)(grads_at(params, t), s, params)
  for x in jax.tree.leaves(u):
    assert x.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(x, np.float32)).all()


@pytest.mark.parametrize("name,arg", [("galore", "rank"), ("alice", "rank"),
                                      ("alice_soap", "right_rank"), ("apollo", "rank"),
                                      ("soap", "max_precond_dim")])
def test_plain_inject_hyperparams_names_the_static_arguments(name, arg):
  """A shape-fixing argument injected as an array (``optax.inject_hyperparams`` without
  ``static_args``) is a ValueError at ``init`` that lists the static arguments and
  names ``fo.inject_hyperparams``, not JAX's ConcretizationTypeError from inside."""
  fn = getattr(fo, name)
  opt = optax.inject_hyperparams(fn)(learning_rate=LR, **{arg: 2})
  with pytest.raises(ValueError, match=rf"`{arg}` arrived as a jax array.*"
                     rf"static_args={re.escape(repr(tuple(fn.static_args)))}.*"
                     rf"fo.inject_hyperparams\(fo.{name}\)"):
    opt.init({"w": jnp.zeros((4, 6))})
  # the named fix works
  tx = optax.inject_hyperparams(fn, static_args=fn.static_args)(learning_rate=LR, **{arg: 2})
  params = {"w": jnp.zeros((4, 6))}
  jax.jit(tx.update)({"w": jnp.ones((4, 6))}, tx.init(params), params)


def test_routing_vectors_to_adam_and_path_mask():
  params = {"embed": jnp.zeros((12, 6)), "layer": {"kernel": jnp.zeros((6, 6))},
            "bias": jnp.zeros((6,))}
  opt = fo.racs(LR, mask=fo.path_mask(exclude=["embed"]))
  s = opt.init(params)
  g = grads_at(params, 0)
  u, s = opt.update(g, s, params)
  adam_u, _ = optax.adam(LR).update(g, optax.adam(LR).init(params), params)
  np.testing.assert_allclose(u["embed"], adam_u["embed"], rtol=1e-6)
  np.testing.assert_allclose(u["bias"], adam_u["bias"], rtol=1e-6)
  assert not np.allclose(u["layer"]["kernel"], adam_u["layer"]["kernel"])
  # custom fallback
  opt = fo.racs(LR, fallback=optax.sgd(1.0))
  u, _ = opt.update(g, opt.init(params), params)
  np.testing.assert_allclose(u["bias"], -g["bias"])


@pytest.mark.parametrize("factory,kw,arg", [
    (fo.alice, dict(rank=0), "rank"),
    (fo.alice, dict(rank=4, leading=5), "leading"),
    (fo.alice, dict(interval=0), "interval"),
    (fo.alice, dict(b1=1.0), "b1"),
    (fo.alice, dict(b2=-0.5), "b2"),
    (fo.alice, dict(b3=1.5), "b3"),
    (fo.alice, dict(limiter=-1.0), "limiter"),
    (fo.alice0, dict(leading=300), "leading"),
    (fo.galore, dict(rank=-1), "rank"),
    (fo.fira, dict(limiter=0.0), "limiter"),
    (fo.racs, dict(beta=1.0), "beta"),
    (fo.racs, dict(limiter=-0.5), "limiter"),
    (fo.apollo, dict(rank=0), "rank"),
    (fo.apollo_mini, dict(limiter=0.0), "limiter"),
    (fo.soap, dict(precondition_frequency=0), "precondition_frequency"),
    (fo.shampoo, dict(eps=-1.0), "`eps`"),
    (fo.eigen_adam, dict(b3=1.0), "b3"),
])
def test_invalid_settings_raise_when_built(factory, kw, arg):
  with pytest.raises(ValueError, match=arg):
    factory(LR, **kw)


# --------------------------------------------------------------------- ablations


def ablation_rows(lr=LR, *, rank=3, leading=1, interval=2, alpha=0.3, alpha_c=0.4, b1=0.9,
                  b2=0.9, b3=0.999):
  """The paper's Table "Effectiveness of each component" as chains of blocks."""
  moments = lambda: fo.on_coefficients(fo.scale_by_moments(b1, b2), rank=rank)
  tail = [optax.scale(alpha), optax.scale_by_learning_rate(lr)]
  return {
      "projection only": optax.chain(
          fo.low_rank_track(rank=rank, interval=interval), moments(), fo.project_back(), *tail),
      "+ tracking": optax.chain(
          fo.low_rank_track(rank=rank, interval=interval, b3=b3), moments(),
          fo.project_back(), *tail),
      "+ tracking + switching": optax.chain(
          fo.low_rank_track(rank=rank, interval=interval, b3=b3,
                            refresh=fo.switch(leading=leading)), moments(), fo.project_back(),
          *tail),
      "+ compensation (Alice)": optax.chain(
          fo.low_rank_track(rank=rank, interval=interval, b3=b3,
                            refresh=fo.switch(leading=leading)), moments(),
          fo.compensate(alpha_c=alpha_c, b1=b1), *tail),
  }


def test_ablation_rows_run_and_last_row_is_alice():
  params = {"w": jnp.zeros((8, 12))}
  rows = ablation_rows()
  outs = {}
  for name, tx in rows.items():
    s = tx.init(params)
    for t in range(5):
      u, s = jax.jit(tx.update)(grads_at(params, t), s, params)
    outs[name] = np.asarray(u["w"])
  # per-leaf: the rows are composed per leaf, and switching's draws differ by layout
  alice = fo.alice(LR, rank=3, leading=1, interval=2, stack_matrices=False)
  s = alice.init(params)
  for t in range(5):
    u, s = jax.jit(alice.update)(grads_at(params, t), s, params)
  np.testing.assert_allclose(outs["+ compensation (Alice)"], np.asarray(u["w"]), rtol=1e-5)
  # every component changes the update
  vals = list(outs.values())
  for a, b in zip(vals, vals[1:]):
    assert not np.allclose(a, b)


@pytest.mark.parametrize("name", registry.params(default=["racs", "galore"]))
def test_decoupled_weight_decay_on_the_structured_leaves(name):
  """``weight_decay=wd`` adds ``-lr * wd * W`` to every matrix leaf's update (optax.adamw's
  decoupled form), and leaves the fallback alone: one step each, three (with a refresh)
  for Alice; the decay is the same closing block of every chain."""
  wd = 0.1
  key = jax.random.PRNGKey(3)
  params = {"w": jax.random.normal(key, (6, 10)), "stack": jax.random.normal(key, (2, 8, 5)),
            "b": jnp.ones((6,))}
  plain = registry.make(name)
  decayed = registry.make(name, weight_decay=wd)
  s0, s1 = plain.init(params), decayed.init(params)
  plain_step, decayed_step = jax.jit(plain.update), jax.jit(decayed.update)
  for t in range(3 if name == "alice" else 1):
    g = grads_at(params, t)
    u0, s0 = plain_step(g, s0, params)
    u1, s1 = decayed_step(g, s1, params)
    for k in ("w", "stack"):
      np.testing.assert_allclose(np.asarray(u1[k] - u0[k]), -LR * wd * np.asarray(params[k]),
                                 rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(u1["b"]), np.asarray(u0["b"]))


def test_weight_decay_accepts_schedules_and_rejects_negative_values():
  params = {"w": jnp.ones((4, 6))}
  tx = fo.racs(LR, weight_decay=lambda t: 0.5)
  u, _ = tx.update({"w": jnp.zeros((4, 6))}, tx.init(params), params)
  np.testing.assert_allclose(np.asarray(u["w"]), -LR * 0.5, rtol=1e-6)
  with pytest.raises(ValueError, match="weight_decay"):
    fo.alice(LR, weight_decay=-0.1)


def _dot_precisions(jaxpr) -> list:
  """The ``precision`` of every ``dot_general`` in ``jaxpr`` and its sub-jaxprs (refresh
  ``cond`` branches, loops, nested jits)."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(eqn.params["precision"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out.extend(_dot_precisions(sub))
  return out


@pytest.mark.parametrize("name", registry.params(registry.NAMES))
def test_every_matrix_product_requests_float32_precision(name):
  """JAX's default float32 product is TensorFloat-32 on NVIDIA GPUs and one bfloat16 pass
  on TPUs; every product of the blocks asks for float32 itself, refresh branches included
  (a product that does not shows no precision in the jaxpr). A precision chosen with
  ``jax.default_matmul_precision`` is followed instead. RACS and APOLLO-mini (rank 1)
  multiply only by vectors, as multiply-reduce, so they have none."""
  tx = registry.make(name)
  params = small_params()
  state = tx.init(params)
  for chosen, expected in ((None, jax.lax.Precision.HIGHEST),
                           ("tensorfloat32", jax.lax.Precision.HIGH)):
    with jax.default_matmul_precision(chosen):
      jaxpr = jax.make_jaxpr(tx.update)(params, state, params).jaxpr
    precisions = _dot_precisions(jaxpr)
    assert bool(precisions) == (name not in ("racs", "apollo_mini")), (
        f"{name}: {len(precisions)} products")
    wrong = [p for p in precisions if p is None or tuple(p) != (expected, expected)]
    assert not wrong, f"{name} under {chosen}: {len(wrong)} of {len(precisions)} at {wrong[0]}"
