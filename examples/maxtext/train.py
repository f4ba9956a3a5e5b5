"""MaxText's own training loop with a fisher_optax optimizer.

    python examples/maxtext/train.py --optimizer alice --rank 64 --learning-rate 1e-3 \\
        run_name=alice base_output_directory=/tmp/maxtext dataset_type=synthetic steps=100

Everything after the launcher's own flags goes to MaxText as it is (``key=value``
overrides of its ``base.yml``, or a config path first). MaxText builds its optimizer in
``maxtext.optimizers.optimizers.get_optimizer``; the launcher replaces that one function:

* the structured rule is routed by MaxText's own Muon dimension numbers
  (``maxtext.utils.muon_utils``: the layer axis at index 1, head-split attention
  kernels, experts as batch axes; embeddings, norms and biases ``None``), which
  ``dims=`` takes as ``optax.contrib.muon`` does;
* its learning rate follows MaxText's schedule (warm-up, decay) scaled to
  ``--learning-rate`` at its peak; the other parameters get MaxText's AdamW at MaxText's
  own ``learning_rate`` and ``adam_*`` settings;
* the owner layout (whole-matrix work on owner devices) is given MaxText's mesh and the
  parameters' specs under its logical axis rules, so that every matrix moves to its
  owner from the split it has, and SOAP, Shampoo and Eigen-Adam keep their state on the
  owners (``--owner-layout``; with ``auto`` they keep it per leaf, built outside the
  context mesh, and send many times more: see ``collectives.py`` here);
* ``fo.describe`` prints the routing of every parameter before training, one line the
  optimizer state's bytes on the first device against the whole state's, and one the
  model's parameter bytes.

MaxText needs Python 3.12 or newer (``pip install maxtext``; see the docs page
"MaxText").
"""

from __future__ import annotations

import argparse
import os
import sys

import fisher_optax as fo

LOW_RANK = ("alice", "alice0", "alice_soap", "galore", "fira", "apollo")


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--optimizer", default="alice",
                 help="a named fisher_optax optimizer, or 'maxtext' for MaxText's own "
                      "(its opt_type), to compare under the same report")
  p.add_argument("--learning-rate", type=float, default=None,
                 help="peak learning rate of the structured rule (default: MaxText's "
                      "learning_rate, the fallback's)")
  p.add_argument("--rank", type=int, default=None, help="rank of the low-rank optimizers")
  p.add_argument("--weight-decay", type=float, default=None,
                 help="decoupled weight decay on the structured leaves (default none)")
  p.add_argument("--owner-layout", choices=("specs", "auto", "off"), default="specs",
                 help="the optimizer's owner_layout: 'specs' (default: MaxText's mesh, "
                      "each matrix moved from its split under MaxText's logical axis "
                      "rules, fo.OwnerLayout(mesh=..., param_specs=...); where MaxText "
                      "gives no mesh or no NNX model, the optimizer's own default), "
                      "'auto' (the optimizer's own default: MaxText traces the step under "
                      "jax.set_mesh, and each matrix's split is read from its logical "
                      "names under MaxText's rules), or 'off'")
  return p.parse_known_args(argv)


def make_get_optimizer(args):
  """A stand-in for MaxText's ``get_optimizer(config, learning_rate_schedule, model, mesh)``."""
  import jax
  import optax
  from maxtext.utils import muon_utils

  def get_optimizer(config, learning_rate_schedule, model=None, mesh=None):
    if model is None:
      raise ValueError("fisher_optax needs the model to route its parameters")
    dims = muon_utils.get_muon_weight_dimension_numbers(model, config)
    peak = float(config.learning_rate)
    lr = args.learning_rate if args.learning_rate is not None else peak
    structured_lr = lambda step: learning_rate_schedule(step) * (lr / peak)  # noqa: E731
    fallback = optax.adamw(learning_rate_schedule, b1=config.adam_b1, b2=config.adam_b2,
                           eps=config.adam_eps, eps_root=config.adam_eps_root,
                           weight_decay=config.adam_weight_decay)
    kw = dict(dims=dims, fallback=fallback, weight_decay=args.weight_decay)
    if args.rank is not None:
      if args.optimizer not in LOW_RANK:
        raise ValueError(f"--rank is for {', '.join(LOW_RANK)}, not {args.optimizer}")
      kw["rank"] = args.rank
    if args.owner_layout == "off":
      kw["owner_layout"] = False
    elif args.owner_layout == "specs":
      if mesh is not None and _is_nnx(model):
        kw["owner_layout"] = owner_layout(config, model, mesh)
      else:
        print("owner layout: the optimizer's default (MaxText gave no mesh or no NNX "
              "model to read the parameters' specs from)", flush=True)
    tx = getattr(fo, args.optimizer)(structured_lr, **kw)
    if jax.process_index() == 0:
      from flax import nnx
      params = nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else None
      if params is not None:
        print(fo.describe(tx, params), flush=True)
    return tx

  return get_optimizer


def _is_nnx(model) -> bool:
  from flax import nnx
  return isinstance(model, nnx.Module)


def owner_layout(config, model, mesh):
  """``fo.OwnerLayout`` on MaxText's ``mesh`` with the parameters' mesh-axis specs, their
  logical names (``nnx.get_partition_spec``) mapped by MaxText's ``logical_axis_rules``."""
  from flax import linen as nn
  from flax import nnx
  if mesh is None or not isinstance(model, nnx.Module):
    raise ValueError("--owner-layout specs needs MaxText's mesh and an NNX model")
  logical = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  return fo.OwnerLayout(mesh=mesh, param_specs=nn.logical_to_mesh(
      logical, config.logical_axis_rules))


def state_report(state) -> str:
  """The optimizer state's bytes on the first device against the whole state's: how far
  MaxText's logical rules shard it (the state's leaves carry the names of their own
  shapes)."""
  import jax
  leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
  opt = [x for k, x in leaves if "opt_state" in k and isinstance(x, jax.Array)]
  total = sum(x.nbytes for x in opt)
  first = sum(x.addressable_shards[0].data.nbytes for x in opt)
  return (f"optimizer state: {first:,} bytes on device 0 of {total:,} "
          f"({100 * first / max(total, 1):.1f}%, {len(jax.devices())} devices)")


def parameter_report(state) -> str:
  """The model's parameter bytes (the floating leaves of the training state's model)."""
  import jax
  import jax.numpy as jnp
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  total = sum(x.nbytes for p, x in leaves
              if jax.tree_util.keystr(p).startswith("['model']") and isinstance(x, jax.Array)
              and jnp.issubdtype(x.dtype, jnp.floating))
  return f"parameters: {total:,} bytes"


def _reporting(setup):
  def wrapped(*args, **kwargs):
    out = setup(*args, **kwargs)
    print(state_report(out[0]), flush=True)
    print(parameter_report(out[0]), flush=True)
    return out
  return wrapped


def main(argv=None):
  args, rest = parse(sys.argv[1:] if argv is None else argv)
  if args.optimizer != "maxtext" and (args.optimizer not in fo.__all__
                                     or not callable(getattr(fo, args.optimizer, None))):
    raise SystemExit(f"--optimizer {args.optimizer!r} is no fisher_optax optimizer")
  try:
    from maxtext.optimizers import optimizers
    from maxtext.trainers.pre_train import train
  except ImportError as e:
    raise SystemExit("examples/maxtext needs MaxText (Python 3.12+): pip install maxtext "
                     f"({e})") from e
  if not rest or "=" in rest[0]:  # no config path: MaxText's base.yml
    import maxtext
    rest = [os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")] + rest
  from absl import app
  from maxtext.utils import maxtext_utils
  if args.optimizer != "maxtext":
    optimizers.get_optimizer = make_get_optimizer(args)
  maxtext_utils.setup_training_state = _reporting(maxtext_utils.setup_training_state)
  app.run(train.main, argv=[sys.argv[0]] + rest)  # as MaxText's own entry point


if __name__ == "__main__":
  main()
