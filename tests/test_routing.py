"""Masks, path patterns and matrix views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from fisher_optax import matrices, routing


def test_default_mask_selects_matrices_with_both_dims_above_one():
  params = {"w": jnp.zeros((3, 4)), "col": jnp.zeros((5, 1)), "b": jnp.zeros(3),
            "s": jnp.zeros(()), "stack": jnp.zeros((2, 3, 4))}
  mask = fo.default_mask(params)
  # more than two dims: a stack, an attention or a conv kernel? only dims= can tell
  assert mask == {"w": True, "col": False, "b": False, "s": False, "stack": False}
  mask = fo.default_mask(params, fo.MatrixDims())
  assert mask == {"w": True, "col": False, "b": False, "s": False, "stack": True}
  # a path_mask without dims uses the optimizer's
  assert fo.path_mask(exclude=["w"]).resolve(params)["stack"] is False
  assert routing.resolve_mask(fo.path_mask(exclude=["w"]), params, fo.MatrixDims())["stack"]


def test_path_mask_include_exclude():
  params = {"embed": {"embedding": jnp.zeros((9, 4))},
            "layers": {"attn": {"kernel": jnp.zeros((4, 4))}, "mlp": {"kernel": jnp.zeros((4, 8))}},
            "lm_head": {"kernel": jnp.zeros((4, 9))}, "norm": jnp.zeros(4)}
  m = fo.path_mask(exclude=["embed", "lm_head"]).resolve(params)
  assert m["embed"]["embedding"] is False and m["lm_head"]["kernel"] is False
  assert m["layers"]["attn"]["kernel"] is True and m["norm"] is False
  m = fo.path_mask(include=[r"layers/mlp"]).resolve(params)
  assert m["layers"]["mlp"]["kernel"] and not m["layers"]["attn"]["kernel"]


@pytest.mark.parametrize("shape,dims,transpose,m,n,batch", [
    ((4, 9), None, False, 4, 9, ()),
    ((9, 4), None, True, 4, 9, ()),
    ((2, 9, 4), None, True, 4, 9, (2,)),
    ((9, 2, 4), fo.MatrixDims(rows=0, cols=2), True, 4, 9, (2,)),
])
def test_matrix_view_round_trip(shape, dims, transpose, m, n, batch):
  v = matrices.matrix_view(shape, dims, smaller_first=True)
  assert (v.transpose, v.m, v.n, v.batch_shape) == (transpose, m, n, batch)
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  c = v.to_canonical(x)
  assert c.shape == batch + (m, n)
  np.testing.assert_array_equal(v.from_canonical(c), x)


def test_bad_dims_are_clear_errors():
  with pytest.raises(ValueError, match="must differ"):
    matrices.matrix_view((3, 4), fo.MatrixDims(rows=1, cols=-1))
  with pytest.raises(ValueError, match="out of range"):
    matrices.matrix_view((3, 4), fo.MatrixDims(rows=0, cols=5))
