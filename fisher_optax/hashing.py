"""Counter-based 32-bit hashing for the optimizers' random draws inside a compiled step.

A threefry hash (``jax.random``) compiles into about a dozen XLA:CPU kernels (~0.1 s of
code generation) wherever it appears; the draws made at a refresh of the low-rank blocks
(APOLLO's seed renewal, the switching complement columns) need only well-mixed words,
which MurmurHash3's 32-bit finaliser gives elementwise: two multiplies and three shifts,
fused with whatever reads them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

u32 = jnp.uint32


def mix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser (``fmix32``) of ``x + 0x9E3779B9`` (uint32,
  elementwise): a bijection of uint32 with full avalanche (each input bit flips each
  output bit with probability ~1/2), so distinct inputs give distinct, unrelated words."""
  x = jnp.asarray(x, u32) + u32(0x9E3779B9)
  x = (x ^ (x >> 16)) * u32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * u32(0xC2B2AE35)
  return x ^ (x >> 16)


def words(key: jax.Array, count: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``shape`` uint32 words for draw number ``count`` of ``key`` (a raw PRNG key array,
  ``jax.random.PRNGKey``): word ``i`` (row-major index) is
  ``mix32(mix32(i + b) ^ b)`` with ``b`` the hash of the key's words and ``count``.
  Within one draw the words are distinct (``mix32`` is a bijection of ``i + b``)."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):  # a typed key (jax.random.key)
    key = jax.random.key_data(key)
  key = jnp.ravel(key).astype(u32)
  b = mix32(jnp.asarray(count).astype(u32))
  for j in range(key.shape[0]):  # the key's (static) number of words
    b = mix32(b ^ key[j])
  i = jax.lax.iota(u32, max(1, math.prod(shape)))
  return mix32(mix32(i + b) ^ b).reshape(shape)
