"""Shared test utilities: gradients with a known structure, and runners that compare the
library's optimizers with their dense float64 references (``tests/reference.py``). The
optimizers under test and their settings are in ``tests/registry.py``."""

import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax as fo
from fisher_optax import refresh as switching
from fisher_optax.blocks import random_projection
from tests import reference
from tests.registry import LR, STACK

# How long a test waits on a subprocess before calling it hung: a guard against a
# deadlock (a multi-process run whose peer died, a hung XLA:CPU collective), never a
# check of speed -- far beyond what any run takes on a slow or loaded machine.
HANG_S = 1800


def structured_grads(shape, steps, seed=0, noise=0.3):
  """Gradients with a stable, well-separated singular spectrum plus noise (numpy, float64).

  ``shape`` may carry leading batch axes; each matrix slice gets its own structure.
  """
  rng = np.random.default_rng(seed)
  *batch, m, n = shape
  k = min(m, n)
  nb = int(np.prod(batch)) if batch else 1
  base = []
  for _ in range(nb):
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    s = 4.0 * 0.6 ** np.arange(k)
    base.append(u @ np.diag(s) @ v.T)
  base = np.stack(base).reshape(tuple(batch) + (m, n))
  out = []
  for _ in range(steps):
    out.append(base + noise * rng.standard_normal(base.shape))
  return out


SHAPES = [(6, 10), (10, 6), (3, 6, 10)]


def _picker(index, total, seed=0):
  """The library's random complement draw for matrix ``index`` of a tracked tree of
  ``total`` matrices whose complements all have the same size (the only shared piece)."""

  def pick(t, num_complement, k):
    words = switching.refresh_noise(jax.random.PRNGKey(seed), jnp.int32(t - 1), total,
                                    num_complement)
    return np.asarray(switching.complement_indices(words[index, :num_complement], k))

  return pick


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


def small_params():
  return {"w": jnp.zeros((6, 10)), "stack": jnp.zeros((2, 8, 5)), "b": jnp.zeros((6,))}


def grads_at(params, t):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.PRNGKey(t), p.shape, jnp.float32).astype(p.dtype),
      params)


def coefficient_moments(tree):
  """The structured rule's first moments ``mu`` (Adam's, on a low-rank source's
  coefficients) in ``tree``: an optimizer state, or its ``PartitionSpec`` tree."""
  import optax
  return [v for path, v in optax.tree_utils.tree_get_all_with_path(tree, "mu")
          if "structured" in jax.tree_util.keystr(path)][0]


def run_sharded(tx, params, grads, specs, steps, mesh=None, state=None, start=0,
                donate=False):
  """``steps`` jitted steps of ``tx`` from ``params`` (``grads(t)``: the gradients of step
  ``t``); with a ``mesh``, the parameters, gradients and state laid out by ``specs`` and
  ``fo.state_shardings``, which the step's outputs keep; ``donate``: the step donates
  the parameters and the state, as a training step does. Returns the parameters and
  state."""
  import optax
  from jax.sharding import NamedSharding

  def apply(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  if mesh is None:
    step = jax.jit(apply)
    state = tx.init(params) if state is None else state
    place = lambda g: g  # noqa: E731
  else:
    p_sh = jax.tree.map(lambda v: NamedSharding(mesh, v), specs,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    params = jax.device_put(params, p_sh)
    state = (jax.jit(tx.init, out_shardings=s_sh)(params) if state is None
             else jax.device_put(state, s_sh))
    step = jax.jit(apply, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh),
                   donate_argnums=(0, 1) if donate else ())
    place = lambda g: jax.device_put(g, p_sh)  # noqa: E731
  for t in range(start, start + steps):
    params, state = step(params, state, place(grads(t)))
  return params, state


def assert_close_change(got, want, start, what, tol=1e-3):
  """Each leaf of ``got`` within ``tol`` of ``want`` relative to the change of ``want``
  from ``start`` (trees of arrays): sharded float32 reductions run in another order."""
  for k in want:
    d = np.asarray(want[k], np.float64) - np.asarray(start[k], np.float64)
    err = np.linalg.norm(np.asarray(got[k], np.float64) - np.asarray(want[k], np.float64))
    assert err <= tol * np.linalg.norm(d), (what, k, err / np.linalg.norm(d))


def random_tree(shapes: dict, seed: int, scale: float = 1.0) -> dict:
  """``{name: normal(key(seed + i), shape) * scale}`` over ``shapes`` in order."""
  return {k: jax.random.normal(jax.random.PRNGKey(seed + i), s) * scale
          for i, (k, s) in enumerate(shapes.items())}


def restore_onto(path, tx, params, state, specs, mesh):
  """``params`` and ``state`` saved with orbax under ``path`` (the sharding tests'
  ``_save``) and restored laid out for ``mesh`` (by ``specs`` and ``fo.state_shardings``),
  or onto the first device when ``mesh`` is ``"one"``."""
  from jax.sharding import NamedSharding
  from tests.test_sharding import _restore
  if mesh == "one":
    one = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), t)
    return _restore(path, one(params), one(state))
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  s_sh = fo.state_shardings(tx, params, specs, mesh)
  return _restore(path, jax.device_put(params, p_sh), jax.device_put(state, s_sh))


def small_mesh():
  """A 2 x 2 ``("fsdp", "tensor")`` mesh of the first 4 devices, ``Auto`` axes."""
  return jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def assert_zero_and_nan_stay_in_their_leaf(tx, shapes, params, grads, specs, mesh,
                                           leaf="w", other="stack", atol=1e-6):
  """Two steps of ``tx`` on ``mesh`` (``jax.set_mesh``) and on one device, with zero
  gradients and with NaN gradients in ``leaf`` only: the same NaN pattern and values
  both ways (within ``atol``), a zero gradient leaving ``leaf`` unchanged, a NaN one
  making all of it NaN and leaving ``other`` finite."""
  zero = lambda t: {k: jnp.zeros(s) for k, s in shapes.items()}  # noqa: E731
  nan = lambda t: {**grads(t), leaf: jnp.full(shapes[leaf], jnp.nan)}  # noqa: E731
  for given in (zero, nan):
    single, _ = run_sharded(tx, params(), given, specs, 2)
    with jax.set_mesh(mesh):
      sharded, _ = run_sharded(tx, params(), given, specs, 2, mesh)
    for k in shapes:
      a, b = np.asarray(sharded[k]), np.asarray(single[k])
      np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=k)
      np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-4, atol=atol,
                                 err_msg=k)
    if given is zero:
      np.testing.assert_array_equal(np.asarray(sharded[leaf]), np.asarray(params()[leaf]))
    else:
      assert np.isnan(np.asarray(sharded[leaf])).all()
      assert np.isfinite(np.asarray(sharded[other])).all()


def updates_on_mesh(tx, shape, grads, mesh, spec):
  """Per-step updates of ``tx`` on one leaf of ``shape`` laid out as ``spec`` on ``mesh``
  (the context mesh while compiling; state laid out by ``fo.state_shardings``), as
  float64 arrays."""
  return [u["w"] for u in tree_updates_on_mesh(tx, {"w": shape}, [{"w": g} for g in grads],
                                               mesh, {"w": spec})]


def tree_updates_on_mesh(tx, shapes, grads, mesh, specs):
  """:func:`updates_on_mesh` for a dict of leaves: ``shapes`` and ``specs`` per leaf,
  ``grads`` one dict per step; per step, a dict of float64 updates."""
  from jax.sharding import NamedSharding
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  sh = {k: NamedSharding(mesh, specs[k]) for k in shapes}
  s_sh = fo.state_shardings(tx, params, specs, mesh)
  params = jax.device_put(params, sh)  # on Explicit axes their split is in their types
  state = jax.jit(tx.init, out_shardings=s_sh)(params)
  with jax.set_mesh(mesh):
    step = jax.jit(tx.update, in_shardings=(sh, s_sh, sh), out_shardings=(sh, s_sh))
    step = step.lower(params, state, params).compile()
  out = []
  for g in grads:
    u, state = step(jax.device_put({k: jnp.asarray(x, jnp.float32) for k, x in g.items()}, sh),
                    state, jax.device_put(params, sh))
    out.append({k: np.asarray(x, np.float64) for k, x in u.items()})
  return out


def resume_elsewhere(path, tx, run, specs, mesh, before, after, one_device_mesh=False):
  """``before`` steps of ``tx`` on ``mesh`` (``run(tx, steps, mesh, params=, state=,
  start=)``, the test module's runner), saved with orbax under ``path``, restored onto
  :func:`small_mesh` and onto one device, and ``after`` more steps on each: the two
  continuations' parameters. ``one_device_mesh``: the one-device run under a context mesh
  of that device (an optimizer built for a mesh runs on it otherwise)."""
  from tests.test_sharding import _save
  with jax.set_mesh(mesh):
    p2, s2 = run(tx, before, mesh)
  _save(path, p2, s2)
  small = small_mesh()
  rp, rs = restore_onto(path, tx, p2, s2, specs, small)
  with jax.set_mesh(small):
    got_small, _ = run(tx, after, small, params=rp, state=rs, start=before)
  rp1, rs1 = restore_onto(path, tx, p2, s2, specs, "one")
  if one_device_mesh:
    with jax.set_mesh(jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])):
      got_one, _ = run(tx, after, params=rp1, state=rs1, start=before)
  else:
    got_one, _ = run(tx, after, params=rp1, state=rs1, start=before)
  return got_small, got_one


def apollo_bases(shape, rank, interval, seed=0):
  """The library's Gaussian projections at step ``t`` (1-based) of matrix ``b``: key
  ``fold_in(fold_in(PRNGKey(seed), (t - 1) // interval), b)`` (shared randomness, for
  the float64 reference of APOLLO)."""
  *_, m, n = shape
  ms = min(m, n)

  def basis(b):
    def f(t):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed),
                                                  (t - 1) // interval), b)
      return random_projection.random_basis(key, ms, min(rank, ms))
    return f

  return basis


def same_arrays(a, b) -> bool:
  """Whether two trees have one structure and bitwise equal leaves."""
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(np.array_equal(np.asarray(x), np.asarray(y))
                  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def check_state_conversion(name, tx, tx4, per_leaf, other, mesh, run, close, params, owned_of):
  """``fo.convert_state_layout`` between a state kept on the owners (``tx``, built for
  ``mesh``; ``owned_of`` finds that part of its state) and the per-leaf state
  (``per_leaf``): fresh ``init`` s convert exactly into each other; per leaf -> owners ->
  per leaf returns the state unchanged; a per-leaf state after 3 steps continued on the
  owners for 2, and an owned one continued in the layout of ``other`` or on the owners
  of 4 devices (``tx4``), give the uninterrupted per-leaf run's updates (``run`` and
  ``close``: the test's own)."""
  def convert(state, target, params):  # each array once: a state is donated to the step
    out = fo.convert_state_layout(state, target, params)
    arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
    assert len({id(x) for x in arrays}) == len(arrays), "an array twice in the state"
    return out

  assert same_arrays(convert(per_leaf.init(params), tx, params), tx.init(params))
  assert same_arrays(convert(tx.init(params), per_leaf, params), per_leaf.init(params))
  p3, s3 = run(per_leaf, 3)
  want, _ = run(per_leaf, 2, params=p3, state=s3, start=3)
  on_owners = convert(s3, tx, params)
  assert owned_of(on_owners) is not None
  assert same_arrays(convert(on_owners, per_leaf, params), s3)
  with jax.set_mesh(mesh):
    got, _ = run(tx, 2, mesh, params=p3, state=on_owners, start=3)
  close(got, want, f"{name}: per leaf -> owners")
  with jax.set_mesh(mesh):
    q3, t3 = run(tx, 3, mesh)
  q3, t3 = jax.device_get((q3, t3))
  got, _ = run(other, 2, params=q3, state=convert(t3, other, params), start=3)
  close(got, want, f"{name}: owners -> the other layout")
  moved = convert(t3, tx4, params)
  assert owned_of(moved).load.shape == (4,)
  got, _ = run(tx4, 2, params=q3, state=moved, start=3)
  close(got, want, f"{name}: owners of 8 -> owners of 4")
