"""Shared test utilities: the registry of optimizers under test and dense-reference
runners (one place, as optax contrib's ``_common_test.py``)."""

import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax as fo
from fisher_optax.blocks import switching
from tests import reference
from tests.conftest import structured_grads

LR = 0.01
SHAPES = [(6, 10), (10, 6), (3, 6, 10)]

CONFIGS = {
    "racs": dict(lib=dict(), ref=dict()),
    "alice": dict(lib=dict(rank=3, leading=1, interval=3),
                  ref=dict(rank=3, leading=1, interval=3)),
    "alice0": dict(lib=dict(rank=3, leading=1, interval=3),
                   ref=dict(rank=3, leading=1, interval=3)),
    "alice_soap": dict(lib=dict(rank=3, leading=1, interval=3, right_rank=2),
                       ref=dict(rank=3, leading=1, interval=3, right_rank=2)),
    "galore": dict(lib=dict(rank=3, interval=3), ref=dict(rank=3, interval=3)),
    "fira": dict(lib=dict(rank=3, interval=3), ref=dict(rank=3, interval=3)),
}


def _picker(index, total, seed=0):
  """The library's random complement draw for matrix ``index`` of a tracked tree of
  ``total`` matrices whose complements all have the same size (the only shared piece)."""

  def pick(t, num_complement, k):
    words = switching.refresh_noise(jax.random.PRNGKey(seed), jnp.int32(t - 1), total,
                                    num_complement)
    return np.asarray(switching.complement_indices(words[index, :num_complement], k))

  return pick


# Leaves with more than two dims are routed only when ``dims`` says how: here, as optax's
# scanned layers, every axis but the last two is a stack of independent matrices.
STACK = fo.MatrixDims()


def run_library(name, shape, grads, **kw):
  return run_opt(getattr(fo, name)(LR, **{"dims": STACK, **kw}), grads, shape)


def run_reference(name, shape, grads, first=0, total=None, **kw):
  """Dense references of every matrix of ``shape``; its matrices are ``first, first + 1,
  ...`` of a tracked tree of ``total`` (default: this leaf alone)."""
  *batch, m, n = shape
  nb = int(np.prod(batch)) if batch else 1
  total = nb if total is None else total
  refs = [reference.make(name, m, n, lr=LR, **kw) for _ in range(nb)]
  outs = []
  for g in grads:
    g = np.asarray(g, np.float32).astype(np.float64).reshape((nb, m, n))
    steps = []
    for b, ref in enumerate(refs):
      kwargs = {} if name == "racs" else {"pick": _picker(first + b, total)}
      if name == "alice_soap":  # the right basis draws with seed + 1 (alice_soap's docs)
        kwargs["pick_right"] = _picker(first + b, total, seed=1)
      steps.append(ref.step(g[b], **kwargs))
    outs.append(np.stack(steps).reshape(shape))
  return outs


TREE = {"a": (6, 10), "b": (10, 6), "c": (3, 6, 10), "d": (6, 10)}


def run_library_tree(opt, grads):
  """Jitted updates of ``opt`` on a tree of leaves (``grads``: leaf -> list of steps)."""
  params = {k: jnp.zeros(g[0].shape, jnp.float32) for k, g in grads.items()}
  state = opt.init(params)
  update = jax.jit(opt.update)
  outs = {k: [] for k in grads}
  for t in range(len(next(iter(grads.values())))):
    u, state = update({k: jnp.asarray(g[t], jnp.float32) for k, g in grads.items()}, state,
                      params)
    for k in grads:
      outs[k].append(np.asarray(u[k], np.float64))
  return outs


def check_tree_against_references(name, tree, lib_kw, ref_kw, steps, tol):
  """Leaves of equal shape (b is a transposed a, c a stack, d a second a) share one
  decomposition call per shape; each must still follow its own dense reference."""
  grads = {k: structured_grads(shape, steps, seed=3 + i) for i, (k, shape) in
           enumerate(sorted(tree.items()))}
  lib = run_library_tree(getattr(fo, name)(LR, **{"dims": STACK, **lib_kw}), grads)
  counts = [int(np.prod(shape[:-2])) for _, shape in sorted(tree.items())]
  for i, (k, shape) in enumerate(sorted(tree.items())):  # flatten order
    ref = run_reference(name, shape, grads[k], first=sum(counts[:i]), total=sum(counts),
                        **ref_kw)
    for t, (a, b) in enumerate(zip(lib[k], ref), start=1):
      err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
      assert err < tol, f"{name} leaf {k} step {t}: relative error {err:.2e}"


def run_opt(opt, grads, shape):
  """Jitted updates of ``opt`` for a single leaf ``w`` of ``shape`` (float64 copies)."""
  params = {"w": jnp.zeros(shape, jnp.float32)}
  state = opt.init(params)
  update = jax.jit(opt.update)
  outs = []
  for g in grads:
    u, state = update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    outs.append(np.asarray(u["w"], np.float64))
  return outs


_NAMED_KW = {
    "racs": {},
    "alice": dict(rank=3, leading=1, interval=2),
    "alice0": dict(rank=3, leading=1, interval=2),
    "alice_soap": dict(rank=3, leading=1, interval=2),
    "galore": dict(rank=3, interval=2),
    "fira": dict(rank=3, interval=2),
    "eigen_adam": dict(interval=2),
    "soap": dict(precondition_frequency=2),
    "shampoo": dict(interval=2),
    "apollo": dict(rank=3, interval=2),
    "apollo_mini": dict(interval=2),
    "swan": {},
    "muon": {},
}
NAMED_KW = {k: dict(kw, dims=STACK) for k, kw in _NAMED_KW.items()}
ALL = list(NAMED_KW)


def all_named():
  return {name: getattr(fo, name)(LR, **kw) for name, kw in NAMED_KW.items()}


def small_params():
  return {"w": jnp.zeros((6, 10)), "stack": jnp.zeros((2, 8, 5)), "b": jnp.zeros((6,))}


def grads_at(params, t):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.PRNGKey(t), p.shape, jnp.float32).astype(p.dtype),
      params)
