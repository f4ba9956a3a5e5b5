"""Compare optimizers on the same data, seed(s) and budget; write a summary and a plot.

    python examples/llama/compare.py --preset tiny --optimizers adam,racs,alice,galore \
        --steps 300 --out runs/compare [--seeds 0,1,2]

Writes ``OUT/summary.md`` (final eval perplexity as mean +- std over seeds, speed-up in
steps to reach Adam's final eval loss, tokens/s, effective throughput, optimizer-state
MB), ``OUT/summary.json``, ``OUT/eval_loss.png`` (eval loss vs steps and vs wall time)
and each run's ``metrics.csv`` under ``OUT/<optimizer>/seed<k>/``. No checkpoints are
written unless ``--checkpoint-every N`` asks for them.

Each optimizer runs at its paper learning rate (``--lr`` is not swept here): this is a
quick look, not a tuned comparison. ``benchmarks/convergence.py`` tunes every
optimizer's learning rate by one rule before comparing.

Definitions (paper App. "Throughput estimation"): the speed-up of an optimizer is
``budget / S_opt`` where ``S_opt`` is the step at which its eval loss first reaches
Adam's final eval loss (same seed), linearly interpolated between evaluations
(:func:`examples.llama.curves.crossing`; evaluations every 2.5% of the budget by
default); a run that never reaches it is counted as "not reached", not as a number.
Effective throughput = tokens/s x speed-up.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

if __package__ in (None, ""):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np

from examples.llama import curves
from examples.llama import presets
from examples.llama import train as train_lib


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny", choices=list(presets.MODELS))
  ap.add_argument("--optimizers", default="adam,racs,alice,galore")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--seeds", default="0", help="comma-separated seeds (model init and data)")
  ap.add_argument("--out", default="runs/compare")
  ap.add_argument("--eval-every", type=int, default=None,
                  help="default: every 2.5%% of --steps")
  ap.add_argument("--checkpoint-every", type=int, default=0,
                  help="orbax checkpoints every N steps (default 0: none)")
  ap.add_argument("--eval-batches", type=int, default=8)
  ap.add_argument("--batch-size", type=int, default=None)
  ap.add_argument("--data", default="shakespeare")
  ap.add_argument("--cache-dir", default=None)
  ap.add_argument("--no-progress", action="store_true")
  return ap.parse_args(argv)


def summarize(results: dict[str, list[dict]], steps: int) -> list[dict]:
  adam = results.get("adam")
  table = []
  for name, runs in results.items():
    ppl = np.array([r["final_eval_ppl"] for r in runs])
    loss = np.array([r["final_eval_loss"] for r in runs])
    tps = np.array([r["tokens_per_s"] for r in runs])
    speed = []
    if adam:
      for k, r in enumerate(runs):
        target = adam[min(k, len(adam) - 1)]["final_eval_loss"]
        s_opt = curves.crossing(r["rows"], target) if np.isfinite(target) else None
        speed.append(steps / s_opt if s_opt else None)
    reached = [s for s in speed if s is not None]
    sp_mean, sp_std = curves.mean_std(reached)
    table.append(dict(
        optimizer=name, seeds=len(runs), ppl_mean=float(ppl.mean()), ppl_std=float(ppl.std()),
        loss_mean=float(loss.mean()), loss_std=float(loss.std()),
        speedups=speed, reached=len(reached),
        speedup_mean=sp_mean if reached else None, speedup_std=sp_std if reached else None,
        tokens_per_s=float(tps.mean()),
        effective_tokens_per_s=float(tps.mean() * sp_mean) if reached else None,
        state_mb=float(runs[0]["state_mb"])))
  return table


def write_summary(out: pathlib.Path, table: list[dict], args) -> str:
  lines = [f"# Optimizer comparison: preset `{args.preset}`, {args.steps} steps, seeds "
           f"{args.seeds}, data `{args.data}`", "",
           "| optimizer | final eval ppl | final eval loss | speed-up vs Adam (steps) | "
           "tokens/s | effective tokens/s | optimizer state MB |",
           "|---|---|---|---|---|---|---|"]
  for r in table:
    if r["speedup_mean"] is None:
      speed = "not reached" if r["speedups"] else "-"
      eff = "-"
    else:
      speed = f"{r['speedup_mean']:.2f} ± {r['speedup_std']:.2f}"
      if r["reached"] < r["seeds"]:
        speed += f" ({r['seeds'] - r['reached']} of {r['seeds']} not reached)"
      eff = f"{r['effective_tokens_per_s']:,.0f}"
    lines.append(
        f"| {r['optimizer']} | {r['ppl_mean']:.2f} ± {r['ppl_std']:.2f} | "
        f"{r['loss_mean']:.4f} ± {r['loss_std']:.4f} | {speed} | {r['tokens_per_s']:,.0f} | "
        f"{eff} | {r['state_mb']:.2f} |")
  lines += ["", "± is the standard deviation over seeds (0 with one seed). Speed-up: the "
            "budget / the (interpolated) step at which this optimizer first reaches Adam's "
            "final eval loss of the same seed, over the seeds that reach it. Learning rates "
            "are the paper's, not tuned (see benchmarks/convergence.py for a tuned "
            "comparison). Command: `python examples/llama/compare.py "
            + " ".join(sys.argv[1:]) + "`"]
  text = "\n".join(lines) + "\n"
  (out / "summary.md").write_text(text)
  return text


def plot(out: pathlib.Path, results: dict[str, list[dict]]):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, (name, runs) in enumerate(results.items()):
    color = f"C{i}"
    for k, r in enumerate(runs):
      steps = [int(x["step"]) for x in r["rows"]]
      wall = [float(x["wall_s"]) for x in r["rows"]]
      loss = [float(x["eval_loss"]) for x in r["rows"]]
      label = name if k == 0 else None
      axes[0].plot(steps, loss, color=color, alpha=0.85, label=label)
      axes[1].plot(wall, loss, color=color, alpha=0.85, label=label)
  axes[0].set_xlabel("step")
  axes[1].set_xlabel("training wall time (s)")
  for ax in axes:
    ax.set_ylabel("eval loss")
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(out / "eval_loss.png", dpi=120)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  names = [s.strip() for s in args.optimizers.split(",") if s.strip()]
  seeds = [int(s) for s in args.seeds.split(",")]
  results: dict[str, list[dict]] = {}
  for name in names:
    for seed in seeds:
      targs = train_lib.parse_args([
          "--preset", args.preset, "--optimizer", name, "--steps", str(args.steps),
          "--seed", str(seed), "--out", str(out / name / f"seed{seed}"),
          "--eval-batches", str(args.eval_batches), "--data", args.data]
          + ["--eval-every", str(args.eval_every or max(1, args.steps // 40)),
             "--checkpoint-every", str(args.checkpoint_every)]
          + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
          + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
          + (["--no-progress"] if args.no_progress else []))
      res = train_lib.run(targs)
      res.pop("params")
      results.setdefault(name, []).append(res)
      print(f"{name} seed {seed}: final eval loss {res['final_eval_loss']:.4f} "
            f"ppl {res['final_eval_ppl']:.2f}")
  table = summarize(results, args.steps)
  (out / "summary.json").write_text(json.dumps(table, indent=2))
  print(write_summary(out, table, args))
  plot(out, results)
  print(f"plot: {out / 'eval_loss.png'}")


if __name__ == "__main__":
  main()
