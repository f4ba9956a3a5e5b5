"""Routing of real Flax NNX models: layer stacks from nnx.vmap, attention and conv
kernels merged into fan_in x fan_out matrices, vectors to the fallback, the routing
report, loud errors, and optax.inject_hyperparams without static arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo

nnx = pytest.importorskip("flax.nnx")

L, D, H = 3, 16, 4


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, D, rngs=rngs)
    self.ln = nnx.LayerNorm(D, rngs=rngs)


class Model(nnx.Module):
  def __init__(self, rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
      return Block(nnx.Rngs(key))
    self.blocks = make(jax.random.split(jax.random.PRNGKey(0), L))
    self.mha = nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=D,
                                      decode=False, rngs=rngs)
    self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
    self.embed = nnx.Embed(10, 8, rngs=rngs)


@pytest.fixture(scope="module")
def model():
  return Model(nnx.Rngs(0))


def test_flax_dims_rule_table_leaf_by_leaf(model):
  t = fo.flax_dims(model).table
  M = fo.MatrixDims
  assert t["blocks/lin/kernel"] == M(rows=1, cols=2)          # layer axis 0 is a batch axis
  for k in ("blocks/lin/bias", "blocks/ln/scale", "blocks/ln/bias", "conv/bias"):
    assert t[k] is fo.NOT_A_MATRIX
  for k in ("query", "key", "value"):
    assert t[f"mha/{k}/kernel"] == M(rows=(0,), cols=(1, 2))   # in x heads*head_dim
    assert t[f"mha/{k}/bias"] is fo.NOT_A_MATRIX
  assert t["mha/out/kernel"] == M(rows=(0, 1), cols=(2,))     # heads*head_dim x out
  assert t["conv/kernel"] == M(rows=(0, 1, 2), cols=3)        # kh*kw*cin x cout
  assert t["embed/embedding"] == M(rows=0, cols=1)


def test_describe_reports_merged_views_and_state_of_one_matrix(model):
  params = nnx.state(model, nnx.Param)
  tx = fo.alice(1e-2, rank=4, leading=1, dims=fo.flax_dims(model))
  rows = {r.path: r for r in fo.describe(tx, params).rows}
  assert rows["mha/query/kernel"].view == f"{D} x {D}" and rows["mha/query/kernel"].rank == 4
  assert rows["conv/kernel"].view == "8 x 27"
  assert rows["blocks/lin/kernel"].view == f"{L} x 8 x {D}"
  assert rows["blocks/ln/scale"].rule == "fallback"
  # one 16 x 16 matrix: Alice's m r + r^2 + 2 n r + n + 1 (README table)
  m = n = D
  r = 4
  assert rows["mha/query/kernel"].state_numbers == m * r + r * r + 2 * n * r + n + 1
  text = str(fo.describe(tx, params))
  assert "mha/out/kernel" in text and "of Adam's" in text
  # the default rule (no flax_dims) reads the attention kernel as a stack: flagged
  assert "*" in str(fo.describe(fo.racs(1e-2), params))


def test_stacked_model_updates_equal_the_unstacked_models(model):
  """For deterministic optimizers the nnx.vmap-stacked layers get, layer by layer, the
  updates that separate (unstacked) layers get."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  stacked = {"lin": params["blocks"]["lin"], "ln": params["blocks"]["ln"]}
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(x.size), x.shape),
                       stacked)
  layers = [jax.tree.map(lambda x: x[i], stacked) for i in range(L)]
  layer_grads = [jax.tree.map(lambda x: x[i], grads) for i in range(L)]
  flat = {f"l{i}": p for i, p in enumerate(layers)}
  flat_g = {f"l{i}": g for i, g in enumerate(layer_grads)}
  for name, kw in [("racs", {}), ("galore", dict(rank=4)), ("eigen_adam", {}),
                   ("shampoo", dict(eps=0.1)), ("swan", {}), ("muon", {})]:
    tx = getattr(fo, name)(1e-2, **kw)
    u_s, _ = tx.update(grads, tx.init(stacked), stacked)
    u_f, _ = tx.update(flat_g, tx.init(flat), flat)
    for i in range(L):
      for leaf in ("kernel", "bias"):
        np.testing.assert_allclose(np.asarray(u_s["lin"][leaf][i]),
                                   np.asarray(u_f[f"l{i}"]["lin"][leaf]), rtol=2e-5,
                                   atol=1e-7, err_msg=f"{name} {leaf}")


def test_a_large_gradient_in_one_layer_stays_in_that_layer():
  """Stacked norm scales ``[4, 64]`` are vectors (fallback), so a x100 gradient in layer 1
  leaves the other layers' updates unchanged (RACS once mixed them: 0.01 -> 1.33)."""
  params = {"ln_scale": jnp.ones((4, 64)), "mha_bias": jnp.ones((4, 16)),
            "w": jnp.ones((4, 64, 64))}
  g = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(0), x.shape), params)
  g100 = dict(g, ln_scale=g["ln_scale"].at[1].multiply(100.0))
  tx = fo.racs(0.01)
  assert fo.default_mask(params) == {"ln_scale": False, "mha_bias": False, "w": True}
  u, _ = tx.update(g, tx.init(params), params)
  u100, _ = tx.update(g100, tx.init(params), params)
  keep = np.array([0, 2, 3])
  np.testing.assert_array_equal(np.asarray(u["ln_scale"])[keep],
                                np.asarray(u100["ln_scale"])[keep])
  assert float(jnp.max(jnp.abs(u100["ln_scale"]))) < 0.011


def test_merged_dims_equal_the_reshaped_matrix():
  k = jax.random.normal(jax.random.PRNGKey(1), (D, H, D // H))
  g = jax.random.normal(jax.random.PRNGKey(2), (D, H, D // H))
  tx3 = fo.racs(1e-2, dims=fo.MatrixDims(rows=0, cols=(1, 2)))
  tx2 = fo.racs(1e-2)
  u3, s3 = tx3.update({"k": g}, tx3.init({"k": k}), {"k": k})
  u2, s2 = tx2.update({"k": g.reshape(D, D)}, tx2.init({"k": k.reshape(D, D)}),
                      {"k": k.reshape(D, D)})
  np.testing.assert_allclose(np.asarray(u3["k"]).reshape(D, D), np.asarray(u2["k"]),
                             rtol=1e-6)
  assert fo.state_numbers(s3) == fo.state_numbers(s2)


def test_loud_errors_name_the_argument_and_the_leaf():
  with pytest.raises(ValueError, match="leaf 'w' of shape \\(8, 12\\)"):
    fo.racs(0.01, dims=fo.MatrixDims(rows=0, cols=5)).init({"w": jnp.ones((8, 12))})
  with pytest.raises(ValueError, match="kernal"):
    fo.alice(0.01, mask=fo.path_mask(include=["kernal"])).init({"kernel": jnp.ones((8, 12))})
  with pytest.warns(UserWarning, match="kernal"):
    fo.racs(0.01, mask=fo.path_mask(include=["kernal"], on_unmatched="warn")).init(
        {"kernel": jnp.ones((8, 12))})
  with pytest.raises(ValueError, match="precondition_frequency"):
    fo.soap(1e-3, precondition_frequency=0)
  with pytest.raises(ValueError, match="alpha_c"):
    fo.alice(1e-3, alpha_c=-1.0)
  # Python scalars work as with optax.adam
  tx = fo.racs(0.01)
  u, _ = tx.update({"s": 1.0, "w": jnp.ones((3, 4))}, tx.init({"s": 3.0, "w": jnp.ones((3, 4))}),
                   {"s": 3.0, "w": jnp.ones((3, 4))})
  ref, _ = optax.adam(0.01).update({"s": 1.0}, optax.adam(0.01).init({"s": 3.0}))
  np.testing.assert_allclose(float(u["s"]), float(ref["s"]), rtol=1e-6)


@pytest.mark.parametrize("name", ["racs", "alice", "alice0", "galore", "fira", "apollo",
                                  "apollo_mini", "eigen_adam", "soap", "shampoo", "swan",
                                  "muon"])
def test_plain_optax_inject_hyperparams_at_defaults(name):
  """As optax's contrib common tests do: only rank-like arguments static."""
  static = ("rank",) if name in ("alice", "alice0", "galore", "fira", "apollo") else ()
  tx = optax.inject_hyperparams(getattr(fo, name), static_args=static)(learning_rate=0.1)
  params = {"w": jnp.ones((6, 16)), "b": jnp.ones(3)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for t in range(2):
    g = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(t), x.shape), params)
    u, state = step(g, state, params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
