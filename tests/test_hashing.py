"""The counter-based hash behind the refresh draws (fisher_optax.hashing)."""

import jax
import jax.numpy as jnp
import numpy as np

from fisher_optax import hashing


def test_mix32_is_a_bijection_with_avalanche():
  x = jnp.arange(1 << 16, dtype=jnp.uint32) * jnp.uint32(40503)  # 65536 distinct inputs
  y = np.asarray(hashing.mix32(x))
  assert len(np.unique(y)) == len(y)
  # flipping one input bit flips each output bit with probability ~1/2
  for bit in (0, 7, 31):
    flipped = np.asarray(hashing.mix32(x ^ jnp.uint32(1 << bit)))
    ones = np.unpackbits((y ^ flipped).view(np.uint8)).mean()
    assert abs(ones - 0.5) < 0.01, (bit, ones)


def test_words_distinct_uniform_and_new_per_count_and_key():
  key = jax.random.PRNGKey(3)
  w = np.asarray(hashing.words(key, 5, (200, 300)))
  assert w.shape == (200, 300) and w.dtype == np.uint32
  assert len(np.unique(w)) == w.size  # a bijection of the word index within one draw
  np.testing.assert_allclose(np.unpackbits(w.view(np.uint8)).mean(), 0.5, atol=0.005)
  hist = np.bincount((w >> 28).ravel(), minlength=16) / w.size  # top 4 bits uniform
  np.testing.assert_allclose(hist, 1 / 16, atol=0.005)
  for other in (hashing.words(key, 6, (200, 300)),
                hashing.words(jax.random.PRNGKey(4), 5, (200, 300))):
    other = np.asarray(other)
    assert np.mean(other == w) < 1e-3
    # uncorrelated with the first draw
    assert abs(np.corrcoef(other.ravel().astype(np.float64), w.ravel().astype(np.float64))[0, 1]) < 0.01


def test_words_under_jit_and_typed_keys_agree():
  key = jax.random.PRNGKey(11)
  eager = hashing.words(key, 2, (4, 7))
  jitted = jax.jit(lambda k, c: hashing.words(k, c, (4, 7)))(key, jnp.int32(2))
  typed = hashing.words(jax.random.wrap_key_data(key), 2, (4, 7))
  np.testing.assert_array_equal(eager, jitted)
  np.testing.assert_array_equal(eager, typed)
