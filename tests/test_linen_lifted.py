"""``fo.linen_dims`` on modules under Flax's lifted transforms (``nn.jit``, ``nn.remat``,
``nn.scan``, ``nn.vmap``): the same rule on every call, before and after ``init``
(``nn.jit`` caches its traced body; a second trace with the same shapes would otherwise
call no submodule)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fisher_optax as fo

D = 32


class Attn(nn.Module):
  """Gemma-like: a query projection, a conv and an output projection."""

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((4, 8))(x)
    c = nn.Conv(16, (3,))(x)
    return nn.DenseGeneral(D, axis=(-2, -1))(q) + c.sum(-1, keepdims=True)


class Jitted(nn.Module):
  @nn.jit
  @nn.compact
  def __call__(self, x):
    return Attn()(x)


class Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(Attn)()(x)


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return Attn()(x), None


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3)
    return stack()(x, None)[0]


class Vmapped(nn.Module):
  @nn.compact
  def __call__(self, x):
    many = nn.vmap(Attn, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=None, axis_size=2)
    return many()(x).sum(0)


def _want(prefix, layers):
  """The expected rule: ``layers`` leading batch axes from scan/vmap."""
  k = layers
  return {f"{prefix}DenseGeneral_0/kernel": fo.MatrixDims(rows=(k,), cols=(k + 1, k + 2)),
          f"{prefix}DenseGeneral_1/kernel": fo.MatrixDims(rows=(k, k + 1), cols=(k + 2,)),
          f"{prefix}Conv_0/kernel": fo.MatrixDims(rows=(k, k + 1), cols=k + 2)}


@pytest.mark.parametrize("module,prefix,layers", [
    (Jitted(), "Attn_0/", 0), (Remat(), "CheckpointAttn_0/", 0),
    (Scanned(), "ScanLayer_0/Attn_0/", 1), (Vmapped(), "VmapAttn_0/", 1)])
def test_linen_dims_is_the_same_before_and_after_init_and_on_every_call(module, prefix, layers):
  x = jnp.ones((2, 5, D))
  first = fo.linen_dims(module, x).table
  second = fo.linen_dims(module, x).table
  module.init(jax.random.key(0), x)
  after = fo.linen_dims(module, x).table
  assert first == second == after
  for path, dims in _want(prefix, layers).items():
    assert first[path] == dims, (path, first)


def test_overrides_on_unmatched_and_overrides_that_do_not_fit():
  """``on_unmatched`` as ``path_mask``'s; an override that does not fit its leaf raises
  when the rule is built, naming the leaf (an einsum spec of another rank included)."""
  import warnings

  from flax import nnx

  class Two(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 2, 8)))

  model = Two()
  extra = {"^w$": fo.MatrixDims(rows=0, cols=2), "q_einsum": fo.MatrixDims()}
  with pytest.raises(ValueError, match="'q_einsum' matches no parameter path.*on_unmatched"):
    fo.flax_dims(model, overrides=extra)
  with pytest.warns(UserWarning, match="'q_einsum' matches no parameter path"):
    rule = fo.flax_dims(model, overrides=extra, on_unmatched="warn")
  assert rule.table["w"] == fo.MatrixDims(rows=0, cols=2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert fo.flax_dims(model, overrides=extra, on_unmatched="ignore").table == rule.table
  with pytest.raises(ValueError, match="on_unmatched"):
    fo.flax_dims(model, overrides=extra, on_unmatched="skip")
  with pytest.raises(ValueError, match=r"overrides\['\^w\$'\] for leaf 'w' does not fit it: "
                                       r"einsum 'BTD,NDH->BTNH'"):
    fo.flax_dims(model, overrides={"^w$": fo.einsum_dims("BTD,NDH->BTNH", 4)})
  with pytest.raises(ValueError, match=r"for leaf 'w' of 3 axes.*out of range"):
    fo.flax_dims(model, overrides={"^w$": fo.MatrixDims(rows=0, cols=3)})
  with pytest.raises(ValueError, match=r"for leaf 'kernel' of 2 axes"):
    fo.linen_dims(nn.Dense(4), jnp.ones((1, 3)),
                  overrides={"kernel": fo.MatrixDims(rows=0, cols=(1, 2))})


def test_first_call_errors_for_the_usual_mistakes():
  params = {"w": jnp.ones((4, 4))}
  with pytest.raises(TypeError, match=r"must be a number or a schedule.*a string"):
    fo.racs("1e-2")
  with pytest.raises(TypeError, match="fallback_learning_rate"):
    fo.alice(1e-2, fallback_learning_rate="3e-4")
  with pytest.raises(TypeError, match=r"describe\(params, tx\)"):
    fo.describe(params, fo.racs(1e-2))
  with pytest.raises(TypeError, match="not a parameter dict"):
    fo.equinox_dims({"linear": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}})
  with pytest.raises(ValueError, match="no patterns"):
    fo.path_mask()
  with pytest.raises(TypeError, match="list of patterns"):
    fo.path_mask(exclude="embed")


# ------------------------------------------ einsum equations given at call time (gemma)


class Einsum(nn.Module):
  """The official ``gemma`` package's ``Einsum`` call convention: the equation is an
  argument of the call, not an attribute (``self.q_einsum('BTD,NDH->BTNH', x)``)."""
  shape: tuple

  @nn.compact
  def __call__(self, eqn, x):
    w = self.param("w", nn.initializers.normal(), self.shape)
    return jnp.einsum(eqn, x, w)


N, K, H, F = 4, 2, 8, 64


class GemmaBlock(nn.Module):
  @nn.jit  # gemma's Transformer.__call__ is jitted too
  @nn.compact
  def __call__(self, x):
    q = Einsum((N, D, H), name="q_einsum")("BTD,NDH->BTNH", x)
    k, _ = Einsum((2, K, D, H), name="kv_einsum")("BSD,CKDH->CBSKH", x)
    y = Einsum((N, H, D), name="attn_vec_einsum")("BTNH,NHD->BTD",
                                                  q + jnp.repeat(k, N // K, axis=2))
    gate = Einsum((2, F, D), name="gating_einsum")("...F,NHF->...NH", y)
    return Einsum((F, D), name="linear")("...H,HF->...F", gate[..., 0, :] * gate[..., 1, :])


class NamedEinsum(nn.Module):
  """gemma's ``Einsum`` with ``weight_name``, the MLP's: its weight is named after the
  einsum and lives in the parent's scope (``nn.share_scope``)."""
  shape: tuple
  weight_name: str = "w"

  @nn.compact
  def __call__(self, eqn, x):
    return jnp.einsum(eqn, x, self.param(self.weight_name, nn.initializers.normal(),
                                         self.shape))


class FeedForward(nn.Module):
  """gemma's ``FeedForward``: two einsums sharing its scope."""

  @nn.compact
  def __call__(self, x):
    gating = NamedEinsum((2, D, F), weight_name="gating_einsum")
    nn.share_scope(self, gating)
    gate = gating("...F,NFH->...NH", x)
    linear = NamedEinsum((F, D), weight_name="linear")
    nn.share_scope(self, linear)
    return linear("...H,HF->...F", gate[..., 0, :] * gate[..., 1, :])


def test_linen_dims_reads_einsums_that_share_their_parents_scope():
  module, x = FeedForward(), jnp.ones((2, 5, D))
  for i in range(3):  # twice, and after init
    if i == 2:
      module.init(jax.random.key(0), x)
    table = fo.linen_dims(module, x).table
    assert table["gating_einsum"] == fo.MatrixDims(rows=(1,), cols=(2,))  # gate, up: 2
    assert table["linear"] == fo.MatrixDims(rows=(0,), cols=(1,))


def test_linen_dims_reads_einsum_equations_passed_at_call_time():
  module, x = GemmaBlock(), jnp.ones((2, 5, D))
  for _ in range(2):  # the same on a second call (nn.jit)
    table = fo.linen_dims(module, x).table
    assert table["q_einsum/w"] == fo.MatrixDims(rows=(1,), cols=(0, 2))
    assert table["kv_einsum/w"] == fo.MatrixDims(rows=(2,), cols=(1, 3))  # C: a stack
    assert table["attn_vec_einsum/w"] == fo.MatrixDims(rows=(0, 1), cols=(2,))
    assert table["gating_einsum/w"] == fo.MatrixDims(rows=(2,), cols=(1,))  # gate, up: 2
    assert table["linear/w"] == fo.MatrixDims(rows=(0,), cols=(1,))
