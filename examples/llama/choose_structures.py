"""The structure chosen per matrix of the LLaMA example from a Fisher report, per budget.

    python examples/llama/choose_structures.py --preset tiny --budgets 0.25,0.5,1,2,3

Reads a report CSV written by ``examples/llama/fim_report.py`` (default: the preset's
last step under ``benchmarks/results/fim_report_PRESET``), takes the candidates of the
``per_layer`` optimizer (``presets.PER_LAYER_OPTIMIZERS``) and prints, per budget (a
fraction of Adam's state over the reported matrices), the state used and how many
matrices each structure gets; ``--show`` prints the full choice of one budget.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

if __package__ in (None, ""):  # `python examples/llama/choose_structures.py`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from flax import nnx

from fisher_optax.fisher import fisher_report, structure_choice
from examples.llama import presets
from examples.llama.model import Llama


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--report", default=None, help="report CSV (default: the preset's last)")
  ap.add_argument("--budgets", default="0.25,0.5,1,2,3")
  ap.add_argument("--show", type=float, default=None, help="print the choice at this budget")
  args = ap.parse_args(argv)
  report_path = args.report or presets.latest_report(args.preset)
  report = fisher_report.FisherReport.from_csv(report_path)
  _, params = nnx.split(nnx.eval_shape(
      lambda: Llama(presets.model_config(args.preset), nnx.Rngs(0))), nnx.Param)
  optimizers = presets.per_layer_candidates(args.preset, 1.0)
  print(f"report: {report_path}\n")
  print("| budget (x Adam's state) | state used | leaves per structure |\n|---|---|---|")
  out = {}
  for b in [float(x) for x in args.budgets.split(",")]:
    choice = structure_choice.choose_structures(report, optimizers, params, budget=b)
    counts: dict = {}
    for s in choice.structures.values():
      counts[s] = counts.get(s, 0) + 1
    text = ", ".join(f"{s} {k}" for s, k in sorted(counts.items(), key=lambda x: -x[1]))
    print(f"| {b:g} | {choice.state_bytes / choice.adam_bytes:.2f}x | {text} |")
    out[b] = choice
  if args.show is not None:
    print()
    print(structure_choice.choose_structures(report, optimizers, params,
                                             budget=args.show).to_markdown())
  return out


if __name__ == "__main__":
  main()
