"""Routing of real Flax NNX models: layer stacks from nnx.vmap, attention and conv
kernels merged into fan_in x fan_out matrices, vectors to the fallback, the routing
report, loud errors, and optax.inject_hyperparams without static arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo
from tests import registry

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
  assert t["embed/embedding"] is fo.EMBEDDING                  # the fallback, as the paper


def test_describe_reports_merged_views_and_state_of_one_matrix(model):
  params = nnx.state(model, nnx.Param)
  tx = fo.alice(1e-2, rank=4, leading=1, dims=fo.flax_dims(model))
  rows = {r.path: r for r in fo.describe(tx, params).rows}
  assert rows["mha/query/kernel"].view == f"{D} x {D}" and rows["mha/query/kernel"].rank == 4
  assert rows["conv/kernel"].view == "27 x 8"                  # fan-in x fan-out
  assert rows["blocks/lin/kernel"].view == f"{L} x 8 x {D}"
  assert rows["blocks/ln/scale"].rule == "fallback"
  # one 16 x 16 matrix: Alice's m r + r^2 + 2 n r + n + 1 (README table)
  m = n = D
  r = 4
  assert rows["mha/query/kernel"].state_numbers == m * r + r * r + 2 * n * r + n + 1
  text = str(fo.describe(tx, params))
  assert "mha/out/kernel" in text and "of Adam's" in text
  # the default rule (no dims) cannot tell a stack from an attention or conv kernel:
  # such leaves go to the fallback, flagged
  rows = {r.path: r for r in fo.describe(fo.racs(1e-2), params).rows}
  for k in ("mha/query/kernel", "mha/out/kernel", "conv/kernel", "blocks/lin/kernel"):
    assert rows[k].rule == "fallback" and rows[k].view == "? *", k
  # without a model rule an embedding table is a 2-D matrix: the structured rule, flagged
  assert rows["embed/embedding"].rule == "racs" and rows["embed/embedding"].embedding
  assert "~ embed/embedding" in fo.describe(fo.racs(1e-2), params).note
  assert "flax_dims" in fo.describe(fo.racs(1e-2), params).note


class LlamaBlock(nnx.Module):
  """A LLaMA-like block: attention projections, a biased MLP, RMSNorm and LayerNorm."""

  def __init__(self, rngs):
    lin = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)
    self.q, self.k, self.v, self.o = lin(D, D), lin(D, D), lin(D, D), lin(D, D)
    self.up, self.down = lin(D, 2 * D, bias=True), lin(2 * D, D, bias=True)
    self.attn_norm = nnx.RMSNorm(D, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(D, rngs=rngs)

  def __call__(self, x):
    h = self.attn_norm(x)
    x = x + self.o(self.q(h) * self.k(h) + self.v(h))
    return x + self.down(jax.nn.silu(self.up(self.mlp_norm(x))))


class ScanModel(nnx.Module):
  """Blocks created with nnx.vmap and applied with nnx.scan: every block parameter has a
  leading layer axis ``L``."""

  def __init__(self, rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
      return LlamaBlock(nnx.Rngs(key))
    self.blocks = make(jax.random.split(jax.random.PRNGKey(0), L))
    self.head = nnx.Linear(D, 10, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)
    return self.head(body(x, self.blocks))


class ListModel(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([LlamaBlock(rngs) for _ in range(L)])
    self.head = nnx.Linear(D, 10, rngs=rngs)

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return self.head(x)


# every optimizer whose update is a function of the gradients alone (no random draws:
# Alice's complement sampling is off with leading == rank; APOLLO's projections are random)


@pytest.fixture(scope="module")
def scan_and_list_models():
  scan = ScanModel(nnx.Rngs(0))
  x = jnp.ones((2, D))
  assert scan(x).shape == (2, 10)  # the scan-applied model runs
  lst = ListModel(nnx.Rngs(1))
  sp = nnx.to_pure_dict(nnx.state(scan, nnx.Param))
  lp = nnx.to_pure_dict(nnx.state(lst, nnx.Param))
  # the list model gets layer i of the stacked parameters
  lp = dict(lp, head=sp["head"],
            blocks={i: jax.tree.map(lambda a, i=i: a[i], sp["blocks"]) for i in range(L)})
  nnx.update(lst, lp)
  np.testing.assert_allclose(np.asarray(lst(x)), np.asarray(scan(x)), rtol=1e-5, atol=1e-6)
  return scan, lst


def test_scan_stacked_routing_leaf_by_leaf(scan_and_list_models):
  scan, _ = scan_and_list_models
  M = fo.MatrixDims
  t = fo.flax_dims(scan).table
  for k in ("q", "k", "v", "o", "up", "down"):
    assert t[f"blocks/{k}/kernel"] == M(rows=1, cols=2), k   # axis 0: the layer stack
  for k in ("up/bias", "down/bias", "attn_norm/scale", "mlp_norm/scale", "mlp_norm/bias"):
    assert t[f"blocks/{k}"] is fo.NOT_A_MATRIX, k
  params = nnx.state(scan, nnx.Param)
  rows = {r.path: r for r in fo.describe(fo.racs(1e-2, dims=fo.flax_dims(scan)), params).rows}
  assert rows["blocks/up/kernel"].view == f"{L} x {D} x {2 * D}"
  assert rows["blocks/down/kernel"].view == f"{L} x {2 * D} x {D}"  # fan-in x fan-out
  assert rows["blocks/attn_norm/scale"].rule == "fallback"
  assert rows["head/kernel"].view == f"{D} x 10"


@pytest.mark.parametrize("name", registry.params(
    [n for n in registry.NAMES if n not in registry.RANDOM], default=["galore"]))
def test_scan_stacked_model_updates_equal_the_unstacked_models(name, scan_and_list_models):
  """Three steps (a refresh at step 3): the scan-stacked model, routed by
  ``fo.flax_dims``, gets layer by layer the updates of the model with separate layers
  (the optimizers without random draws, or with their draws switched off)."""
  kw = registry.kwargs(name, dims=None, draw_free=True, rank=4)
  scan, lst = scan_and_list_models
  sp = nnx.to_pure_dict(nnx.state(scan, nnx.Param))
  lp = nnx.to_pure_dict(nnx.state(lst, nnx.Param))
  tx_s = getattr(fo, name)(1e-2, dims=fo.flax_dims(scan), **kw)
  tx_l = getattr(fo, name)(1e-2, dims=fo.flax_dims(lst), **kw)
  st_s, st_l = tx_s.init(sp), tx_l.init(lp)
  step_s, step_l = jax.jit(tx_s.update), jax.jit(tx_l.update)
  for t in range(3):
    g_s = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(x.size + t), x.shape),
                       sp)
    g_l = dict(head=g_s["head"],
               blocks={i: jax.tree.map(lambda a, i=i: a[i], g_s["blocks"]) for i in range(L)})
    u_s, st_s = step_s(g_s, st_s, sp)
    u_l, st_l = step_l(g_l, st_l, lp)
    for i in range(L):
      flat_s = jax.tree_util.tree_leaves_with_path(jax.tree.map(lambda a: a[i], u_s["blocks"]))
      flat_l = jax.tree_util.tree_leaves_with_path(u_l["blocks"][i])
      for (path, a), (_, b) in zip(flat_s, flat_l):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-5, atol=1e-7,
                                   err_msg=f"{name} step {t} layer {i} {path}")


def test_a_large_gradient_in_one_layer_stays_in_that_layer():
  """Stacked norm scales ``[4, 64]`` are vectors (fallback), so a x100 gradient in layer 1
  leaves the other layers' updates unchanged (RACS once mixed them: 0.01 -> 1.33)."""
  params = {"ln_scale": jnp.ones((4, 64)), "mha_bias": jnp.ones((4, 16)),
            "w": jnp.ones((4, 64, 64))}
  g = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(0), x.shape), params)
  g100 = dict(g, ln_scale=g["ln_scale"].at[1].multiply(100.0))
  tx = fo.racs(0.01, dims=fo.MatrixDims())
  assert fo.default_mask(params, fo.MatrixDims()) == {"ln_scale": False, "mha_bias": False,
                                                      "w": True}
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


@pytest.mark.parametrize("name", registry.params(registry.NAMES, default=["racs", "galore"]))
def test_plain_optax_inject_hyperparams_at_defaults(name):
  """As optax's contrib common tests do: only rank-like arguments static; the updates are
  the plain optimizer's (to the rounding of traced decay rates). A square matrix, so that
  SOAP's first basis (from one gradient's statistic) is unique."""
  static = tuple(k for k in ("rank",) if k in registry.CASES[name].kwargs)
  tx = optax.inject_hyperparams(getattr(fo, name), static_args=static)(learning_rate=0.1)
  plain = getattr(fo, name)(learning_rate=0.1)
  params = {"w": jnp.ones((8, 8)), "b": jnp.ones(3)}
  state, plain_state = tx.init(params), plain.init(params)
  step, plain_step = jax.jit(tx.update), jax.jit(plain.update)
  for t in range(2):
    g = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(t), x.shape), params)
    u, state = step(g, state, params)
    want, plain_state = plain_step(g, plain_state, params)
  for k in params:
    err = float(jnp.linalg.norm(u[k] - want[k]) / jnp.linalg.norm(want[k]))
    assert err < 1e-3, (k, err)
