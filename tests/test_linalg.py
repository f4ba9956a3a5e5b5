"""The products with a vector written as multiply-reduce (``fisher_optax.linalg``) equal
the matrix products, to float32 rounding."""

import jax.numpy as jnp
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
