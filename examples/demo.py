"""Quick demo: a small Flax NNX model trained with every fisher_optax optimizer and Adam.

    python examples/demo.py [--steps 150]

Prints the loss curve summary per optimizer and each optimizer's state size.
(The LLaMA pre-training example lives in examples/llama/.)
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fisher_optax as fo


class TokenMLP(nnx.Module):
  """Embedding -> 2 hidden layers -> logits: learns a fixed token-to-token map."""

  def __init__(self, vocab, width, rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.l1 = nnx.Linear(width, 4 * width, rngs=rngs)
    self.l2 = nnx.Linear(4 * width, width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, x):
    h = self.embed(x)
    h = h + self.l2(jax.nn.gelu(self.l1(h)))
    return self.head(h)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--vocab", type=int, default=256)
  args = ap.parse_args()

  rng = np.random.default_rng(0)
  perm = jnp.asarray(rng.permutation(args.vocab))
  adam_head = fo.path_mask(exclude=["embed", "head"])
  optimizers = {
      "adam": optax.adam(3e-3),
      "racs": fo.racs(0.02, alpha=0.5, mask=adam_head),
      "alice": fo.alice(0.02, rank=16, leading=4, interval=50),
      "alice0": fo.alice0(0.02, rank=16, leading=4, interval=50),
      "galore": fo.galore(0.02, rank=16, interval=50, scale=1.0),
      "fira": fo.fira(0.02, rank=16, interval=50, scale=1.0),
      "apollo": fo.apollo(0.02, rank=16, interval=50),
      "apollo_mini": fo.apollo_mini(0.02, interval=50),
      "eigen_adam": fo.eigen_adam(3e-3, interval=20),
      "soap": fo.soap(1e-2),
      "shampoo": fo.shampoo(0.1, eps=1e-4, interval=10),
  }
  print(f"{'optimizer':12s} {'loss@0':>8s} {'loss@25':>8s} {'loss@end':>9s} {'state KiB':>10s}"
        f" {'s/step':>8s}")
  for name, tx in optimizers.items():
    model = TokenMLP(args.vocab, 64, nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
      loss, grads = nnx.value_and_grad(
          lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
      opt.update(model, grads)
      return loss

    losses = []
    t0 = time.perf_counter()
    for t in range(args.steps):
      x = jnp.asarray(rng.integers(0, args.vocab, size=(512,)))
      losses.append(float(step(model, opt, x, perm[x])))
    dt = (time.perf_counter() - t0) / args.steps
    kib = fo.state_bytes(nnx.state(opt, nnx.optimizer.OptState)) / 1024
    print(f"{name:12s} {losses[0]:8.3f} {losses[25]:8.3f} {losses[-1]:9.3f} {kib:10.1f}"
          f" {dt:8.4f}")


if __name__ == "__main__":
  main()
