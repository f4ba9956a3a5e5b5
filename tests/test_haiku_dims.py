"""``fo.haiku_dims``: Haiku models routed from their parameter dict -- ``hk.Linear``,
``hk.MultiHeadAttention``, ``hk.Conv1D``/``Conv2D`` (HWIO) and their transposes,
``hk.Embed``, ``hk.layer_stack``, a ``hk.transform_with_state`` model -- and trained."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fisher_optax as fo

hk = pytest.importorskip("haiku")


def _forward(x, tokens):
  e = hk.Embed(64, 16)(tokens)
  h = jax.nn.gelu(hk.Linear(16)(x) + e)
  h = hk.MultiHeadAttention(num_heads=2, key_size=8,
                            w_init=hk.initializers.VarianceScaling(1.0))(h, h, h)
  h = hk.LayerNorm(-1, True, True)(h)
  c = hk.Conv1D(8, 3)(h)
  img = hk.Conv2D(4, (3, 3))(c[:, :, None, :].repeat(4, axis=2))
  up = hk.Conv2DTranspose(6, (3, 3))(img)
  deep = hk.layer_stack(3)(lambda z: jax.nn.tanh(hk.Linear(16)(z)))(h)
  bn = hk.BatchNorm(True, True, 0.9)(deep, is_training=True)
  return jnp.mean(up ** 2) + jnp.mean(bn ** 2)


MODEL = hk.transform_with_state(_forward)
X, T = jnp.ones((2, 5, 4)), jnp.ones((2, 5), jnp.int32)


def _params():
  params, state = MODEL.init(jax.random.key(0), X, T)
  return params, state


def test_haiku_dims_rule_table():
  params, _ = _params()
  table = fo.haiku_dims(params).table
  assert table["linear/w"] == fo.MatrixDims()
  for proj in ("query", "key", "value", "linear"):
    assert table[f"multi_head_attention/{proj}/w"] == fo.MatrixDims()
  assert table["conv1_d/w"] == fo.MatrixDims(rows=(0, 1), cols=2)          # (k, cin, cout)
  assert table["conv2_d/w"] == fo.MatrixDims(rows=(0, 1, 2), cols=3)       # HWIO
  assert table["conv2_d_transpose/w"] == fo.MatrixDims(rows=(0, 1, 3), cols=2)  # (.., cout, cin)
  assert table["embed/embeddings"] is fo.EMBEDDING  # the fallback, as the paper
  stacked = [k for k in table if k.endswith("linear/w") and "layer_stack" in k]
  assert stacked and table[stacked[0]] == fo.MatrixDims()  # (3, in, out): 3 layers
  for k, d in table.items():
    if k.endswith(("/b", "/scale", "/offset")):
      assert d == fo.NOT_A_MATRIX, k
  rows = {r.path: r for r in fo.describe(fo.muon(1e-2, dims=fo.haiku_dims(params)), params).rows}
  assert rows["conv2_d/w"].view == "72 x 4"
  assert rows[stacked[0]].view == "3 x 16 x 16"
  assert rows["layer_norm/scale"].rule == "fallback"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in ("racs", "alice")]
                         + ["muon"])
def test_haiku_model_trains_with_its_dims(name):
  """A few steps of a ``transform_with_state`` model: the loss goes down, the routed
  kernels move, no fallback warning."""
  import warnings
  params, state = _params()
  kw = dict(rank=4) if name == "alice" else {}
  tx = getattr(fo, name)(1e-2, dims=fo.haiku_dims(params),
                         fallback_learning_rate=1e-3, **kw)
  with warnings.catch_warnings():
    warnings.simplefilter("error", fo.FallbackWarning)
    opt = tx.init(params)

  @jax.jit
  def step(params, state, opt):
    (loss, state), g = jax.value_and_grad(
        lambda p: MODEL.apply(p, state, None, X, T), has_aux=True)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), state, opt, loss

  losses = []
  p = params
  for _ in range(5):
    p, state, opt, loss = step(p, state, opt)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert not np.allclose(p["conv2_d"]["w"], params["conv2_d"]["w"])


def test_haiku_dims_unknown_kernel_warns_and_bad_input_is_named():
  params = {"mixer": {"w": jnp.ones((2, 3, 4))}, "linear": {"w": jnp.ones((3, 4))}}
  rule = fo.haiku_dims(params)
  assert isinstance(rule.table["mixer/w"], fo.Unclassified)
  with pytest.warns(fo.FallbackWarning, match="'mixer/w'.*Haiku module 'mixer'"):
    fo.racs(1e-2, dims=rule).init(params)
  routed = fo.haiku_dims(params, overrides={"mixer/w": fo.MatrixDims(rows=(0, 1), cols=2)})
  assert routed.table["mixer/w"] == fo.MatrixDims(rows=(0, 1), cols=2)
  with pytest.raises(TypeError, match="Haiku's parameter dict"):
    fo.haiku_dims(jnp.ones((3, 4)))


@pytest.mark.parametrize("kind", ["zero", "nan"] + [
    pytest.param(k, marks=pytest.mark.slow) for k in ("tiny", "huge")])
def test_haiku_odd_shapes_and_bad_gradients(kind):
  """Degenerate Haiku leaves -- a scalar ``w``, a ``(1, n)`` linear, an empty conv, a
  bfloat16 kernel -- route without error, and zero / tiny / huge / NaN gradients give
  updates of the leaves' shapes and dtypes (finite where the gradient is)."""
  params = {"linear": {"w": jnp.ones((1, 8)), "b": jnp.zeros((8,))},
            "odd": {"w": jnp.ones(())},
            "conv2_d": {"w": jnp.ones((3, 3, 0, 4))},
            "linear_1": {"w": jnp.ones((8, 6), jnp.bfloat16)}}
  rule = fo.haiku_dims(params)
  assert rule.table["odd/w"] == fo.NOT_A_MATRIX
  assert rule.table["conv2_d/w"] == fo.MatrixDims(rows=(0, 1, 2), cols=3)
  fill = {"zero": 0.0, "tiny": 1e-30, "huge": 1e30, "nan": float("nan")}[kind]
  grads = jax.tree.map(lambda p: jnp.full(p.shape, fill, p.dtype), params)
  for tx in (fo.racs(1e-2, dims=rule), fo.alice(1e-2, rank=2, dims=rule)):
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
      assert u.shape == p.shape and u.dtype == p.dtype
      if kind != "nan":
        assert bool(jnp.all(jnp.isfinite(u.astype(jnp.float32))))
