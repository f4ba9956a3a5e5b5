"""A small LLaMA in Flax NNX: RMSNorm, rotary embeddings, SwiGLU MLP, causal attention,
untied output layer (as the LLaMA models of the paper's experiments)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  hidden: int
  intermediate: int
  heads: int
  layers: int
  context: int = 256
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  dtype: str = "float32"        # activations
  param_dtype: str = "float32"  # weights

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads

  def num_params(self) -> int:
    h, i, v, l = self.hidden, self.intermediate, self.vocab_size, self.layers
    return 2 * v * h + l * (4 * h * h + 3 * h * i + 2 * h) + h


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope(x, theta: float):
  """Rotary position embedding on ``x`` of shape [batch, time, heads, head_dim]."""
  t, d = x.shape[1], x.shape[-1]
  freqs = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  x1, x2 = x[..., : d // 2].astype(jnp.float32), x[..., d // 2:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


def _linear(din, dout, cfg, rngs):
  return nnx.Linear(din, dout, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    h = cfg.hidden
    self.q_proj = _linear(h, h, cfg, rngs)
    self.k_proj = _linear(h, h, cfg, rngs)
    self.v_proj = _linear(h, h, cfg, rngs)
    self.o_proj = _linear(h, h, cfg, rngs)
    self.cfg = cfg

  def __call__(self, x):
    b, t, _ = x.shape
    nh, hd = self.cfg.heads, self.cfg.head_dim
    q = rope(self.q_proj(x).reshape(b, t, nh, hd), self.cfg.rope_theta)
    k = rope(self.k_proj(x).reshape(b, t, nh, hd), self.cfg.rope_theta)
    v = self.v_proj(x).reshape(b, t, nh, hd)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(y.reshape(b, t, nh * hd))


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg.hidden, cfg.intermediate, cfg, rngs)
    self.up_proj = _linear(cfg.hidden, cfg.intermediate, cfg, rngs)
    self.down_proj = _linear(cfg.intermediate, cfg.hidden, cfg, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.param_dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """Parameter paths: ``embed/embedding``, ``layers/<i>/...``, ``norm``, ``lm_head/kernel``."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype,
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.param_dtype)
    self.lm_head = _linear(cfg.hidden, cfg.vocab_size, cfg, rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.norm(x)).astype(jnp.float32)
