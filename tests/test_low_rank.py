"""low_rank_track / on_coefficients / project_back (paper Sec. 5.1)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo


def _grads(shape, k, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(k)]


def test_tracking_is_ema_of_projected_outer_products():
  tx = fo.low_rank_track(rank=3, interval=100, b3=0.9)
  p = {"w": jnp.zeros((6, 9))}
  s = tx.init(p)
  q = np.zeros((3, 3))
  for g in _grads((6, 9), 4):
    out, s = tx.update({"w": g}, s)
    sig = np.asarray(out["w"].sigma, np.float64)
    q = 0.9 * q + 0.1 * sig @ sig.T
    np.testing.assert_allclose(np.asarray(out["w"].basis).T @ np.asarray(g), sig, atol=1e-5)
  np.testing.assert_allclose(np.asarray(s.tracked["w"]), q, rtol=1e-5)


def test_alice0_stores_no_rxr_state_and_alice_does():
  p = {"w": jnp.zeros((8, 12))}
  for stack in (False, True):  # per-leaf (r, r); stacked (1, r, r)
    s0 = fo.alice0(0.01, rank=4, leading=2, stack_matrices=stack).init(p)
    s1 = fo.alice(0.01, rank=4, leading=2, stack_matrices=stack).init(p)
    shapes0 = [x.shape[-2:] for x in jax.tree.leaves(s0)]
    shapes1 = [x.shape[-2:] for x in jax.tree.leaves(s1)]
    assert (4, 4) not in shapes0
    assert (4, 4) in shapes1


@pytest.mark.parametrize("shape,basis,coeff", [((6, 10), (6, 3), (3, 10)),
                                               ((10, 6), (6, 3), (3, 10)),
                                               ((2, 10, 6), (2, 6, 3), (2, 3, 10)),
                                               ((2, 3), (2, 2), (2, 3))])
def test_smaller_side_projected_and_rank_clipped(shape, basis, coeff):
  tx = fo.low_rank_track(rank=3)
  s = tx.init({"w": jnp.zeros(shape)})
  assert s.basis["w"].shape == basis
  out, s = tx.update({"w": jnp.ones(shape)}, s)
  assert out["w"].coeffs.shape == coeff


def test_matrix_dims_choose_other_axes():
  """A [m, layers, n] leaf with rows=0, cols=2: the batch axis is 1."""
  dims = fo.MatrixDims(rows=0, cols=2)
  tx = optax.chain(fo.low_rank_track(rank=2, dims=dims),
                   fo.on_coefficients(optax.identity(), rank=2, dims=dims), fo.project_back())
  g = _grads((5, 3, 7), 1)[0]
  s = tx.init({"w": g})
  assert s[0].basis["w"].shape == (3, 5, 2)
  out, _ = tx.update({"w": g}, s)
  assert out["w"].shape == (5, 3, 7)
  # each slice g[:, b, :] is projected on its own top-2 left singular space
  for b in range(3):
    gb = np.asarray(g[:, b, :], np.float64)
    u, _, _ = np.linalg.svd(gb)
    expect = u[:, :2] @ u[:, :2].T @ gb
    np.testing.assert_allclose(np.asarray(out["w"][:, b, :]), expect, atol=1e-4)


def test_project_back_with_identity_is_projection():
  tx = optax.chain(fo.low_rank_track(rank=2, refresh=fo.svd_refresh()),
                   fo.on_coefficients(optax.identity(), rank=2), fo.project_back())
  g = _grads((4, 6), 1)[0]
  out, _ = tx.update({"w": g}, tx.init({"w": g}))
  u, _, _ = np.linalg.svd(np.asarray(g, np.float64))
  np.testing.assert_allclose(np.asarray(out["w"]), u[:, :2] @ u[:, :2].T @ np.asarray(g), atol=1e-5)


def test_rank_mismatch_between_blocks_is_a_clear_error():
  tx = optax.chain(fo.low_rank_track(rank=2), fo.on_coefficients(optax.identity(), rank=3),
                   fo.project_back())
  p = {"w": jnp.zeros((5, 8))}
  s = tx.init(p)
  with pytest.raises(ValueError, match="same `rank`"):
    tx.update({"w": jnp.ones((5, 8))}, s)


@pytest.mark.parametrize("kw,arg", [(dict(rank=0), "rank"), (dict(rank=2, interval=0), "interval"),
                                    (dict(rank=2, b3=1.0), "b3")])
def test_invalid_settings(kw, arg):
  with pytest.raises(ValueError, match=arg):
    fo.low_rank_track(**kw)


def test_vector_leaf_is_a_clear_error():
  with pytest.raises(ValueError, match="matrices"):
    fo.low_rank_track(rank=2).init({"b": jnp.zeros(4)})
  with pytest.raises(ValueError, match="matrices"):
    fo.alice(0.01, rank=2, leading=1, mask={"b": True}).init({"b": jnp.zeros(4)})


def test_nan_refresh_keeps_previous_basis():
  tx = fo.low_rank_track(rank=2, interval=1)
  p = {"w": jnp.zeros((4, 6))}
  s = tx.init(p)
  g = _grads((4, 6), 1)[0]
  _, s = tx.update({"w": g}, s)
  before = np.asarray(s.basis["w"])
  _, s = tx.update({"w": g.at[0, 0].set(jnp.nan)}, s)
  np.testing.assert_array_equal(np.asarray(s.basis["w"]), before)


def _low_rank_updates(*inner, steps=3, between=()):
  track = fo.low_rank_track(rank=3, interval=2, b3=0.9)
  tx = optax.chain(track, track.on_coefficients(optax.chain(optax.scale_by_adam(), *inner)),
                   *between, fo.project_back())
  p = {"w": jnp.zeros((6, 10))}
  s, out = tx.init(p), []
  step = jax.jit(tx.update)
  for g in _grads((6, 10), steps, seed=4):
    u, s = step({"w": g}, s, p)
    out.append(np.asarray(u["w"]))
  return out


def test_a_transformation_on_the_coefficients_acts_on_them_only():
  """``optax.scale(2)`` inside ``on_coefficients`` doubles the update (it does not also
  scale the basis: 4x), and a clip there acts on the coefficients' norm."""
  plain, doubled = _low_rank_updates(), _low_rank_updates(optax.scale(2.0))
  for a, b in zip(plain, doubled):
    np.testing.assert_allclose(b, 2 * a, rtol=1e-5, atol=1e-7)
  clipped = _low_rank_updates(optax.clip_by_global_norm(1e-3))
  for a, c in zip(plain, clipped):
    # U has orthonormal columns, so ||U c|| = ||c||: the dense update has the clipped norm
    np.testing.assert_allclose(np.linalg.norm(c), min(np.linalg.norm(a), 1e-3), rtol=1e-4)
    np.testing.assert_allclose(c / np.linalg.norm(c), a / np.linalg.norm(a), atol=1e-5)


@pytest.mark.parametrize("between", [optax.scale(2.0), optax.clip_by_global_norm(1.0),
                                     optax.zero_nans()], ids=["scale", "clip", "zero_nans"])
def test_a_generic_transformation_between_the_ends_is_refused(between):
  """Placed bare between the ends, a generic transformation would act on the basis and
  the gradient too; it is a ``TypeError`` naming the guard (ours says where the
  transformation belongs; a jitted ``jnp`` function names the guard's type)."""
  with pytest.raises(TypeError, match="SubspaceGuard"):
    _low_rank_updates(between=(between,))


def _message(track, g):
  return track.update(g, track.init(jax.tree.map(jnp.zeros_like, g)))


def test_the_message_holds_its_arrays_as_pytree_children():
  """Every array of a ``Subspace`` is a pytree child (nothing in its static metadata):
  the tree's array leaves are exactly the coefficients, sigma, basis and gradient."""
  g = {"w": _grads((4, 6), 1)[0]}
  out, _ = _message(fo.low_rank_track(rank=2), g)
  node = out["w"]
  leaves, treedef = jax.tree.flatten(out)
  arrays = [x for x in leaves if isinstance(x, jax.Array)]
  assert [a.shape for a in arrays] == [(2, 6), (2, 6), (4, 2), (4, 6)]
  assert sum(isinstance(x, fo.SubspaceGuard) for x in leaves) == 1
  children, aux = node.tree_flatten()
  # static metadata only: the view, the dtype and where the columns were moved (none here)
  assert aux == (node.view, node.dtype, None)
  assert [c.shape for c in children[:4]] == [(2, 6), (2, 6), (4, 2), (4, 6)]
  np.testing.assert_allclose(node.sigma, node.basis.T @ g["w"], rtol=1e-5, atol=1e-6)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert rebuilt["w"].basis is node.basis and rebuilt["w"].view == node.view


def test_a_jit_boundary_between_the_ends_is_refused_with_a_named_error():
  """``jax.jit`` of the source alone (a prefix of the chain that ends in a ``Subspace``)
  used to leak the basis's tracer; it is now a ``TypeError`` naming the guard, and the
  jit of the whole pipeline works."""
  g = {"w": _grads((4, 6), 1)[0]}
  track = fo.low_rank_track(rank=2)
  s = track.init(jax.tree.map(jnp.zeros_like, g))
  with pytest.raises(TypeError, match="SubspaceGuard"):
    jax.jit(track.update)(g, s)
  prefix = optax.chain(track, track.on_coefficients(optax.scale_by_adam()))
  with pytest.raises(TypeError, match="SubspaceGuard"):
    jax.jit(prefix.update)(g, prefix.init(g))
  whole = optax.chain(prefix, fo.project_back())
  u, _ = jax.jit(whole.update)(g, whole.init(g))
  assert u["w"].shape == (4, 6) and float(jnp.linalg.norm(u["w"])) > 0


def test_lax_cond_between_the_ends_is_refused_and_inside_on_coefficients_works():
  g = {"w": _grads((4, 6), 1)[0]}
  track = fo.low_rank_track(rank=2)
  s = track.init(jax.tree.map(jnp.zeros_like, g))

  def across_the_message(g, s):
    out, _ = track.update(g, s)
    out = jax.lax.cond(True, lambda t: t, lambda t: t, out)
    return fo.project_back().update(out, optax.EmptyState())[0]

  with pytest.raises(TypeError, match="on_coefficients"):
    jax.jit(across_the_message)(g, s)

  def conditional_triple(u, st, p=None):  # a lax.cond acting on the coefficients
    del p
    return jax.lax.cond(True, lambda t: jax.tree.map(lambda x: 3 * x, t), lambda t: t, u), st

  plain = fo.in_subspace(track, optax.identity())
  tripled = fo.in_subspace(track, optax.GradientTransformation(
      lambda p: optax.EmptyState(), conditional_triple))
  u1, _ = jax.jit(plain.update)(g, plain.init(g))
  u3, _ = jax.jit(tripled.update)(g, tripled.init(g))
  np.testing.assert_allclose(u3["w"], 3 * u1["w"], rtol=1e-5, atol=1e-6)


def test_in_subspace_is_the_chain_with_an_inner_optimizer():
  """``in_subspace(source, inner, end=...)`` equals the explicit chain, for each end."""
  g = {"w": _grads((6, 10), 1, seed=2)[0]}
  for end in (None, fo.compensate()):
    track = fo.low_rank_track(rank=3, interval=2)
    one = fo.in_subspace(track, optax.adam(1e-2), end=end)
    chained = optax.chain(track, track.on_coefficients(optax.adam(1e-2)),
                          end if end is not None else fo.project_back())
    a, _ = one.update(g, one.init(g))
    b, _ = chained.update(g, chained.init(g))
    np.testing.assert_array_equal(a["w"], b["w"])
  with pytest.raises(ValueError, match="low-rank source"):
    fo.in_subspace(optax.identity(), optax.adam(1e-2))


def test_on_coefficients_bound_to_its_source_needs_rank_and_dims_once():
  track = fo.low_rank_track(rank=3, interval=2, dims=fo.MatrixDims())
  assert (track.rank, track.dims) == (3, fo.MatrixDims())
  bound = optax.chain(track, track.on_coefficients(optax.scale_by_adam()), fo.project_back())
  free = optax.chain(fo.low_rank_track(rank=3, interval=2, dims=fo.MatrixDims()),
                     fo.on_coefficients(optax.scale_by_adam(), rank=3, dims=fo.MatrixDims()),
                     fo.project_back())
  p = {"w": jnp.zeros((2, 6, 10))}
  g = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 10)), jnp.float32)}
  ub, _ = bound.update(g, bound.init(p), p)
  uf, _ = free.update(g, free.init(p), p)
  np.testing.assert_array_equal(np.asarray(ub["w"]), np.asarray(uf["w"]))
  proj = fo.random_project(rank=2)
  assert proj.rank == 2 and proj.on_coefficients(optax.identity()) is not None
  # a stateful transformation outside on_coefficients fails loudly (its state is dense)
  bad = optax.chain(track, optax.scale_by_adam(), fo.project_back())
  with pytest.raises(ValueError, match="Subspace"):
    bad.update(g, bad.init(p), p)


def _coefficients_and_state(source):
  """``source.update`` returning the coefficients (arrays) instead of the messages, so it
  can be jitted on its own."""
  def run(g, s):
    out, s = source.update(g, s)
    return jax.tree.map(lambda m: m.coeffs, out, is_leaf=fo.blocks.subspace.is_subspace), s
  return run


def test_refresh_grouped_by_shape_equals_each_leaf_alone():
  """The refresh serves same-shape matrices of several leaves in one call
  (``grouping.map_grouped``): every leaf's basis and coefficients equal those of the
  same block run on that leaf alone, and the state holds statistics only (no int32
  layout arrays besides the step counter)."""
  params = {"a": jnp.zeros((6, 9)), "b": jnp.zeros((2, 6, 11)), "c": jnp.zeros((6, 9))}
  tx = fo.low_rank_track(rank=3, interval=2, b3=0.9, dims=fo.MatrixDims(),
                         refresh=fo.svd_refresh())
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32),
                        params) for _ in range(3)]
  step = jax.jit(_coefficients_and_state(tx))
  st = tx.init(params)
  ints = [x for x in jax.tree.leaves(st) if jnp.issubdtype(x.dtype, jnp.integer)]
  assert len(ints) == 1 and ints[0].shape == ()
  for g in grads:
    out, st = step(g, st)
  for k in params:
    alone = fo.low_rank_track(rank=3, interval=2, b3=0.9, dims=fo.MatrixDims(),
                              refresh=fo.svd_refresh())
    s1 = alone.init({k: params[k]})
    for g in grads:
      o1, s1 = jax.jit(_coefficients_and_state(alone))({k: g[k]}, s1)
    np.testing.assert_allclose(st.basis[k], s1.basis[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[k], o1[k], rtol=1e-5, atol=1e-5)
