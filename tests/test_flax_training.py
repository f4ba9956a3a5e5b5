"""A small Flax NNX model trains with every named optimizer (loss drops), at the
learning rates and settings of ``tests/registry.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fisher_optax as fo
from tests import registry


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.l1 = nnx.Linear(16, 48, rngs=rngs)
    self.l2 = nnx.Linear(48, 32, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.gelu(self.l1(self.embed(x))))


def _data():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 32, size=(256,))
  y = (3 * x + 7) % 32  # a deterministic token map to learn
  return jnp.asarray(x), jnp.asarray(y)


def _optimizer(name):
  if name == "adam":
    return optax.adam(3e-3)
  return getattr(fo, name)(**registry.CASES[name].train)


@pytest.mark.parametrize("name", ["adam"] + registry.params(default=["racs", "alice"]))
def test_small_flax_model_loss_drops(name):
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, _optimizer(name), wrt=nnx.Param)
  x, y = _data()

  @nnx.jit
  def step(model, opt, x, y):
    def loss_fn(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, x, y)) for _ in range(60)]
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], (name, losses[0], losses[-1])
