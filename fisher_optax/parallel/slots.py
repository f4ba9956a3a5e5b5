"""A state kept on the matrices' owners, taken apart leaf by leaf and put back together.

A state in the owner layout holds, per matrix size (a group keyed ``"m x n"``), a stack of
slots (``parallel/owners.py``, ``placement``) for the leaves that move, and a per-leaf
state of the others (``local``: their tree with the moved leaves ``None``). The same
transformation's state laid out as the parameters has, at each statistic, one tree
shaped as the parameters. :func:`to_leaves` and :func:`to_slots` walk the two layouts
together and move each moved leaf's entries out of its slots and into them; what a
member's entries are (its rows, transposed or from another field) is the caller's.
``fisher_optax.convert_state_layout`` uses them through
``fisher_optax.owned_stacks`` and ``fisher_optax.blocks.rotate_owned``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


def one_level(x: Any) -> tuple:
  """``(children, treedef)`` of the root of ``x`` only (its children kept whole)."""
  return jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)


def is_statistic(owned: list, keys: list) -> bool:
  """Whether the groups' nodes ``owned`` are a statistic over the stacks (``{key: ...}``,
  one per group), where the per-leaf state has a tree shaped as the parameters."""
  return all(isinstance(x, dict) and list(x) == [k] for x, k in zip(owned, keys))


def same_node(a: Any, others: list) -> tuple:
  """The children of ``a`` and of each of ``others``, which must be nodes of one kind."""
  kids, tdef = one_level(a)
  out = []
  for o in others:
    o_kids, o_def = one_level(o)
    if o_def.node_data() != tdef.node_data() or len(o_kids) != len(kids):
      raise ValueError(f"a {type(o).__name__} where the state has a {type(a).__name__}")
    out.append(o_kids)
  return kids, tdef, out


def member_slots(groups: dict, keys: list, slots: list, counts: list) -> dict:
  """Per moved leaf (its index), its group and the slots of its matrices: ``groups``
  maps each key to its member leaves, ``slots[g]`` lists the slots of group ``g``'s
  matrices in member order, ``counts[i]`` is leaf ``i``'s number of matrices."""
  out = {}
  for g, k in enumerate(keys):
    at = 0
    for i in groups[k]:
      out[i] = (g, slots[g][at:at + counts[i]])
      at += counts[i]
  return out


def to_leaves(local: Any, owned: list, keys: list, treedef: Any, local_def: Any,
              here: list, member: Callable[[int, list], Any]) -> Any:
  """One node of a state in the owner layout as the parameters lay it out: at a
  statistic (``owned``: the groups' nodes, ``{key: ...}`` each), the tree ``treedef``
  whose leaf ``i`` is its entry in ``local`` (the tree ``local_def`` of the leaves that
  stay) where ``here[i]``, else ``member(i, owned)``; elsewhere the same walk over the
  children, and ``local``'s counters and keys."""
  if is_statistic(owned, keys):
    stay = iter(local_def.flatten_up_to(local))
    return treedef.unflatten([next(stay) if h else member(i, owned)
                              for i, h in enumerate(here)])
  kids, tdef, owned_kids = same_node(local, owned)
  if tdef.num_nodes == 1 and tdef.num_leaves == 1:
    return local
  return tdef.unflatten([to_leaves(c, [o[j] for o in owned_kids], keys, treedef, local_def,
                                   here, member) for j, c in enumerate(kids)])


def to_slots(src: Any, owned: list, keys: list, treedef: Any, local_def: Any, here: list,
             stack: Callable[[int, Any, list], Any]) -> tuple:
  """The inverse of :func:`to_leaves`: one node of a state laid out as the parameters
  (``src``) against the groups' nodes of the owner layout's template (``owned``).
  Returns ``(local, [group nodes])``: at a statistic, the tree ``local_def`` of the
  entries of the leaves that stay, and per group ``{key: stack(g, template, entries)}``
  (``entries``: every leaf's, in ``treedef`` order); elsewhere the walk over the
  children, counters and keys copied (cast to the template's dtype, one copy per
  group)."""
  if is_statistic(owned, keys):
    entries = treedef.flatten_up_to(src)
    local = local_def.unflatten([e for e, h in zip(entries, here) if h])
    return local, [{k: stack(g, o[k], entries)} for g, (k, o) in enumerate(zip(keys, owned))]
  kids, tdef, owned_kids = same_node(src, owned)
  if tdef.num_nodes == 1 and tdef.num_leaves == 1:
    for o in owned:
      if tuple(jax.numpy.shape(o)) != tuple(jax.numpy.shape(src)):
        raise ValueError(f"an array of shape {jax.numpy.shape(src)} where the stacks' "
                         f"state has one of shape {tuple(o.shape)}")
    # a copy per group: one buffer in two places of a state cannot be donated
    return src, [jax.numpy.array(src, dtype=o.dtype, copy=True) for o in owned]
  parts = [to_slots(c, [o[j] for o in owned_kids], keys, treedef, local_def, here, stack)
           for j, c in enumerate(kids)]
  return (tdef.unflatten([a for a, _ in parts]),
          [tdef.unflatten([b[g] for _, b in parts]) for g in range(len(keys))])
