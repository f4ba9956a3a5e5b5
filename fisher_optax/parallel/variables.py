"""Flax NNX ``Variable`` leaves given to ``init``: a state that carries its own sharding names.

``nnx.Optimizer(model, tx, wrt=nnx.Param)`` calls ``tx.init(nnx.state(model, wrt))``: the
leaves are ``nnx.Variable`` s, each with its parameter's metadata (``out_sharding``
names from ``nnx.with_partitioning`` or a logical-axis recipe, a ``mesh``, sharding
rules). optax's tree maps rebuild a ``Variable`` around every new leaf with that same
metadata, whatever the new leaf's shape, and Flax shards a ``Variable`` by its names
when it is created (eager sharding) and in ``nnx.get_partition_spec``. A state leaf of
another shape than its parameter -- a ``(m,)`` scaling vector, a ``(m, r)`` basis, an
``r x r`` statistic, a ``(k, m, n)`` stack -- would carry the kernel's names and fail
there (a spec longer than the leaf, an axis that does not divide).

The named optimizers therefore build their state from the plain arrays and give each
state leaf that belongs to a parameter a ``Variable`` of that parameter's type and
metadata, with the names :func:`fisher_optax.state_partition_specs` gives the leaf
(:func:`fisher_optax.parallel.sharding.owned_specs`): the parameter's own names on a
leaf of its shape, a basis's fan-in axis the kernel's fan-in name, a layer axis its
name, ``r x r`` states, eigenvalues and keys none. Leaves that belong to no parameter
(step counters) stay arrays, as in optax. Nothing here changes a value.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec as P


def variable_type() -> Optional[type]:
  """``flax.nnx.Variable`` when Flax is imported (a tree can only hold Variables then),
  else ``None``: fisher_optax does not import Flax itself."""
  if "flax" not in sys.modules:
    return None
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover - an old Flax without NNX
    return None
  return nnx.Variable


def has_variables(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is an ``nnx.Variable``."""
  var = variable_type()
  if var is None:
    return False
  return any(isinstance(x, var)
             for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, var)))


def unwrap(tree: Any) -> Any:
  """``tree`` with every ``Variable`` replaced by its value (as ``nnx.as_pure``)."""
  var = variable_type()
  return jax.tree.map(lambda x: x.get_value() if isinstance(x, var) else x, tree,
                      is_leaf=lambda x: isinstance(x, var))


# Flax's older keys for ``out_sharding`` (``nnx.scan`` still sets ``sharding_names``); a
# Variable created with one of them takes its value for ``out_sharding``.
_ALIASES = ("sharding_names", "sharding")


def names(v: Any) -> Optional[tuple]:
  """A ``Variable``'s sharding names (``out_sharding`` metadata), or ``None``."""
  got = v.get_metadata("out_sharding", None)
  return tuple(got) if got else None


def _context_mesh(variables: list):
  for v in variables:
    mesh = v.get_metadata("mesh", None)
    if mesh is not None:
      return mesh
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def name_state(tx: Any, state: Any, params: Any, pure: Any, dims: Any) -> Any:
  """``state`` (``tx.init(pure)``, ``pure`` the values of the ``Variable`` tree ``params``)
  with each leaf that belongs to a parameter wrapped in a ``Variable`` of that
  parameter's type and metadata, its ``out_sharding`` the names of its own shape."""
  from fisher_optax.parallel import sharding  # sharding imports routing, which calls here

  var = variable_type()
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, var))
  specs = jax.tree.map(lambda x: P(*names(x)) if isinstance(x, var) and names(x) else None,
                       params, is_leaf=lambda x: isinstance(x, var))
  owned = sharding.owned_specs(tx, state, pure, specs, dims=dims,
                               mesh=_context_mesh([x for x in leaves if isinstance(x, var)]))
  def wrap(leaf, owned_leaf):
    owner, spec = owned_leaf.owner, owned_leaf.spec
    if owner is None or not isinstance(leaves[owner], var):
      return leaf
    v = leaves[owner]
    meta = v.get_metadata()
    if names(v) is not None:
      ndim = len(jax.numpy.shape(leaf))
      meta["out_sharding"] = tuple(spec) + (None,) * (ndim - len(spec))
      for alias in _ALIASES:  # older names of out_sharding, which Flax would copy over it
        meta.pop(alias, None)
    # as optax's tree maps make a Variable: its metadata, no sharding hook run on creation
    return type(v).from_metadata(leaf, meta)

  return jax.tree.map(wrap, state, owned)


def rewrap_like(template: Any, pure: Any) -> Any:
  """``pure`` (the values of ``template``'s structure) with each leaf whose place holds a
  ``Variable`` in ``template`` wrapped like it (its type and metadata)."""
  var = variable_type()
  is_var = lambda x: isinstance(x, var)  # noqa: E731
  slots, treedef = jax.tree.flatten(template, is_leaf=is_var)
  values = treedef.flatten_up_to(pure)
  return treedef.unflatten(
      [type(t).from_metadata(v, t.get_metadata()) if is_var(t) else v
       for t, v in zip(slots, values)])
