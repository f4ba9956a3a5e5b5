"""Per-layer Fisher-structure report of the LLaMA example during training.

    python examples/llama/fim_report.py --preset tiny --at-steps 0,100,300 --optimizer adamw
    python examples/llama/fim_report.py --preset small --data brown --at-steps 0,100,330 \\
        --optimizer adamw --out runs/fim_small

Trains the preset with ``--optimizer`` (the LLaMA example's training step and learning
rate schedule over ``max(at_steps)`` steps) and, at each step of ``--at-steps``, takes
``--samples`` micro-batch gradients of ``--micro-batch`` sequences (fixed windows of the
training stream, the same at every step) and reports, for every matrix the named
optimizers route (embeddings excluded), each structure's relative distance to the
empirical Fisher (``fisher_optax.fisher.fisher_report``). Writes ``OUT/step_T.md``,
``OUT/step_T.csv`` and ``OUT/step_T.png`` (heat map) per step, and ``OUT/summary.md``:
the lowest-error structure per matrix at each step, and each structure's mean error over
attention and MLP matrices.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

if __package__ in (None, ""):  # `python examples/llama/fim_report.py`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax
import numpy as np
import optax
from flax import nnx

import fisher_optax as fo
from fisher_optax.fisher import fisher_report, structure_errors
from examples.llama import data as data_lib
from examples.llama import train


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--data", default="shakespeare")
  ap.add_argument("--optimizer", default="adamw")
  ap.add_argument("--at-steps", default="0,100")
  ap.add_argument("--samples", type=int, default=32, help="micro-batch gradients per report")
  ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
  ap.add_argument("--rank", type=int, default=None,
                  help="Alice's rank (default: the preset's low-rank setting)")
  ap.add_argument("--structures", default=",".join(structure_errors.STRUCTURES),
                  help="comma-separated structures (default: all; 'general' and 'kronecker' "
                       "iterate, and dominate the time on wide layers)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/fim_report")
  return ap.parse_args(argv)


def _group(name: str) -> str:
  return "attention" if "attn" in name else "mlp" if "mlp" in name else "other"


def summarize(reports: dict, structures) -> str:
  lines = ["# Fisher structure report", ""]
  steps = sorted(reports)
  names = reports[steps[0]].matrices
  lines += ["Lowest-error structure per matrix:", "",
            "| matrix | " + " | ".join(f"step {t}" for t in steps) + " |",
            "|---|" + "---|" * len(steps)]
  best = {t: reports[t].best() for t in steps}
  for name in names:
    lines.append(f"| {name} | " + " | ".join(best[t][name] for t in steps) + " |")
  lines += ["", "Mean relative error by group:", "",
            "| step | group | " + " | ".join(structures) + " |",
            "|---|---|" + "---|" * len(structures)]
  for t in steps:
    table = reports[t].table()
    for group in ("attention", "mlp", "other"):
      rows = [v for k, v in table.items() if _group(k) == group]
      if rows:
        lines.append(f"| {t} | {group} | " + " | ".join(
            f"{np.mean([r[s] for r in rows]):.3f}" for s in structures) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  args = parse_args(argv)
  at = sorted({int(t) for t in args.at_steps.split(",")})
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  targs = train.parse_args(["--preset", args.preset, "--data", args.data, "--optimizer",
                            args.optimizer, "--steps", str(max(max(at), 1)), "--seed",
                            str(args.seed), "--out", str(out / "train")])
  setup = train.build(targs)
  corpus, ctx = setup.corpus, setup.cfg.context
  params = train.init_params(setup, args.seed)
  opt_state = setup.tx.init(params)
  train_step, _ = train.make_steps(setup)
  graphdef = setup.graphdef

  def loss_fn(p, batch):
    x, y = batch
    logits = nnx.merge(graphdef, p)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  # the same micro-batches at every reported step (a stream of the training data)
  probe = [data_lib.train_batch(corpus.train_ids, 10_000 + args.seed, k, args.micro_batch, ctx)
           for k in range(args.samples)]
  rank = args.rank or train.presets.LOW_RANK[args.preset][0]
  mask = fo.path_mask(exclude=["embed"], on_unmatched="ignore")
  structures = tuple(x.strip() for x in args.structures.split(",") if x.strip())
  reports = {}
  step = 0
  start = time.perf_counter()
  for target in at:
    while step < target:
      x, y = data_lib.train_batch(corpus.train_ids, args.seed, step, setup.batch_size, ctx)
      params, opt_state, loss = train_step(params, opt_state, x[None], y[None])
      step += 1
    rep = fisher_report.fisher_report(loss_fn, params, probe, rank=rank, mask=mask,
                                      structures=structures)
    reports[target] = rep
    rep.to_csv(out / f"step_{target}.csv")
    (out / f"step_{target}.md").write_text(rep.to_markdown() + "\n")
    rep.heatmap(out / f"step_{target}.png",
                title=f"{args.preset}, {args.optimizer}, step {target} ({rep.samples} samples)")
    print(f"step {target}: train loss {float(loss) if step else float('nan'):.3f}; "
          f"best per matrix: {sorted(set(rep.best().values()))} "
          f"({time.perf_counter() - start:.0f} s so far)", flush=True)
  summary = summarize(reports, structures)
  (out / "summary.md").write_text(summary)
  print(summary)
  return reports


if __name__ == "__main__":
  main()
