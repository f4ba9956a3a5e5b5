"""Every named optimizer's state holds statistics only, in optax's shape: optax's
``tree.map_params`` works on it, ``inject_hyperparams`` gives the same structure, and a
state from another parameter tree fails with a ValueError naming the leaf."""

import jax
import jax.numpy as jnp
import optax
import pytest

import fisher_optax as fo
from tests import registry

ALL = registry.NAMES

PARAMS = {"w": jnp.ones((6, 10)), "stack": jnp.ones((2, 8, 5)), "b": jnp.ones((6,))}


def _tx(name, **extra):
  return registry.make(name, **extra)


@pytest.mark.parametrize("name", ALL)
def test_tree_map_params_reaches_the_param_shaped_state(name):
  tx = _tx(name, stack_matrices=False)
  state = tx.init(PARAMS)
  mapped = optax.tree.map_params(tx, lambda p: "P", state, transform_non_params=lambda _: "N")
  labels = jax.tree.leaves(mapped)
  assert set(labels) <= {"P", "N"} and len(labels) == len(jax.tree.leaves(state))
  # the fallback's two moments of the vector "b" are parameter trees
  assert labels.count("P") >= 2


@pytest.mark.parametrize("name", ALL)
def test_tree_map_params_on_the_stacked_layout_names_the_fix(name):
  """The stacked layout's state is per stack, not per parameter: optax's map_params
  cannot place it, and says which setting gives a parameter-shaped state."""
  tx = _tx(name, stack_matrices=True)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="stack_matrices=False"):
    optax.tree.map_params(tx, lambda p: "P", state, transform_non_params=lambda _: "N")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("weight_decay", [None, 0.1])
def test_inject_hyperparams_keeps_the_state_structure(name, weight_decay):
  static = tuple(getattr(getattr(fo, name), "static_args", ()))
  plain = jax.eval_shape(_tx(name, weight_decay=weight_decay).init, PARAMS)
  injected = jax.eval_shape(
      optax.inject_hyperparams(getattr(fo, name), static_args=static)(
          registry.LR, **registry.kwargs(name), weight_decay=weight_decay).init, PARAMS)
  assert jax.tree.structure(injected.inner_state) == jax.tree.structure(plain)
  assert (jax.tree.map(lambda x: (x.shape, x.dtype), injected.inner_state)
          == jax.tree.map(lambda x: (x.shape, x.dtype), plain))


@pytest.mark.parametrize("name", ALL)
def test_a_state_from_another_tree_is_a_value_error_naming_the_leaf(name):
  tx = _tx(name)
  state = jax.eval_shape(tx.init, PARAMS)
  other_shape = dict(PARAMS, w=jnp.ones((6, 12)))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  if any("['w 6x10']" in p for p in paths):  # stacked layout: the state is per stack
    with pytest.raises(ValueError, match=r"the state has .*\['w 6x10'\] where"):
      jax.eval_shape(tx.update, other_shape, state, other_shape)
  elif any("['w']" in p for p in paths):
    with pytest.raises(ValueError, match=r"state leaf .*\['w'\] has shape"):
      jax.eval_shape(tx.update, other_shape, state, other_shape)
  else:  # a stateless rule (SWAN) on "w": any shape is its own
    assert name == "swan"
    jax.eval_shape(tx.update, other_shape, state, other_shape)
  more = dict(PARAMS, v=jnp.ones((6, 10)))
  with pytest.raises(ValueError, match=r"does not fit these updates"):
    jax.eval_shape(tx.update, more, state, more)
  fewer = {k: v for k, v in PARAMS.items() if k != "w"}
  with pytest.raises(ValueError, match=r"does not fit these updates"):
    jax.eval_shape(tx.update, fewer, state, fewer)
  jax.eval_shape(tx.update, PARAMS, state, PARAMS)  # its own tree is fine
