"""Learning-rate sweep and seeds for fisher_optax optimizers in MaxText's own training
loop, against MaxText's AdamW and Muon, on the bundled Shakespeare corpus:

    python examples/maxtext/prepare_shakespeare.py --out /tmp/shakespeare
    python examples/maxtext/sweep.py --data /tmp/shakespeare --out runs/maxtext_sweep.json

One rule for every optimizer: MaxText's AdamW is tuned first over ``--grid`` times
``--base``; every other optimizer's learning rate over ``--grid`` times AdamW's best
(the fisher_optax optimizers keep MaxText's AdamW at that best rate for the parameters
they send to the fallback, and tune their structured rate). A best rate at the edge of
the grid extends it by one factor of 2, up to twice. Seed 0 tunes; ``--seeds`` seeds
(initialisation and data order) then run at each best rate. The number compared is the
held-out loss after the last step (MaxText's own eval on the held-out plays).
Prints a markdown table and writes every run to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

MODEL = ["per_device_batch_size=2", "max_target_length=128", "base_emb_dim=128",
         "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=512",
         "base_num_decoder_layers=2", "head_dim=32", "enable_checkpointing=false",
         "hardware=cpu", "skip_jax_distributed_system=true", "ici_fsdp_parallelism=4",
         "eval_steps=10"]

# name: (launcher flags, MaxText overrides)
OPTIMIZERS = {
    "adamw": (["--optimizer", "maxtext"], ["opt_type=adamw"]),
    "muon (MaxText)": (["--optimizer", "maxtext"], ["opt_type=muon"]),
    "alice": (["--optimizer", "alice", "--rank", "32"], []),
    "racs": (["--optimizer", "racs"], []),
}


def run(name, lr, seed, args, adam_lr):
  """Held-out loss after the last step of one run, or ``inf`` if it diverged/failed."""
  flags, extra = OPTIMIZERS[name]
  structured = flags[1] != "maxtext"
  lr_args = ["--learning-rate", f"{lr:g}"] if structured else []
  maxtext_lr = adam_lr if structured else lr
  d = pathlib.Path(args.data)
  cmd = [sys.executable, str(HERE / "train.py"), *flags, *lr_args,
         f"run_name=s{abs(hash((name, lr, seed))) % 10**8}", f"base_output_directory={args.work}",
         "dataset_type=hf", "hf_path=json", f"hf_train_files={d / 'train.jsonl'}",
         f"hf_eval_files={d / 'eval.jsonl'}", "tokenizer_type=huggingface",
         f"tokenizer_path={d / 'tokenizer'}", "vocab_size=4096", f"steps={args.steps + 1}",
         f"eval_interval={args.steps}", f"learning_rate={maxtext_lr:g}",
         f"init_weights_seed={seed}", f"data_shuffle_seed={seed}", *MODEL, *extra]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1")
  out = subprocess.run(cmd, env=env, capture_output=True, text=True)
  evals = re.findall(r"Completed eval after train step (\d+), loss=([0-9.naif]+)", out.stdout + out.stderr)
  last = [float(v) for s, v in evals if int(s) == args.steps]
  loss = last[0] if last and out.returncode == 0 else float("inf")
  print(f"{name:<16} lr={lr:<8g} seed={seed}  held-out loss {loss:.4f}", flush=True)
  return loss


def tune(name, center, args, adam_lr, runs):
  grid = [center * g for g in args.grid]
  losses = {lr: run(name, lr, 0, args, adam_lr) for lr in grid}
  for _ in range(2):
    best = min(losses, key=losses.get)
    if best == min(losses):
      new = best / 2
    elif best == max(losses):
      new = best * 2
    else:
      break
    losses[new] = run(name, new, 0, args, adam_lr)
  runs[name] = {"sweep": {f"{k:g}": v for k, v in sorted(losses.items())}}
  return min(losses, key=losses.get)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data", required=True, help="prepare_shakespeare.py's --out")
  p.add_argument("--out", default="runs/maxtext_sweep.json")
  p.add_argument("--work", default="/tmp/maxtext_sweep")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--base", type=float, default=1e-3)
  p.add_argument("--grid", type=float, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--only", nargs="+", default=list(OPTIMIZERS))
  args = p.parse_args()
  runs: dict = {}
  adam_lr = tune("adamw", args.base, args, None, runs)
  best = {"adamw": adam_lr}
  for name in args.only:
    if name != "adamw":
      best[name] = tune(name, adam_lr, args, adam_lr, runs)
  rows = []
  for name, lr in best.items():
    losses = [runs[name]["sweep"][f"{lr:g}"]] + [run(name, lr, s, args, adam_lr)
                                                 for s in range(1, args.seeds)]
    runs[name].update(best=lr, seeds=losses)
    spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
    rows.append(f"| {name} | {lr:g} | {statistics.mean(losses):.3f} ± {spread:.3f} |")
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(dict(steps=args.steps, adamw_lr=adam_lr,
                                                    runs=runs), indent=1))
  print(f"\n| optimizer | learning rate | held-out loss after {args.steps} steps "
        f"(mean ± sd, {args.seeds} seeds) |\n|---|---|---|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
