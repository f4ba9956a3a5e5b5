"""The products with a vector written as multiply-reduce (``fisher_optax.linalg``) equal
the matrix products, to float32 rounding."""

import jax.numpy as jnp
import pytest
import numpy as np

from fisher_optax import linalg


def _arrays(*shapes, seed=1):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def test_vec_mat_and_mat_vec_equal_the_matrix_products():
  a, v, w = _arrays((7, 5), (7,), (5,))
  np.testing.assert_allclose(linalg.vec_mat(v, a), v @ a, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(linalg.mat_vec(a, w), a @ w, rtol=1e-5, atol=1e-6)
  assert linalg.vec_mat(v, a).shape == (5,) and linalg.mat_vec(a, w).shape == (7,)


def test_project_rows_equals_the_matrix_product_at_every_rank():
  """``U^T A`` over a stack: rank 1 (APOLLO-mini, multiply-reduce) and rank 3."""
  for r in (1, 3):
    u, a = _arrays((2, 7, r), (2, 7, 5))
    got = linalg.project_rows(u, a)
    assert got.shape == (2, r, 5)
    np.testing.assert_allclose(got, jnp.swapaxes(u, -1, -2) @ a, rtol=1e-5, atol=1e-6)


def _on_row_blocks(fn, a, names, mesh, whole_out=False):
  """``fn(a)`` inside a ``shard_map`` with ``a``'s rows split over ``names`` of ``mesh``
  (``linalg.rows_split``): the blocks put back in order, or one device's result where
  it is the same on every device (``whole_out``)."""
  import jax
  from jax.sharding import PartitionSpec as P

  def body(x):
    with linalg.rows_split(names):
      return fn(x)
  out = P() if whole_out else P(names, None)
  return jax.shard_map(body, mesh=mesh, in_specs=P(names, None), out_specs=out,
                       check_vma=False)(a)


@pytest.mark.slow
@pytest.mark.parametrize("order", [("x",), ("b", "a")])
def test_reductions_over_rows_split_over_devices_give_the_whole_matrix_s(order):
  """A tall matrix's rows split in blocks over 8 CPU devices (one mesh axis, or two
  taken minor axis first): Cholesky QR, the shifted step, the canonical signs, rows
  picked by index, ``A^T B``, a function of the whole matrix and the complement columns
  equal those of the whole matrix, and so do the top left singular vectors (a
  tall-skinny QR where a device holds at least as many rows as columns, else the matrix
  gathered)."""
  import jax
  auto = jax.sharding.AxisType.Auto
  mesh = (jax.make_mesh((8,), ("x",), axis_types=(auto,)) if order == ("x",)
          else jax.make_mesh((2, 4), ("a", "b"), axis_types=(auto, auto)))
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((64, 6)), jnp.float32)
  u = linalg.cholesky_qr(a)
  cols = jnp.asarray([0, 5, 17, 40])
  cases = {
      "cholesky_qr": (linalg.cholesky_qr, False),
      "shifted_step": (lambda x: linalg.shifted_step(x, x), False),
      "canonical_signs": (linalg.canonical_signs, False),
      "take_rows": (lambda x: linalg.take_rows(x, jnp.asarray([3, 9, 63, 0])), True),
      "tdot": (lambda x: linalg.tdot(x, x), True),
      "on_whole_rows": (lambda x: linalg.on_whole_rows(
          lambda w: linalg.top_left_singular(w, 4), x), False),
      # a block of 8 rows: the tall-skinny QR (linalg.split_left_singular)
      "top_left_singular": (lambda x: linalg.top_left_singular(x, 4), False),
      # blocks of 2 rows, fewer than the 6 columns: gathered whole
      "top_left_singular_short_blocks": (lambda x: linalg.top_left_singular(x, 4), False),
      "complement_columns": (lambda x: linalg.complement_columns(x, cols), False),
      "total_rows": (lambda x: jnp.full((1,), linalg.total_rows(x.shape[0])), True),
  }
  for name, (fn, whole) in cases.items():
    arg = (u if name == "complement_columns" else -a if name == "canonical_signs"
           else a[:16] if name.endswith("short_blocks") else a)
    want = fn(arg)
    got = _on_row_blocks(fn, arg, order, mesh, whole_out=whole)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5,
                               err_msg=name)


@pytest.mark.parametrize("devices,names", [(8, ("x",)), (8, ("b", "a")), (6, ("x",))])
def test_split_left_singular_butterfly_and_gathered_give_the_singular_vectors(devices,
                                                                              names):
  """``linalg.split_left_singular`` over rows split in blocks of 8: over 8 devices (one
  mesh axis, or two taken minor axis first) the butterfly of ``n x n`` factors (collective
  permutes, no all-gather), over 6 the factors gathered; both give the whole matrix's
  left singular vectors, each up to its sign."""
  import jax
  from jax.sharding import PartitionSpec as P
  auto = jax.sharding.AxisType.Auto
  shape = (devices,) if len(names) == 1 else (2, 4)
  axis = ("x",) if len(names) == 1 else ("a", "b")
  mesh = jax.make_mesh(shape, axis, axis_types=(auto,) * len(shape),
                       devices=jax.devices()[:devices])
  a = _arrays((8 * devices, 6), seed=3)[0]
  fn = jax.jit(jax.shard_map(lambda x: linalg.split_left_singular(x, names), mesh=mesh,
                             in_specs=P(names, None), out_specs=P(names, None),
                             check_vma=False))
  got = np.asarray(fn(a))
  want = np.linalg.svd(np.asarray(a, np.float64), full_matrices=False)[0]
  np.testing.assert_allclose(np.abs(np.sum(got * want, axis=0)), 1.0, atol=1e-5)
  np.testing.assert_allclose(got.T @ got, np.eye(6), atol=1e-5)
  text = fn.lower(a).compile().as_text()
  butterfly = devices == 8
  assert ("collective-permute" in text) == butterfly
  assert ("all-gather" in text) != butterfly


def test_split_left_singular_on_zero_tiny_huge_and_nan_blocks():
  """The butterfly over 8 devices: a zero matrix gives finite orthonormal columns,
  entries scaled by 1e-30 or 1e30 the unscaled matrix's singular vectors (each up to its
  sign), and a NaN in one device's block NaN on every device, which the refresh's
  finite guard then replaces by the previous basis."""
  import jax
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:8])
  fn = jax.jit(jax.shard_map(lambda x: linalg.split_left_singular(x, ("x",)), mesh=mesh,
                             in_specs=P("x", None), out_specs=P("x", None),
                             check_vma=False))
  a = np.array(_arrays((64, 6), seed=4)[0])
  zero = np.asarray(fn(jnp.zeros_like(a)))
  assert np.isfinite(zero).all()
  np.testing.assert_allclose(zero.T @ zero, np.eye(6), atol=1e-6)
  want = np.linalg.svd(a.astype(np.float64), full_matrices=False)[0]
  for scale in (1e-30, 1e30):
    got = np.asarray(fn(jnp.asarray(a * scale, jnp.float32)))
    np.testing.assert_allclose(np.abs(np.sum(got * want, axis=0)), 1.0, atol=1e-5,
                               err_msg=str(scale))
  a[5, 2] = np.nan
  assert np.isnan(np.asarray(fn(jnp.asarray(a)))).all()
