"""Final eval loss of optimizers at fixed learning rates over seeds (no tuning).

    python benchmarks/fixed_lr.py --preset tiny --runs galore=0.02,alice=0.01 --seeds 0,1,2 \
        --steps 2000 --out benchmarks/results/fixed_lr_tiny

For checking that a change to an optimizer's implementation keeps its training: the
same runs as :mod:`benchmarks.convergence` (the LLaMA example, its evaluation schedule
and its per-configuration cache, so a run already in ``--out`` is not trained again),
at the learning rates given, one run per seed. Prints and writes (``OUT/summary.md``)
each optimizer's mean final eval loss, its standard deviation over seeds and the runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import convergence  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--runs", required=True, help="optimizer=lr pairs, comma separated")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--steps", type=int, default=2000)
  ap.add_argument("--data", default="shakespeare")
  ap.add_argument("--eval-batches", type=int, default=16)
  ap.add_argument("--out", required=True)
  ap.add_argument("--work-dir", default="runs/fixed_lr_work")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  cache = convergence.Cache(out, pathlib.Path(args.work_dir))
  lines = [f"# Fixed learning rates: preset `{args.preset}`, {args.steps} steps, seeds "
           f"{args.seeds}", "", "| optimizer | lr | final eval loss (mean ± sd) | runs |",
           "|---|---|---|---|"]
  summary = {}
  for pair in args.runs.split(","):
    name, lr = pair.split("=")
    losses = []
    for seed in (int(s) for s in args.seeds.split(",")):
      cfg = convergence.RunConfig(preset=args.preset, optimizer=name, lr=float(lr),
                                  hparams=(), steps=args.steps, seed=seed, data=args.data,
                                  batch_size=None, eval_batches=args.eval_batches,
                                  vocab_size=None)
      rec = cache.get(cfg)
      losses.append(rec["final_eval_loss"])
    sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
    summary[name] = dict(lr=float(lr), losses=losses, mean=statistics.mean(losses), sd=sd)
    lines.append(f"| {name} | {lr} | {statistics.mean(losses):.4f} ± {sd:.4f} | "
                 + ", ".join(f"{x:.4f}" for x in losses) + " |")
  lines += ["", "Command: `python benchmarks/fixed_lr.py " + " ".join(
      argv if argv is not None else sys.argv[1:]) + "`"]
  out.mkdir(parents=True, exist_ok=True)
  (out / "summary.md").write_text("\n".join(lines) + "\n")
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  print("\n".join(lines))
  return summary


if __name__ == "__main__":
  main()
