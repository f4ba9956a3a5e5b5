"""Meshes with ``Explicit`` axes: run an update with those axes switched to ``Auto``.

``jax.make_mesh`` gives its axes the ``Explicit`` type by default (jax 0.10). Under such
a mesh (``jax.set_mesh``) an array's sharding is part of its type, and every operation
must be able to say how its result is sharded: a product over a sharded contracting
axis, a loop whose carry changes sharding or operands of different shardings are type
errors at trace time. The blocks' matrix products, loops and decompositions leave those
choices to XLA, as on an ``Auto`` mesh, where the updates are those of one device (tested
in ``tests/test_sharding.py``).

:func:`with_auto_axes` runs a transformation's ``update`` inside
``jax.sharding.auto_axes`` over the context mesh's explicit axes: inside, XLA propagates
shardings as on an ``Auto`` mesh (the arguments keep their shardings as placement); the
updates come back with the gradients' shardings and the new state with the old state's
(its type is unchanged from step to step, so ``jax.jit`` does not recompile and
``lax.cond`` branches agree). Without a context mesh, or with ``Auto`` axes only, the
update runs as it is. Named optimizers apply it to their structured rule
(``finish`` in ``fisher_optax.alias.closing``); a chain of blocks built by hand takes it as
``with_auto_axes(optax.chain(...))``.
"""

from __future__ import annotations

import jax
import optax


def _sharding_specs(tree):
  return jax.tree.map(lambda x: jax.typeof(x).sharding.spec, tree)


def with_auto_axes(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``update`` runs with the context mesh's ``Explicit`` axes as ``Auto``.

  Args:
    tx: any optax transformation whose updates keep the gradients' tree structure and
      shapes (every named optimizer and chain of blocks ending in a dense update).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``tx``'s ``init`` and state.
  """
  tx = optax.with_extra_args_support(tx)

  def update_fn(updates, state, params=None, **extra_args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
      return tx.update(updates, state, params, **extra_args)
    run = jax.sharding.auto_axes(
        lambda u, s, p, e: tx.update(u, s, p, **e), axes=mesh.explicit_axes,
        out_sharding=(_sharding_specs(updates), _sharding_specs(state)))
    return run(updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)
