"""Routing of models written in the style of public code: a Gemma-style NNX attention
(``nnx.Einsum`` and a Gemma ``Einsum`` module of its own), an lm1b-style Linen model
under a ``TrainState`` (DenseGeneral attention kernels, ``nn.scan`` layers), a Linen
conv net, and an Equinox transformer block (``(out, in)`` weights, stacked with
``eqx.filter_vmap``). Each test asserts the matrix view that ``fo.describe`` reports for
every kernel (``batch x fan-in x fan-out``), not only that a step runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo
from fisher_optax import matrices, model_dims

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")

D, N, K, HD, F, V, L = 16, 4, 2, 8, 32, 50, 3


def views(tx, params) -> dict:
  return {r.path: (r.rule, r.view) for r in fo.describe(tx, params).rows}


# ------------------------------------------------------------------ einsum specs


@pytest.mark.parametrize("spec,ndim,want", [
    ("BTD,NDH->BTNH", 3, fo.MatrixDims(rows=(1,), cols=(0, 2))),          # Gemma q
    ("BSD,CKDH->CBSKH", 4, fo.MatrixDims(rows=(2,), cols=(1, 3))),        # Gemma kv
    ("BTD,SNDH->SBTNH", 4, fo.MatrixDims(rows=(2,), cols=(1, 3))),        # Gemma qkv
    ("BTNH,NHD->BTD", 3, fo.MatrixDims(rows=(0, 1), cols=(2,))),          # attn_vec
    ("...F,NHF->...NH", 3, fo.MatrixDims(rows=(2,), cols=(0, 1))),        # ellipsis, no shape
    ("ij,jk", 2, fo.MatrixDims(rows=(0,), cols=(1,))),                    # implicit output
    ("btnh,nhd->btnd", 3, fo.MatrixDims(rows=(1,), cols=(2,))),           # n: batch axis
    ("BTD,D->BT", 1, fo.NOT_A_MATRIX),                                    # a vector
])
def test_einsum_dims_reads_the_spec(spec, ndim, want):
  assert model_dims.einsum_dims(spec, ndim) == want


@pytest.mark.parametrize("spec,shape,want", [
    ("...F,NFH->...NH", (2, 16, 32), fo.MatrixDims(rows=(1,), cols=(2,))),   # gate, up
    ("...F,NHF->...NH", (2, 32, 16), fo.MatrixDims(rows=(2,), cols=(1,))),   # transposed
    ("BTD,NDH->BTNH", (4, 16, 8), fo.MatrixDims(rows=(1,), cols=(0, 2))),    # 4 heads: one
    ("BSD,CKDH->CBSKH", (2, 2, 16, 8), fo.MatrixDims(rows=(2,), cols=(1, 3))),  # kv: C stack
    ("BD,ND->BN", (2, 16), fo.MatrixDims(rows=(1,), cols=(0,))),             # only column
])
def test_a_leading_pair_of_projections_is_two_matrices(spec, shape, want):
  """The stated rule: with the weight's shape, a first axis of size 2 that the output
  keeps beside another output axis stacks two projections (Gemma's gate and up)."""
  assert model_dims.einsum_dims(spec, len(shape), shape=shape) == want


@pytest.mark.parametrize("spec,ndim,why", [
    ("BTD,...DH->BTH", 2, "ellipsis"), ("BTD,NDH->BTNH", 4, "do not match"),
    ("BTD,NDHZ->BTNH", 4, "summed within"), ("BTD->BT", 2, "two operands")])
def test_einsum_dims_says_why_it_cannot_read_a_spec(spec, ndim, why):
  d = model_dims.einsum_dims(spec, ndim)
  assert isinstance(d, fo.Unclassified) and why in d.reason


# ------------------------------------------------------------- Gemma-style NNX


class GemmaEinsum(nnx.Module):
  """Gemma's own parametrized einsum: the spec is given at call time in Gemma, here an
  attribute ``einsum_str`` as in the Flax Gemma example's layers."""

  def __init__(self, einsum_str, shape, rngs):
    self.einsum_str = einsum_str
    self.w = nnx.Param(jax.random.normal(rngs.params(), shape) * 0.1)

  def __call__(self, x):
    return jnp.einsum(self.einsum_str, x, self.w[...])


class GemmaAttention(nnx.Module):
  def __init__(self, rngs):
    self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (N, D, HD), rngs=rngs)
    self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, K, D, HD), rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (N, HD, D), rngs=rngs)

  def __call__(self, x):
    q = self.q_einsum(x)
    k, v = self.kv_einsum(x)
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    w = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(HD), axis=-1)
    return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", w, v))


class GemmaBlock(nnx.Module):
  def __init__(self, rngs):
    self.pre_attention_norm = nnx.RMSNorm(D, rngs=rngs)
    self.attn = GemmaAttention(rngs)
    self.pre_ffw_norm = nnx.RMSNorm(D, rngs=rngs)
    self.gating_einsum = GemmaEinsum("...F,NHF->...NH", (2, F, D), rngs)
    self.linear = GemmaEinsum("...H,HF->...F", (F, D), rngs)

  def __call__(self, x):
    x = x + self.attn(self.pre_attention_norm(x))
    gate, up = jnp.moveaxis(self.gating_einsum(self.pre_ffw_norm(x)), -2, 0)
    return x + self.linear(jax.nn.gelu(gate) * up)


class Gemma(nnx.Module):
  def __init__(self, rngs):
    self.embedder = nnx.Embed(V, D, rngs=rngs)
    self.layer = GemmaBlock(rngs)
    self.final_norm = nnx.RMSNorm(D, rngs=rngs)

  def __call__(self, tokens):
    x = self.layer(self.embedder(tokens))
    return self.embedder.attend(self.final_norm(x))


def test_gemma_style_nnx_attention_routes_every_einsum_kernel():
  model = Gemma(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  got = views(fo.muon(1e-2, dims=fo.flax_dims(model)), params)
  assert got["layer/attn/q_einsum/kernel"] == ("muon", f"{D} x {N * HD}")
  assert got["layer/attn/kv_einsum/kernel"] == ("muon", f"2 x {D} x {K * HD}")  # k and v
  assert got["layer/attn/attn_vec_einsum/kernel"] == ("muon", f"{N * HD} x {D}")
  assert got["layer/gating_einsum/w"] == ("muon", f"2 x {D} x {F}")  # gate and up
  assert got["layer/linear/w"] == ("muon", f"{F} x {D}")
  assert got["embedder/embedding"] == ("fallback", "embedding")  # as the paper: Adam
  for k in ("layer/pre_attention_norm/scale", "layer/pre_ffw_norm/scale", "final_norm/scale"):
    assert got[k] == ("fallback", "-"), k
  assert fo.describe(fo.muon(1e-2, dims=fo.flax_dims(model)), params).unclassified == ()

  # and a step trains through the routed kernels
  optimizer = nnx.Optimizer(model, fo.muon(1e-2, dims=fo.flax_dims(model)), wrt=nnx.Param)
  tokens = jnp.arange(12).reshape(2, 6) % V

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(5)]
  assert np.isfinite(losses).all() and losses[-1] < losses[0]


class Mystery(nnx.Module):
  def __init__(self, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (4, D, 8)))


def test_a_kernel_the_rule_cannot_classify_is_flagged_and_overrides_route_it():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.mystery = Mystery(rngs)
      self.out = nnx.Linear(D, 4, rngs=rngs)

  model = Net(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  rule = fo.flax_dims(model)
  assert list(rule.unclassified) == ["mystery/kernel"]
  desc = fo.describe(fo.racs(1e-2, dims=rule), params)
  row = {r.path: r for r in desc.rows}["mystery/kernel"]
  assert row.rule == "fallback" and row.view == "? unclassified"
  assert desc.unclassified == ("mystery/kernel",)
  assert "mystery/kernel: 3-D parameter of Mystery" in desc.note and "overrides=" in desc.note
  assert "? unclassified" in str(desc)

  fixed = fo.flax_dims(model, overrides={r"mystery/kernel$": fo.MatrixDims(rows=1, cols=2)})
  assert views(fo.racs(1e-2, dims=fixed), params)["mystery/kernel"] == ("racs", f"4 x {D} x 8")
  with pytest.raises(ValueError, match="matches no parameter path"):
    fo.flax_dims(model, overrides={"mistery": fo.NOT_A_MATRIX})


# ---------------------------------------------------------- lm1b-style Linen


class Lm1bBlock(nn.Module):
  """lm1b's EncoderDecoder1DBlock: LayerNorm, MultiHeadDotProductAttention (DenseGeneral
  query/key/value/out), LayerNorm, MlpBlock (two Denses); here as an ``nn.scan`` body."""

  @nn.compact
  def __call__(self, x, _):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * HD)(y, y)
    x = x + y
    y = nn.LayerNorm()(x)
    y = nn.Dense(F, name="Dense_0")(y)
    y = nn.Dense(D, name="Dense_1")(nn.relu(y))
    return x + y, None


class Lm1b(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D, name="embed")(tokens)
    x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, 6, D))
    x, _ = nn.scan(Lm1bBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=L)(name="layers")(x, None)
    x = nn.LayerNorm(name="encoder_norm")(x)
    return nn.DenseGeneral(V, name="logits_dense")(x)


@pytest.mark.slow
def test_lm1b_style_linen_model_under_a_train_state():
  from flax.training import train_state
  module = Lm1b()
  tokens = jnp.zeros((2, 6), jnp.int32)
  variables = module.init(jax.random.key(0), tokens)
  rule = fo.linen_dims(module, tokens)
  tx = fo.alice(1e-2, rank=4, dims=rule)
  got = views(tx, variables["params"])
  a = "layers/MultiHeadDotProductAttention_0"
  for k in ("query", "key", "value"):
    assert got[f"{a}/{k}/kernel"] == ("alice", f"{L} x {D} x {N * HD}"), k
    assert got[f"{a}/{k}/bias"] == ("fallback", "-")
  assert got[f"{a}/out/kernel"] == ("alice", f"{L} x {N * HD} x {D}")
  assert got["layers/Dense_0/kernel"] == ("alice", f"{L} x {D} x {F}")
  assert got["layers/Dense_1/kernel"] == ("alice", f"{L} x {F} x {D}")
  assert got["embed/embedding"] == ("fallback", "embedding")  # as the paper: Adam
  assert got["logits_dense/kernel"] == ("alice", f"{D} x {V}")
  # 3-D, of the model itself: the rule cannot tell, and says so
  assert got["pos_embedding"] == ("fallback", "? unclassified")
  for k in ("layers/LayerNorm_0/scale", "encoder_norm/bias"):
    assert got[k] == ("fallback", "-")
  # the whole variables dict resolves too
  assert views(tx, variables)["params/logits_dense/kernel"] == ("alice", f"{D} x {V}")

  state = train_state.TrainState.create(apply_fn=module.apply, params=variables["params"],
                                        tx=tx)

  @jax.jit
  def step(state):
    def loss_fn(p):
      logits = state.apply_fn({"params": p}, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  state, loss0 = step(state)
  for _ in range(4):
    state, loss = step(state)
  assert np.isfinite(float(loss)) and float(loss) < float(loss0)


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.ConvTranspose(4, (2, 2))(x)
    x = nn.BatchNorm(use_running_average=True)(x)
    x = nn.DenseGeneral((2, 5), axis=(-3, -2, -1), name="head")(x)
    return x.reshape(x.shape[0], -1)


def test_linen_conv_net():
  module = ConvNet()
  x = jnp.ones((2, 6, 6, 3))
  params = module.init(jax.random.key(0), x)["params"]
  got = views(fo.racs(1e-2, dims=fo.linen_dims(module, x)), params)
  assert got["Conv_0/kernel"] == ("racs", "27 x 8")                       # kh*kw*cin x cout
  assert got["ConvTranspose_0/kernel"] == ("racs", "32 x 4")              # kh*kw*cin x cout
  assert got["head/kernel"] == ("racs", f"{6 * 6 * 4} x 10")              # 3 in axes x 2 out
  for k in ("Conv_0/bias", "ConvTranspose_0/bias", "BatchNorm_0/scale", "head/bias"):
    assert got[k] == ("fallback", "-"), k


def test_flax_dims_names_the_right_helper():
  with pytest.raises(TypeError, match=r"Linen module: use fo\.linen_dims"):
    fo.flax_dims(nn.Dense(4))
  with pytest.raises(TypeError, match="not a parameter dict"):
    fo.flax_dims({"w": jnp.ones((2, 3))})
  with pytest.raises(TypeError, match=r"NNX model use fo\.flax_dims"):
    fo.linen_dims(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))


# ------------------------------------------------------------------- Equinox


eqx = pytest.importorskip("equinox")


class EqxBlock(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  ln1: eqx.nn.LayerNorm
  ln2: eqx.nn.LayerNorm
  up: eqx.nn.Linear
  down: eqx.nn.Linear

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.attn = eqx.nn.MultiheadAttention(N, D, key=k1)
    self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
    self.up = eqx.nn.Linear(D, F, key=k2)
    self.down = eqx.nn.Linear(F, D, key=k3)

  def __call__(self, x):
    y = jax.vmap(self.ln1)(x)
    x = x + self.attn(y, y, y)
    y = jax.vmap(self.ln2)(x)
    return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(y)


def test_equinox_transformer_block_and_a_stack_of_them():
  block = EqxBlock(jax.random.key(0))
  params = eqx.filter(block, eqx.is_inexact_array)
  got = views(fo.soap(1e-3, dims=fo.equinox_dims(block)), params)
  for k in ("query_proj", "key_proj", "value_proj", "output_proj"):
    assert got[f"attn/{k}/weight"] == ("soap", f"{D} x {D}"), k
  assert got["up/weight"] == ("soap", f"{D} x {F}")       # stored (F, D): fan-in D first
  assert got["down/weight"] == ("soap", f"{F} x {D}")
  for k in ("up/bias", "down/bias", "ln1/weight", "ln2/bias"):
    assert got[k] == ("fallback", "-"), k

  stack = eqx.filter_vmap(EqxBlock)(jax.random.split(jax.random.key(1), L))
  got = views(fo.muon(1e-2, dims=fo.equinox_dims(stack)), eqx.filter(stack, eqx.is_inexact_array))
  assert got["up/weight"] == ("muon", f"{L} x {D} x {F}")
  assert got["ln1/weight"] == ("fallback", "-")

  # a step on the filtered params, as Equinox's optax examples run one
  tx = fo.muon(1e-2, dims=fo.equinox_dims(block))
  state = tx.init(params)
  x = jax.random.normal(jax.random.key(2), (6, D))

  @eqx.filter_jit
  def step(model, state):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), state, loss

  block, state, loss0 = step(block, state)
  block, state, loss1 = step(block, state)
  assert float(loss1) < float(loss0)


@pytest.mark.parametrize("name", ["muon", pytest.param("soap", marks=pytest.mark.slow)])
def test_out_in_weight_with_its_dims_updates_as_the_transpose(name):
  """With ``dims`` naming the sides, an ``(out, in)`` weight gets exactly the transpose
  of the update of the same ``(in, out)`` weight (Muon's shape factor and SOAP's sides
  follow fan-in and fan-out, not the storage order)."""
  w = jax.random.normal(jax.random.key(0), (6, 10))     # (in, out)
  grads = [jax.random.normal(jax.random.key(i), (6, 10)) for i in range(1, 4)]
  make = lambda dims: getattr(fo, name)(1e-2, dims=dims)  # noqa: E731
  a, b = make(None), make(fo.MatrixDims(rows=-1, cols=-2))
  sa, sb = a.init({"w": w}), b.init({"w": w.T})
  for g in grads:
    ua, sa = a.update({"w": g}, sa, {"w": w})
    ub, sb = b.update({"w": g.T}, sb, {"w": w.T})
    np.testing.assert_allclose(ub["w"], ua["w"].T, rtol=1e-5, atol=1e-7)
  if name != "muon":
    # SOAP rotates both sides and is transpose-equivariant: read either way, its update
    # differs only by the arbitrary null-space columns of its step-1 bases.
    return
  # the default (in, out) reading of the (out, in) weight is another update: Muon's
  # shape factor sqrt(max(1, fan_out / fan_in)) follows the reading
  c = make(None)
  sc = c.init({"w": w.T})
  for g in grads:
    uc, sc = c.update({"w": g.T}, sc, {"w": w.T})
  assert not np.allclose(uc["w"], ua["w"].T, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------ describe, errors


def test_describe_under_multisteps_does_not_blame_the_rank():
  """``optax.MultiSteps``' gradient accumulator is counted in the state column, but
  ``!`` compares the named optimizer's own state with Adam's."""
  params = {"w": jnp.ones((8, 64))}
  tx = optax.MultiSteps(fo.racs(1e-2), every_k_schedule=4)
  desc = fo.describe(tx, params)
  row = desc.rows[0]
  assert row.state_numbers >= 8 * 64 and not row.above_adam and "!" not in str(desc)
  # a rank clipped to a small matrix still is flagged, with or without the wrapper
  small = {"w": jnp.ones((4, 4))}
  for t in (fo.alice(1e-2, rank=4, leading=1), optax.MultiSteps(fo.alice(1e-2, rank=4), 2)):
    assert fo.describe(t, small).above_adam == ("w",)


def test_a_dims_or_mask_tree_that_does_not_fit_names_the_leaf():
  params = {"a": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}, "c": jnp.ones((3, 3))}
  with pytest.raises(ValueError, match=re.escape("no entry for the leaf 'a/b'")):
    fo.racs(1e-2, dims={"a": {"w": fo.MatrixDims()}, "c": None}).init(params)
  with pytest.raises(ValueError, match=re.escape("entry 'a/x' is no parameter leaf")):
    fo.racs(1e-2, dims={"a": {"w": None, "b": None, "x": None}, "c": None}).init(params)
  with pytest.raises(ValueError, match=re.escape("`mask` does not match the params: it has "
                                                 "no entry for the leaf 'c'")):
    fo.racs(1e-2, mask={"a": {"w": True, "b": False}, "d": False}).init(params)


# ------------------------------------------------------------ the fallback


def test_fallback_learning_rate_sets_the_default_fallbacks_rate():
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}
  g = {"w": jnp.full((4, 6), 0.3), "b": jnp.linspace(-1.0, 1.0, 6)}

  def fallback_update(tx):
    u, _ = tx.update(g, tx.init(params), params)
    return u["b"]

  adam = lambda lr: optax.adam(lr).update(g["b"], optax.adam(lr).init(g["b"]))[0]  # noqa: E731
  np.testing.assert_allclose(fallback_update(fo.racs(2e-2)), adam(2e-2), rtol=1e-6)
  np.testing.assert_allclose(fallback_update(fo.racs(2e-2, fallback_learning_rate=1e-3)),
                             adam(1e-3), rtol=1e-6)
  sched = optax.linear_schedule(1e-3, 0.0, 10)
  np.testing.assert_allclose(fallback_update(fo.muon(2e-2, fallback_learning_rate=sched)),
                             adam(1e-3), rtol=1e-6)
  # the structured leaves do not change
  a, b = fo.racs(2e-2), fo.racs(2e-2, fallback_learning_rate=1e-3)
  np.testing.assert_array_equal(a.update(g, a.init(params), params)[0]["w"],
                                b.update(g, b.init(params), params)[0]["w"])
  with pytest.raises(ValueError, match="not both"):
    fo.racs(2e-2, fallback=optax.adam(1e-3), fallback_learning_rate=1e-3)


def test_kernels_without_dims_on_the_fallback_warn_at_init():
  params = {"attn": {"kernel": jnp.ones((8, 2, 4)), "bias": jnp.ones((2, 4))},
            "w": jnp.ones((8, 8))}
  with pytest.warns(UserWarning, match=r"fo.racs: 1 leaf with more than two dims "
                    r"\(e.g. 'attn/kernel' of shape \(8, 2, 4\)\).*fallback_learning_rate"):
    fo.racs(2e-2).init(params)
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fo.racs(2e-2, dims={"attn": {"kernel": fo.MatrixDims(rows=0, cols=(1, 2)), "bias": None},
                        "w": None}).init(params)                               # routed
    fo.racs(2e-2, mask={"attn": {"kernel": False, "bias": False}, "w": True}).init(params)
    fo.racs(2e-2).init({"w": jnp.ones((8, 8)), "scale": jnp.ones((3, 8, 8))})  # by name
