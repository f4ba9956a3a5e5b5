"""The sharding roles that state fields declare for their arrays: a state
``NamedTuple``'s ``SHARDING`` class attribute (``{field: role}``) says how
``fo.state_shardings`` lays out that field (docs: "Sharding and multi-host training");
the rules themselves are in :mod:`fisher_optax.parallel.sharding`, and the owner layout
reads the roles to know where a placed state is (:mod:`fisher_optax.parallel.owners`).
Nothing here decides a layout."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Roles a state field declares for its arrays, in its NamedTuple's ``SHARDING`` class
# attribute ({field: role}); undeclared fields are "auto" (matched by size).
ROLES = ("replicated",    # small per-matrix arrays: tracked r x r states, eigenvalues, keys
         "left_square",   # d x d statistics/bases of the rows side: first axis like the rows
         "right_square",  # ... of the columns side: first axis like the columns
         "rows",          # 1-D per-matrix vectors along the rows (decides square params)
         "owners",        # stacks kept in the owner layout: leading axis over every mesh axis
         "spread",        # rotated where their shards are: the larger side over every mesh axis
         "columns",       # a larger side's basis: first axis like the columns where split
         "auto")


def _declares(x) -> bool:
  return hasattr(x, "_fields") and isinstance(getattr(type(x), "SHARDING", None), dict)


def field_roles(state: Any) -> dict:
  """``keystr(path) -> role`` for every state leaf under a declared field (nested states
  included); leaves not listed are "auto"."""
  out: dict = {}

  def walk(tree, prefix):
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_declares)[0]
    for path, node in nodes:
      if not _declares(node):
        continue
      decl = type(node).SHARDING
      for name in node._fields:
        where = prefix + tuple(path) + (jax.tree_util.GetAttrKey(name),)
        if name in decl:
          if decl[name] not in ROLES:
            raise ValueError(f"{type(node).__name__}.SHARDING[{name!r}] = {decl[name]!r}: "
                             f"not one of {ROLES}")
          inner: dict = {}
          if decl[name] == "owners":
            # a state kept on owners whole (fisher_optax.owned_stacks): its constants of
            # no stack axis (a PRNG key) stay replicated
            inner = field_roles(getattr(node, name))
          for sub, x in jax.tree_util.tree_flatten_with_path(getattr(node, name))[0]:
            role = decl[name]
            if inner.get(jax.tree_util.keystr(tuple(sub))) == "replicated" and jnp.ndim(x) == 1:
              role = "replicated"
            out[jax.tree_util.keystr(where + tuple(sub))] = role
        else:
          walk(getattr(node, name), where)

  walk(state, ())
  return out
