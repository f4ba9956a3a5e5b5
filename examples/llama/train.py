"""Pre-train a Flax NNX LLaMA with a fisher_optax optimizer (or Adam) on real text.

    python examples/llama/train.py --preset tiny --optimizer alice --steps 300 --out runs/alice

Writes ``OUT/metrics.csv`` (step, tokens, train_loss, eval_loss, eval_ppl, tokens_per_s,
wall_s), ``OUT/config.json``, ``OUT/routing.txt`` (``fo.describe``: how every parameter is
routed; also printed at start) and orbax checkpoints under ``OUT/ckpt`` (``--resume``
continues from the latest one). Learning rate: 10% linear warm-up, then cosine decay to
10% of the peak (paper App. "Experiment setup"). ``wall_s`` counts training time only
(evaluation and checkpointing excluded).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time

if __package__ in (None, ""):  # `python examples/llama/train.py`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fisher_optax as fo
from examples.llama import data as data_lib
from examples.llama import presets
from examples.llama.model import Llama

COLUMNS = ("step", "tokens", "train_loss", "eval_loss", "eval_ppl", "tokens_per_s", "wall_s")
BATCH = {"tiny": 8, "small": 16, "60M": 64, "130M": 64, "350M": 64, "1B": 64}


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny", choices=list(presets.MODELS))
  ap.add_argument("--optimizer", default="alice", choices=presets.OPTIMIZERS)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--out", default="runs/llama")
  ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: paper's)")
  ap.add_argument("--hparams", default=None,
                  help='JSON of optimizer keyword overrides, e.g. \'{"b2": 0.95, '
                       '"weight_decay": 0.1}\' (see presets.make_optimizer)')
  ap.add_argument("--on-divergence", default="raise", choices=("raise", "stop"),
                  help="non-finite training loss: raise, or stop and report the step")
  ap.add_argument("--batch-size", type=int, default=None, help="sequences per optimizer step")
  ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
  ap.add_argument("--eval-every", type=int, default=None)
  ap.add_argument("--eval-batches", type=int, default=8)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--lm-head", default="auto", choices=("auto", "adam", "structured"),
                  help="output layer on Adam (paper's Ppl*) or on the structured optimizer")
  ap.add_argument("--data", default="shakespeare",
                  help="'shakespeare' (offline), a file/folder of .txt/.md, or hf:NAME[:CONFIG]")
  ap.add_argument("--vocab-size", type=int, default=None)
  ap.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer name (online)")
  ap.add_argument("--cache-dir", default=None)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--checkpoint-every", type=int, default=None, help="0 disables checkpoints")
  ap.add_argument("--resume", action="store_true")
  ap.add_argument("--stop-after", type=int, default=None,
                  help="stop (with a checkpoint) after this many steps: simulates preemption")
  ap.add_argument("--tensorboard", action="store_true", help="also log to OUT/tb (tensorboardX)")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--mesh", default=None,
                  help="DATA,FSDP,TENSOR device-mesh sizes, e.g. 2,2,2 (default: one device)")
  ap.add_argument("--coordinator", default=None,
                  help="host:port of process 0 for multi-process runs (jax.distributed)")
  ap.add_argument("--num-processes", type=int, default=1)
  ap.add_argument("--process-id", type=int, default=0)
  return ap.parse_args(argv)


_DISTRIBUTED = False


def init_distributed(args):
  """``jax.distributed.initialize`` for multi-process runs (CPU: gloo collectives)."""
  global _DISTRIBUTED
  if args.coordinator is None or args.num_processes <= 1 or _DISTRIBUTED:
    return
  _DISTRIBUTED = True
  # Harmless on GPU/TPU (only used by the CPU backend); must precede any backend use.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)


def make_mesh(spec: str | None):
  """A ``("data", "fsdp", "tensor")`` mesh over all (global) devices, or ``None``."""
  if not spec:
    return None
  sizes = tuple(int(x) for x in spec.split(","))
  if len(sizes) != 3 or np.prod(sizes) != jax.device_count():
    raise ValueError(f"--mesh {spec}: need 3 sizes multiplying to {jax.device_count()} devices")
  return Mesh(np.array(jax.devices()).reshape(sizes), ("data", "fsdp", "tensor"))


def param_specs(params):
  """FSDP on the rows and tensor parallelism on the columns of every matrix."""
  return jax.tree.map(lambda p: P("fsdp", "tensor") if p.ndim == 2 else P(), params)


def owner_settings(args, specs) -> dict:
  """On a mesh, the library's optimizers learn each matrix's split from ``specs`` (the
  mesh has ``Auto`` axes, where the split is not visible while the update is traced),
  and are told that their state is placed as ``fo.state_shardings`` places it, which
  this script does: ``fo.OwnerLayout(param_specs=specs, state_placed=True)``. Without
  them the owner layout guesses the split from each shape. ``--hparams`` may set
  ``owner_layout`` itself; optax's optimizers take none."""
  import inspect
  hparams = json.loads(args.hparams) if getattr(args, "hparams", None) else {}
  name = {"fo_muon": "muon", "dion16": "dion"}.get(args.optimizer, args.optimizer)
  fn = None if args.optimizer in ("adam", "adamw", "muon") else getattr(fo, name, None)
  if ("owner_layout" in hparams or fn is None
      or "owner_layout" not in inspect.signature(fn).parameters):
    return {}
  return dict(owner_layout=fo.OwnerLayout(param_specs=specs, state_placed=True))


def lr_schedule(peak: float, steps: int) -> optax.Schedule:
  warm = max(1, int(0.1 * steps))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), 0.1 * peak)


@dataclasses.dataclass
class Setup:
  cfg: object
  corpus: data_lib.Corpus
  graphdef: object
  params: object
  tx: optax.GradientTransformation
  batch_size: int
  lr: float


def build(args) -> Setup:
  vocab = args.vocab_size or presets.MODELS[args.preset]["vocab_size"]
  corpus = data_lib.load_corpus(args.data, vocab, args.tokenizer, args.cache_dir)
  cfg = presets.model_config(args.preset, vocab_size=corpus.vocab_size, dtype=args.dtype,
                             param_dtype=args.dtype)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(args.seed))),
                               nnx.Param)
  lr = args.lr if args.lr is not None else presets.default_lr(args.preset, args.optimizer)
  tx = make_tx(args, params, lr)
  bs = args.batch_size or BATCH[args.preset]
  if bs % args.grad_accum:
    raise ValueError(f"--batch-size {bs} is not divisible by --grad-accum {args.grad_accum}")
  return Setup(cfg, corpus, graphdef, params, tx, bs, lr)


def make_tx(args, params, lr: float, **override) -> optax.GradientTransformation:
  """The run's optimizer (``--optimizer``, ``--hparams``, ``--lm-head``), keywords in
  ``override`` replacing those of ``--hparams``."""
  head = {"auto": None, "adam": True, "structured": False}[args.lm_head]
  hparams = json.loads(args.hparams) if getattr(args, "hparams", None) else {}
  return presets.make_optimizer(args.optimizer, args.preset, lr_schedule(lr, args.steps),
                                lm_head_on_adam=head, params=params, **{**hparams, **override})


def init_params(setup: Setup, seed: int, shardings=None):
  """Initialises the parameters inside ``jit`` (each device makes its own shards)."""
  def f():
    return nnx.state(Llama(setup.cfg, nnx.Rngs(seed)), nnx.Param)
  return jax.jit(f, out_shardings=shardings)()


def make_steps(setup: Setup, shardings=None):
  """The jitted train and eval steps; ``shardings``: ``(params, optimizer state)``
  shardings that the train step's outputs keep (as the inputs': one compiled step)."""
  graphdef, tx = setup.graphdef, setup.tx
  out = None if shardings is None else (*shardings, None)

  def loss_fn(params, x, y):
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out)
  def train_step(params, opt_state, xs, ys):
    """``xs, ys``: [grad_accum, micro_batch, T]; gradients averaged over micro-batches."""
    def micro(acc, xy):
      loss, g = jax.value_and_grad(loss_fn)(params, *xy)
      return jax.tree.map(jnp.add, acc, (loss, g)), None

    zero = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(micro, zero, (xs, ys))
    k = xs.shape[0]
    grads = jax.tree.map(lambda g: g / k, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss / k

  @jax.jit
  def eval_loss(params, x, y):
    return loss_fn(params, x, y)

  return train_step, eval_loss


class Checkpoints:
  """Orbax save/restore of the full train state (params, optimizer state, step)."""

  def __init__(self, directory: pathlib.Path):
    import orbax.checkpoint as ocp
    self.ocp = ocp
    self.mgr = ocp.CheckpointManager(directory.resolve(),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2))

  def save(self, step: int, params, opt_state):
    state = {"params": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32),
             "data_step": jnp.asarray(step, jnp.int32)}
    self.mgr.save(step, args=self.ocp.args.StandardSave(state))
    self.mgr.wait_until_finished()

  def latest(self):
    return self.mgr.latest_step()

  def restore(self, params, opt_state):
    target = {"params": params, "opt_state": opt_state, "step": jnp.zeros([], jnp.int32),
              "data_step": jnp.zeros([], jnp.int32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                            sharding=getattr(x, "sharding", None)),
                            target)
    got = self.mgr.restore(self.mgr.latest_step(), args=self.ocp.args.StandardRestore(abstract))
    return got["params"], got["opt_state"], int(got["data_step"])

  def restore_any_layout(self, params, opt_state, tx, others=()):
    """:meth:`restore`; a checkpoint whose optimizer state has another layout is restored
    in the first of ``others`` that fits it, ``(other_tx, other_shardings)`` pairs (the
    optimizer's other ``stack_matrices`` layout, saved on a backend whose ``"auto"`` chose
    it; the optimizer as built for the mesh the checkpoint was saved on, whose state may
    be kept on the matrices' owners), on ``other_shardings`` under a mesh, and converted
    with ``fo.convert_state_layout``. Returns ``(params, opt_state, step, converted)``."""
    try:
      return (*self.restore(params, opt_state), False)
    except ValueError as e:
      if not others or "structure" not in str(e).lower():
        raise
      first = e
    shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), opt_state)
    for other_tx, other_shardings in others:
      saved = jax.eval_shape(other_tx.init, params)
      if other_shardings is None:  # one device (a checkpoint of a mesh restored here)
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        other_shardings = jax.tree.map(lambda _: one, saved)
      saved = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                           saved, other_shardings)
      try:
        params, state, step = self.restore(params, saved)
      except ValueError as e:
        if "structure" not in str(e).lower():
          raise
        continue
      state = fo.convert_state_layout(state, tx, params)
      return params, jax.device_put(state, shardings), step, True
    raise first


def _saved_mesh(out: pathlib.Path):
  """The ``--mesh`` of the run that wrote ``out`` (its ``config.json``), or ``None``."""
  try:
    return json.loads((out / "config.json").read_text()).get("mesh")
  except (OSError, ValueError):
    return None


def tx_as_saved(args, setup: Setup, mesh_spec):
  """The optimizer as a run on ``--mesh mesh_spec`` built it: for that mesh (abstract:
  its devices need not exist here) the low-rank family and the rotation family keep
  their state on the owners where that sends less, padded for its device count, so a
  checkpoint saved there is restored in that layout and converted."""
  if not mesh_spec:
    return make_tx(args, setup.params, setup.lr)
  sizes = tuple(int(x) for x in mesh_spec.split(","))
  abstract = jax.sharding.AbstractMesh(sizes, ("data", "fsdp", "tensor"))
  with jax.sharding.use_abstract_mesh(abstract):  # as `run` builds it under its mesh
    return make_tx(args, setup.params, setup.lr,
                   **owner_settings(args, param_specs(setup.params)))


def _read_metrics(path: pathlib.Path, upto: int) -> list[dict]:
  if not path.exists():
    return []
  with path.open() as f:
    return [r for r in csv.DictReader(f) if int(r["step"]) <= upto]


def run(args, *, log=print) -> dict:
  """Trains as ``args`` say; returns a summary dict (also used by compare.py)."""
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  init_distributed(args)
  main_process = jax.process_index() == 0
  if not main_process:
    log = lambda *_: None
  setup = build(args)
  cfg, corpus = setup.cfg, setup.corpus
  saved_mesh = _saved_mesh(out) if args.resume else None
  mesh = make_mesh(args.mesh)
  owned = {}
  if mesh is not None:
    specs = param_specs(setup.params)
    owned = owner_settings(args, specs)
    # built under the mesh, as a sharded run sets up its optimizer: the rotation family
    # (SOAP, Shampoo, Eigen-Adam) then keeps its state on the owner devices
    with jax.set_mesh(mesh):
      setup.tx = make_tx(args, setup.params, setup.lr, **owned)
  if mesh is None:
    p_sh = s_sh = batch_sh = None
  else:
    p_sh = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs,
                        is_leaf=lambda x: isinstance(x, P))
    s_sh = fo.state_shardings(setup.tx, setup.params, specs, mesh)
    batch_sh = NamedSharding(mesh, P(None, "data", None))
  params = init_params(setup, args.seed, p_sh)
  opt_state = jax.jit(setup.tx.init, out_shardings=s_sh)(params)
  train_step, eval_loss = make_steps(setup, None if mesh is None else (p_sh, s_sh))

  def to_device(x):
    x = np.asarray(x, np.int32)
    if batch_sh is None:
      return jnp.asarray(x)
    sh = batch_sh if x.ndim == 3 else NamedSharding(mesh, P("data", None))
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
  ctx = cfg.context
  micro = setup.batch_size // args.grad_accum
  eval_every = args.eval_every or max(1, args.steps // 10)
  ckpt_every = eval_every if args.checkpoint_every is None else args.checkpoint_every
  evals = data_lib.eval_batches(corpus.eval_ids, micro, ctx, args.eval_batches)
  ckpt = Checkpoints(out / "ckpt") if (ckpt_every or args.resume) else None

  start, rows, wall = 0, [], 0.0
  if args.resume and ckpt.latest() is not None:
    others = []
    if isinstance(setup.tx, fo.routing.RoutedTransformation):
      with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        others.append(make_tx(args, setup.params, setup.lr,
                              stack_matrices=not fo.stacking.is_stacked(setup.tx), **owned))
      if saved_mesh != args.mesh:
        others.append(tx_as_saved(args, setup, saved_mesh))
    others = [(o, fo.state_shardings(o, setup.params, specs, mesh) if mesh is not None
               else None) for o in others]
    params, opt_state, start, converted = ckpt.restore_any_layout(params, opt_state,
                                                                  setup.tx, others)
    if converted:
      log("the checkpoint's optimizer state was in another layout (the other "
          "stack_matrices, or that of the mesh it was saved on): converted with "
          "fo.convert_state_layout")
    rows = _read_metrics(out / "metrics.csv", start)
    wall = float(rows[-1]["wall_s"]) if rows else 0.0
    log(f"resumed from step {start}")
  if main_process and isinstance(setup.tx, fo.routing.RoutedTransformation):
    table = str(fo.describe(setup.tx, setup.params))
    (out / "routing.txt").write_text(table + "\n")
    if not args.no_progress:
      log(table)
  if main_process:
    (out / "config.json").write_text(json.dumps(
        {**vars(args), "model": dataclasses.asdict(cfg), "lr": setup.lr,
         "batch_size": setup.batch_size, "params": cfg.num_params(),
         "optimizer_state_bytes": fo.state_bytes(opt_state)}, indent=2, default=str))

  writer = None
  if args.tensorboard:
    from tensorboardX import SummaryWriter  # optional
    writer = SummaryWriter(str(out / "tb"))

  def evaluate(p):
    return float(np.mean([float(eval_loss(p, to_device(x), to_device(y))) for x, y in evals]))

  def write_rows():
    if not main_process:
      return
    with (out / "metrics.csv").open("w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=COLUMNS)
      w.writeheader()
      w.writerows(rows)

  tokens_per_step = setup.batch_size * ctx
  # compile ahead of time so that timings (tokens/s, wall_s) are pure step time
  x0 = to_device(np.zeros((args.grad_accum, micro, ctx), np.int32))
  t0 = time.perf_counter()
  # traced under the mesh as the context mesh (jax.set_mesh), as a sharded JAX program is
  # run: the optimizers' owner layout reads it
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    train_step = train_step.lower(params, opt_state, x0, x0).compile()
  compile_s = time.perf_counter() - t0
  log(f"{args.optimizer}: compiled the train step in {compile_s:.1f} s; "
      f"model {cfg.num_params() / 1e6:.2f}M params, optimizer state "
      f"{fo.state_bytes(opt_state) / 2 ** 20:.2f} MB")
  bar = None
  if not args.no_progress and main_process:
    from tqdm.auto import tqdm
    bar = tqdm(total=args.steps, initial=start, desc=f"{args.optimizer}", dynamic_ncols=True)
  window_loss, window_steps, window_time = 0.0, 0, 0.0
  diverged_at = None
  for step in range(start, args.steps):
    x, y = data_lib.train_batch(corpus.train_ids, args.seed, step, setup.batch_size, ctx)
    xs = to_device(x.reshape(args.grad_accum, micro, ctx))
    ys = to_device(y.reshape(args.grad_accum, micro, ctx))
    t0 = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, xs, ys)
    loss = float(loss)  # synchronises
    dt = time.perf_counter() - t0
    window_time += dt
    wall += dt
    window_loss += loss
    window_steps += 1
    if not math.isfinite(loss):
      if getattr(args, "on_divergence", "raise") == "raise":
        raise FloatingPointError(f"non-finite training loss at step {step + 1}")
      diverged_at = step + 1
      log(f"{args.optimizer}: non-finite training loss at step {diverged_at}: stopped")
      break
    done = step + 1
    if bar is not None:
      tps = tokens_per_step * window_steps / max(window_time, 1e-9)
      bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
      bar.update(1)
    if done % eval_every == 0 or done == args.steps:
      ev = evaluate(params)
      tps = tokens_per_step * window_steps / max(window_time, 1e-9)
      row = dict(step=done, tokens=done * tokens_per_step,
                 train_loss=f"{window_loss / window_steps:.5f}", eval_loss=f"{ev:.5f}",
                 eval_ppl=f"{math.exp(ev):.3f}", tokens_per_s=f"{tps:.1f}", wall_s=f"{wall:.2f}")
      rows.append(row)
      write_rows()
      if writer is not None:
        for k in ("train_loss", "eval_loss", "eval_ppl", "tokens_per_s"):
          writer.add_scalar(k, float(row[k]), done)
      if bar is not None:
        bar.write(f"step {done:6d}  train {window_loss / window_steps:.4f}  eval {ev:.4f}  "
                  f"ppl {math.exp(ev):8.2f}  {tps:,.0f} tok/s")
      window_loss, window_steps, window_time = 0.0, 0, 0.0
    stop = args.stop_after is not None and done >= args.stop_after
    if ckpt is not None and ckpt_every and (done % ckpt_every == 0 or done == args.steps
                                            or stop):
      ckpt.save(done, params, opt_state)
    if stop:
      break
  if bar is not None:
    bar.close()
  if writer is not None:
    writer.close()
  final = rows[-1] if rows and diverged_at is None else {}
  return {"optimizer": args.optimizer, "seed": args.seed, "rows": rows, "params": params,
          "diverged_at": diverged_at, "wall_s": wall,
          "final_eval_loss": float(final.get("eval_loss", "nan")),
          "final_eval_ppl": float(final.get("eval_ppl", "nan")),
          "state_mb": fo.state_bytes(opt_state) / 2 ** 20, "compile_s": compile_s,
          "tokens_per_s": float(np.median([float(r["tokens_per_s"]) for r in rows]))
          if rows else float("nan")}


def main(argv=None):
  args = parse_args(argv)
  res = run(args)
  if jax.process_index() != 0:
    return
  print(f"final eval loss {res['final_eval_loss']:.4f}  ppl {res['final_eval_ppl']:.2f}  "
        f"optimizer state {res['state_mb']:.2f} MB  ->  {args.out}/metrics.csv")


if __name__ == "__main__":
  main()
