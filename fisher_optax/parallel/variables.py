"""Flax ``nnx.Variable`` (and Linen ``nn.Partitioned``) leaves given to ``init``: a state
that carries its own sharding names.

``nnx.Optimizer(model, tx, wrt=nnx.Param)`` calls ``tx.init(nnx.state(model, wrt))``: the
leaves are ``nnx.Variable`` s, each with its parameter's metadata (``out_sharding``
names from ``nnx.with_partitioning`` or a logical-axis recipe, a ``mesh``, sharding
rules). optax's tree maps rebuild a ``Variable`` around every new leaf with that same
metadata, whatever the new leaf's shape, and Flax shards a ``Variable`` by its names
when it is created (eager sharding) and in ``nnx.get_partition_spec``. A state leaf of
another shape than its parameter -- a ``(m,)`` scaling vector, a ``(m, r)`` basis, an
``r x r`` statistic, a ``(k, m, n)`` stack -- would carry the kernel's names and fail
there (a spec longer than the leaf, an axis that does not divide). Linen's
``nn.Partitioned`` boxes (``nn.with_partitioning``, ``nn.with_logical_partitioning``)
behave the same under tree maps and ``nn.get_partition_spec``.

The named optimizers therefore build their state from the plain arrays and give each
state leaf that belongs to a parameter a ``Variable`` of that parameter's type and
metadata, with the names :func:`fisher_optax.state_partition_specs` gives the leaf
(:func:`fisher_optax.parallel.sharding.owned_specs`): the parameter's own names on a
leaf of its shape, a basis's fan-in axis the kernel's fan-in name, a layer axis its
name, ``r x r`` states, eigenvalues and keys none. Stacks kept on their owner devices
(the rotation family's state under a mesh) belong to no one parameter: they are boxed
like the parameters and named by their own spec, their stack axis over every mesh
axis. Other leaves that belong to no parameter (step counters) stay arrays, as in optax.
Nothing here changes a value.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec as P


def box_types() -> tuple:
  """The metadata boxes a parameter tree can hold once Flax is imported: NNX's
  ``nnx.Variable`` and Linen's ``nn.Partitioned`` (``nn.with_partitioning``,
  ``nn.with_logical_partitioning``); empty otherwise (fisher_optax does not import Flax
  itself)."""
  if "flax" not in sys.modules:
    return ()
  out = []
  try:
    from flax import nnx
    out.append(nnx.Variable)
  except ImportError:  # pragma: no cover - an old Flax without NNX
    pass
  try:
    from flax.core import meta
    out.append(meta.Partitioned)
  except ImportError:  # pragma: no cover
    pass
  return tuple(out)


def _is_variable(x) -> bool:
  return hasattr(x, "get_metadata") and hasattr(x, "get_value")


def has_variables(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is an ``nnx.Variable`` or a Linen ``nn.Partitioned``."""
  boxes = box_types()
  if not boxes:
    return False
  return any(isinstance(x, boxes)
             for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, boxes)))


def value(box: Any) -> Any:
  """A box's array (a Variable's value, a Partitioned's ``value``)."""
  return box.get_value() if _is_variable(box) else box.value


def unwrap(tree: Any) -> Any:
  """``tree`` with every box replaced by its value (as ``nnx.as_pure`` / ``nn.unbox``,
  without the sharding constraint ``unbox`` applies)."""
  boxes = box_types()
  if not boxes:
    return tree
  return jax.tree.map(lambda x: value(x) if isinstance(x, boxes) else x, tree,
                      is_leaf=lambda x: isinstance(x, boxes))


# Flax's older keys for ``out_sharding`` (``nnx.scan`` still sets ``sharding_names``); a
# Variable created with one of them takes its value for ``out_sharding``.
_ALIASES = ("sharding_names", "sharding")


def names(box: Any) -> Optional[tuple]:
  """A box's sharding names (a Variable's ``out_sharding``, a Partitioned's ``names``),
  or ``None``."""
  got = box.get_metadata("out_sharding", None) if _is_variable(box) else box.names
  return tuple(got) if got else None


def _context_mesh(boxes: list):
  for b in boxes:
    mesh = b.get_metadata("mesh", None) if _is_variable(b) else getattr(b, "mesh", None)
    if mesh is not None:
      return mesh
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def _named(box: Any, leaf: Any, spec: P) -> Any:
  """A box like ``box`` (its type and metadata) around ``leaf``, named by ``spec``."""
  ndim = len(jax.numpy.shape(leaf))
  full = tuple(spec) + (None,) * (ndim - len(spec))
  if not _is_variable(box):
    return box.replace(value=leaf, names=full)
  meta = box.get_metadata()
  if names(box) is not None:
    meta["out_sharding"] = full
    for alias in _ALIASES:  # older names of out_sharding, which Flax would copy over it
      meta.pop(alias, None)
  # as optax's tree maps make a Variable: its metadata, no sharding hook run on creation
  return type(box).from_metadata(leaf, meta)


def box_specs(params: Any) -> tuple:
  """``(specs, mesh)`` of a tree of boxes: per leaf, the ``PartitionSpec`` of its box's
  names (``None`` where it has none, or is no box), and the mesh the boxes name (a
  Variable's ``mesh`` metadata, else the context mesh; ``None`` where neither is set)."""
  boxes = box_types()
  is_box = lambda x: isinstance(x, boxes)  # noqa: E731
  specs = jax.tree.map(lambda x: P(*names(x)) if is_box(x) and names(x) else None,
                       params, is_leaf=is_box)
  return specs, _context_mesh([x for x in jax.tree.leaves(params, is_leaf=is_box)
                               if is_box(x)])


def placed_specs(params: Any) -> tuple:
  """``(specs, mesh)`` of a tree of concrete arrays placed by ``NamedSharding`` s of one
  mesh of several devices (``jax.device_put`` with shardings, a jitted function's
  outputs): per leaf the ``PartitionSpec`` it is placed by, and that mesh; ``(None,
  None)`` where a leaf is traced, not an array, or not so placed."""
  leaves = jax.tree.leaves(params)
  mesh = None
  for x in leaves:
    sh = getattr(x, "sharding", None)
    if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)
        or not isinstance(sh, jax.sharding.NamedSharding)
        or (mesh is not None and sh.mesh != mesh)):
      return None, None
    mesh = sh.mesh
  if mesh is None or mesh.size < 2:
    return None, None
  return jax.tree.map(lambda x: x.sharding.spec, params), mesh


def ruled_specs(specs: Any) -> Optional[Any]:
  """``specs`` (a tree of ``PartitionSpec`` s of logical names) mapped to mesh axes by the
  logical axis rules in force (Flax's ``nn.logical_axis_rules`` context, as MaxText sets
  it; a name no rule maps is not split), or ``None`` where no rules are in force."""
  if "flax" not in sys.modules:
    return None
  from flax.linen import spmd
  rules = spmd.get_logical_axis_rules()
  if not rules:
    return None
  return jax.tree.map(lambda sp: spmd.logical_to_mesh_axes(tuple(sp), rules), specs,
                      is_leaf=lambda x: isinstance(x, P))


OWNERS_AXIS = "fo_owners"


def _in_force_rules() -> tuple:
  """Flax's logical axis rules in force (``nn.logical_axis_rules``), or ``()``."""
  if "flax" not in sys.modules:
    return ()
  from flax.linen import spmd
  return tuple(spmd.get_logical_axis_rules() or ())


def owners_name(spec: P, rules: tuple, mesh: Any) -> P:
  """The spec of a stack kept on its owners (its leading axis split over the mesh axes
  ``spec[0]`` names) as a logical name of ``rules``, for a state named by logical names
  that the rules map to mesh axes later (MaxText, the Flax logical recipes): the first
  name whose first rule maps to the same mesh axes of more than one device, in order
  (size-one axes split nothing). Where no rule does, the reserved name
  ``"fo_owners"``, with a warning that names the rule to add: unmapped, the stacks would
  be whole on every device."""
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  sizes = dict(getattr(mesh, "shape", None) or {})
  split = lambda names: tuple(a for a in names if sizes.get(a, 2) > 1)  # noqa: E731
  want, seen = split(axes), set()
  for name, target in rules:
    if name in seen:
      continue
    seen.add(name)
    target = (target,) if isinstance(target, str) or target is None else tuple(target)
    if split([a for a in target if a is not None]) == want:
      return P(name, *spec[1:])
  if not any(name == OWNERS_AXIS for name, _ in rules):
    warnings.warn(
        "fisher_optax: the optimizer state kept on the matrices' owners is split over the "
        f"mesh axes {want} on its first axis, and no logical axis rule in force maps a "
        f"name to them, so it is named {OWNERS_AXIS!r}. Add the rule "
        f"({OWNERS_AXIS!r}, {want}) to your logical axis rules (MaxText: "
        "logical_axis_rules), else those stacks are whole on every device.", stacklevel=6)
  return P(OWNERS_AXIS, *spec[1:])


def name_state(tx: Any, state: Any, params: Any, pure: Any, dims: Any) -> Any:
  """``state`` (``tx.init(pure)``, ``pure`` the values of the boxed tree ``params``)
  with each leaf that belongs to a parameter in a box of that parameter's type and
  metadata, named for its own shape."""
  from fisher_optax.parallel import sharding  # sharding imports routing, which calls here

  boxes = box_types()
  is_box = lambda x: isinstance(x, boxes)  # noqa: E731
  leaves = jax.tree.leaves(params, is_leaf=is_box)
  specs, mesh = box_specs(params)
  named = {n for sp in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
           for e in sp if e is not None for n in (e if isinstance(e, tuple) else (e,))}
  # boxes named by this mesh's axes (not logical names): the update reads them, and the
  # state's own boxes, as fo.OwnerLayout(state_placed=True) says
  owned = sharding.owned_specs(tx, state, pure, specs, dims=dims, mesh=mesh,
                               boxed=mesh is not None and named <= set(mesh.axis_names))

  boxed = [x for x in leaves if is_box(x)]
  # under logical axis rules the state's names are mapped by them later: a stack kept on
  # its owners is named by the rule that maps to its mesh axes
  rules = _in_force_rules()
  owner_mesh = mesh if mesh is not None else getattr(tx, "info", {}).get("owner_mesh")

  def wrap(leaf, owned_leaf):
    owner = owned_leaf.owner
    if owner is None:
      # state of no one parameter laid out over the mesh (stacks kept on their owners,
      # ``parallel/owners.py``): boxed like the parameters, named by its own spec
      spec = owned_leaf.spec
      if rules and tuple(spec) and spec[0] is not None:
        spec = owners_name(spec, rules, owner_mesh)
      return _named(boxed[0], leaf, spec) if boxed and tuple(spec) else leaf
    if not is_box(leaves[owner]):
      return leaf
    return _named(leaves[owner], leaf, owned_leaf.spec)

  return jax.tree.map(wrap, state, owned)


def rewrap_like(template: Any, pure: Any) -> Any:
  """``pure`` (the values of ``template``'s structure) with each leaf whose place holds a
  box in ``template`` boxed like it (its type and metadata)."""
  boxes = box_types()
  is_box = lambda x: isinstance(x, boxes)  # noqa: E731
  slots, treedef = jax.tree.flatten(template, is_leaf=is_box)
  values = treedef.flatten_up_to(pure)
  like = lambda t, v: (type(t).from_metadata(v, t.get_metadata()) if _is_variable(t)  # noqa: E731
                       else t.replace(value=v))
  return treedef.unflatten([like(t, v) if is_box(t) else v for t, v in zip(slots, values)])
