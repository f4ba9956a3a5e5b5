"""Smoke test of an installed fisher_optax (run from outside the checkout): the package
imports, its version and type marker are there, and one jitted step of every named
optimizer runs on a small tree and moves the parameters."""

import importlib.metadata
import importlib.resources
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax

import fisher_optax as fo

here = pathlib.Path(fo.__file__).resolve()
assert "site-packages" in here.parts, f"fisher_optax imported from {here}, not the wheel"
assert importlib.metadata.version("fisher-optax") == fo.__version__
assert importlib.resources.files("fisher_optax").joinpath("py.typed").is_file()

NAMED = {
    "racs": {}, "alice": dict(rank=2), "alice0": dict(rank=2), "alice_soap": dict(rank=2),
    "galore": dict(rank=2), "fira": dict(rank=2), "apollo": dict(rank=2), "apollo_mini": {},
    "eigen_adam": {}, "soap": {}, "shampoo": {}, "swan": {}, "muon": {},
}
exported = {n for n in fo.__all__ if n in NAMED}
assert exported == set(NAMED), set(NAMED) ^ exported

params = {"w": jnp.ones((4, 6)), "stack": jnp.ones((2, 3, 5)), "b": jnp.zeros((6,))}


def grads(t):
  keys = jax.random.split(jax.random.PRNGKey(t), 3)
  return {k: jax.random.normal(key, p.shape) for key, (k, p) in zip(keys, params.items())}


for name, kw in NAMED.items():
  tx = getattr(fo, name)(1e-2, dims=fo.MatrixDims(), **kw)
  step = jax.jit(tx.update)
  new, state = params, tx.init(params)
  for t in range(2):
    updates, state = step(grads(t), state, new)
    new = optax.apply_updates(new, updates)
  moved = [bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))]
  assert all(moved), (name, moved)
  print(f"ok  {name}")
print(f"fisher_optax {fo.__version__} from the wheel: {len(NAMED)} optimizers, python "
      f"{sys.version.split()[0]}, jax {jax.__version__}")
