"""Convergence benchmark: every optimizer's learning rate tuned by one rule, then seeds.

    python benchmarks/convergence.py --preset tiny --steps 2000 --sweep-steps 500 \\
        --seeds 0,1,2 --out benchmarks/results/convergence_tiny

For each optimizer (default: tuned AdamW, ``optax.contrib.muon``, racs, alice, alice0, alice_soap,
galore, soap, apollo_mini, swan, and Muon composed of fisher_optax blocks ``fo_muon``; any
name of ``examples/llama/presets.OPTIMIZERS``):

1. **Sweep** at ``--sweep-steps`` (seed ``--sweep-seed``; five evaluations per run, the
   last one its score): peak learning rates on a log
   grid ``lr0 * 2^k`` (``lr0`` the optimizer's default from ``presets.default_lr``), at
   first ``k = -2..1`` (four points, a factor 2 apart), extended one point at a time on
   the side of the best point while the best is at an edge of the grid (at most
   ``--max-extend`` times per side; a best point still on the edge is flagged in the
   report). AdamW also sweeps ``b2`` in {0.95, 0.999} and weight decay in {0, 0.1}
   (decoupled, on matrices); the best (b2, weight decay) is the one whose best learning
   rate scores lowest, and its learning-rate axis gets the edge rule.
2. **Final** runs of the best setting at ``--steps`` for every seed.
3. **Report** (``OUT/summary.md``, ``OUT/summary.json``, ``OUT/sweep.png``,
   ``OUT/curves.png``): end-of-training eval loss (mean +- std over seeds), steps and
   training wall-clock to reach tuned AdamW's final eval loss (mean over its seeds),
   interpolated between evaluations (every 2.5% of the budget), as speed-ups
   ``budget / steps`` and ``AdamW's wall / wall``; tokens/s; optimizer-state bytes; and a
   verdict against AdamW: wins / ties / loses, a tie being a difference within the sum of
   the two seed standard deviations.

Every run is cached under ``OUT/runs/<key>.json`` where ``key`` hashes its whole
configuration (preset, optimizer, learning rate, hyperparameters, budget, seed, data,
batch, evaluation): re-running the command skips finished runs, and an interrupted run
resumes from its last orbax checkpoint under ``--work-dir`` (kept outside the results,
deleted when the run finishes). A run whose training loss becomes non-finite is recorded
as diverged (step included) and ranks last in its sweep. ``OUT/runs`` is small (metrics
only) and meant to be committed, so later sessions continue where earlier ones stopped.
``--report-only`` writes the report from the cache without training (missing runs are
listed); several processes with disjoint ``--optimizers`` may share one ``OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import pathlib
import shutil
import sys
import time
from typing import Callable, Optional

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples.llama import curves
from examples.llama import presets

DEFAULT_OPTIMIZERS = ("adamw,muon,racs,alice,alice0,alice_soap,galore,soap,apollo_mini,swan,"
                      "fo_muon")
ADAMW_GRID = [dict(b2=b2, weight_decay=wd) for b2 in (0.999, 0.95) for wd in (0.0, 0.1)]
EVALS_PER_RUN = 40  # every 2.5% of the budget: steps-to-target resolved to well under 5%
SWEEP_EVALS = 5  # a sweep run is judged by its final eval loss only


@dataclasses.dataclass(frozen=True)
class RunConfig:
  preset: str
  optimizer: str
  lr: float
  hparams: tuple  # sorted (key, value) pairs
  steps: int
  seed: int
  data: str
  batch_size: Optional[int]
  eval_batches: int
  vocab_size: Optional[int]
  evals: int = EVALS_PER_RUN

  @property
  def eval_every(self) -> int:
    return max(1, self.steps // self.evals)

  def key(self) -> str:
    blob = json.dumps(dataclasses.asdict(self) | {"eval_every": self.eval_every},
                      sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]

  def label(self) -> str:
    hp = ",".join(f"{k}={v}" for k, v in self.hparams)
    return (f"{self.optimizer} lr={self.lr:.3g}" + (f" {hp}" if hp else "")
            + f" steps={self.steps} seed={self.seed}")


def grid_lr(base: float, k: int) -> float:
  """The k-th point of the log grid: ``base * 2^k`` rounded to 4 significant digits."""
  return float(f"{base * 2.0 ** k:.4g}")


# ---------------------------------------------------------------------------- running


def train_run(cfg: RunConfig, work_dir: pathlib.Path, progress: bool) -> dict:
  """Trains one configuration with the LLaMA example (resumable); returns its record."""
  from examples.llama import train as train_lib
  argv = ["--preset", cfg.preset, "--optimizer", cfg.optimizer, "--lr", repr(cfg.lr),
          "--steps", str(cfg.steps), "--seed", str(cfg.seed), "--data", cfg.data,
          "--eval-every", str(cfg.eval_every), "--eval-batches", str(cfg.eval_batches),
          "--out", str(work_dir), "--resume", "--on-divergence", "stop",
          "--checkpoint-every", str(max(cfg.eval_every, cfg.steps // 10))]
  if cfg.hparams:
    argv += ["--hparams", json.dumps(dict(cfg.hparams))]
  if cfg.batch_size:
    argv += ["--batch-size", str(cfg.batch_size)]
  if cfg.vocab_size:
    argv += ["--vocab-size", str(cfg.vocab_size)]
  if not progress:
    argv.append("--no-progress")
  res = train_lib.run(train_lib.parse_args(argv))
  res.pop("params", None)
  return dict(config=dataclasses.asdict(cfg), key=cfg.key(), rows=res["rows"],
              final_eval_loss=res["final_eval_loss"], diverged_at=res["diverged_at"],
              tokens_per_s=res["tokens_per_s"], wall_s=res["wall_s"],
              state_bytes=int(round(res["state_mb"] * 2 ** 20)), compile_s=res["compile_s"],
              finished=time.strftime("%Y-%m-%d %H:%M:%S"))


class Cache:
  """Finished runs, one JSON file per configuration key."""

  def __init__(self, out: pathlib.Path, work: pathlib.Path,
               runner: Callable[[RunConfig, pathlib.Path, bool], dict] = train_run,
               progress: bool = False, train: bool = True):
    self.dir = out / "runs"
    self.dir.mkdir(parents=True, exist_ok=True)
    self.work = work
    self.runner = runner
    self.progress = progress
    self.train = train
    self.missing: list[RunConfig] = []

  def get(self, cfg: RunConfig) -> Optional[dict]:
    """The cached record of ``cfg``; trains it first unless training is off."""
    path = self.dir / f"{cfg.key()}.json"
    if path.exists():
      return json.loads(path.read_text())
    if not self.train:
      self.missing.append(cfg)
      return None
    print(f"[convergence] run {cfg.label()}  (key {cfg.key()})", flush=True)
    work = self.work / cfg.key()
    rec = self.runner(cfg, work, self.progress)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_finite(rec), indent=1))
    tmp.replace(path)
    shutil.rmtree(work, ignore_errors=True)
    status = (f"diverged at step {rec['diverged_at']}" if rec["diverged_at"]
              else f"final eval loss {rec['final_eval_loss']:.4f}")
    print(f"[convergence]   -> {status}", flush=True)
    return rec


def score(rec: Optional[dict]) -> float:
  """Sweep score: final eval loss; diverged or missing runs rank last."""
  v = None if rec is None else rec.get("final_eval_loss")
  if rec is None or rec.get("diverged_at") or v is None or not math.isfinite(v):
    return math.inf
  return float(v)


# ------------------------------------------------------------------------------ sweep


def sweep_lr(make: Callable[[float], RunConfig], cache: Cache, base: float,
             max_extend: int) -> dict:
  """Log-grid sweep with edge extension. Returns points, best lr and an edge flag."""
  ks = [-2, -1, 0, 1]
  ext = {-1: 0, 1: 0}
  while True:
    pts = {k: cache.get(make(grid_lr(base, k))) for k in ks}
    scores = {k: score(r) for k, r in pts.items()}
    if any(r is None for r in pts.values()):  # report-only with missing runs
      finite = {k: s for k, s in scores.items() if math.isfinite(s)}
      best = min(finite, key=finite.get) if finite else None
      return dict(points=pts, best_k=best, best_lr=None if best is None else grid_lr(base, best),
                  best_score=finite.get(best, math.inf) if best is not None else math.inf,
                  at_edge=None, complete=False)
    best = min(ks, key=lambda k: (scores[k], k))
    side = -1 if best == min(ks) else (1 if best == max(ks) else 0)
    if side == 0 or not math.isfinite(scores[best]) or ext[side] >= max_extend:
      return dict(points=pts, best_k=best, best_lr=grid_lr(base, best),
                  best_score=scores[best], at_edge=side != 0, complete=True)
    ext[side] += 1
    ks = sorted(ks + [(min(ks) - 1) if side < 0 else (max(ks) + 1)])


def tune(name: str, args, cache: Cache) -> dict:
  """Sweep of one optimizer; returns its best setting and every sweep point."""
  base = presets.default_lr(args.preset, name)
  grid = ([{}] if name != "adamw" else
          [args.adamw_hparams] if args.adamw_hparams is not None else ADAMW_GRID)
  # A sweep at the full budget records as many evaluations as a final run, so its
  # sweep-seed run is that seed's final run (one cache entry, not two).
  evals = EVALS_PER_RUN if args.sweep_steps == args.steps else SWEEP_EVALS
  sweeps = []
  for hp in grid:
    def make(lr, hp=hp):
      return RunConfig(args.preset, name, lr, tuple(sorted(hp.items())), args.sweep_steps,
                       args.sweep_seed, args.data, args.batch_size, args.eval_batches,
                       args.vocab_size, evals=evals)
    sw = sweep_lr(make, cache, base, args.max_extend)
    sweeps.append(dict(hparams=hp, **sw))
  done = [s for s in sweeps if s["best_lr"] is not None]
  best = min(done, key=lambda s: s["best_score"]) if done else None
  return dict(optimizer=name, sweeps=sweeps, best=best,
              complete=all(s["complete"] for s in sweeps))


def finals(name: str, tuned: dict, args, cache: Cache) -> list[dict]:
  best = tuned["best"]
  if best is None or not tuned["complete"]:
    return []
  out = []
  for seed in args.seed_list:
    cfg = RunConfig(args.preset, name, best["best_lr"], tuple(sorted(best["hparams"].items())),
                    args.steps, seed, args.data, args.batch_size, args.eval_batches,
                    args.vocab_size)
    rec = cache.get(cfg)
    if rec is not None:
      out.append(rec)
  return out


# ----------------------------------------------------------------------------- report


def analyse(results: dict[str, dict], reference: str = "adamw") -> dict:
  """Per-optimizer statistics of the final runs against the reference's final loss."""
  ref_runs = results.get(reference, {}).get("finals", [])
  ref_losses = [score(r) for r in ref_runs]
  target, target_std = curves.mean_std(ref_losses)
  ref_wall = [curves.crossing(r["rows"], target, "wall_s") for r in ref_runs]
  ref_wall_mean, _ = curves.mean_std([w if w is not None else r["wall_s"]
                                      for w, r in zip(ref_wall, ref_runs)])
  rows = []
  for name, res in results.items():
    runs = res["finals"]
    if not runs:
      rows.append(dict(optimizer=name, seeds=0, complete=False))
      continue
    losses = [score(r) for r in runs]
    mean, std = curves.mean_std(losses)
    budget = runs[0]["config"]["steps"]
    steps_hit = [curves.crossing(r["rows"], target, "step") if math.isfinite(target) else None
                 for r in runs]
    wall_hit = [curves.crossing(r["rows"], target, "wall_s") if math.isfinite(target) else None
                for r in runs]
    speed = [budget / s if s else None for s in steps_hit]
    wall_speed = [ref_wall_mean / w if w else None for w in wall_hit]
    sp_mean, sp_std = curves.mean_std(speed)
    wsp_mean, wsp_std = curves.mean_std(wall_speed)
    best = res["tuned"]["best"]
    rows.append(dict(
        optimizer=name, seeds=len(runs), complete=len(runs) == res["expected_seeds"],
        lr=best["best_lr"], hparams=best["hparams"], lr_at_grid_edge=best["at_edge"],
        final_loss_mean=mean, final_loss_std=std,
        final_losses=losses, diverged=sum(1 for r in runs if r.get("diverged_at")),
        steps_to_target=steps_hit, reached=sum(1 for s in steps_hit if s is not None),
        speedup_steps_mean=sp_mean, speedup_steps_std=sp_std,
        speedup_wall_mean=wsp_mean, speedup_wall_std=wsp_std,
        tokens_per_s=curves.mean_std([r["tokens_per_s"] for r in runs])[0],
        state_mb=runs[0]["state_bytes"] / 2 ** 20,
        verdict=("reference" if name == reference else
                 "no reference" if not math.isfinite(target) else
                 curves.verdict(mean, std, target, target_std))))
  return dict(reference=reference, target=target, target_std=target_std, rows=rows)


def _finite(x):
  """JSON-safe copy: non-finite floats become null."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {str(k): _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  return x


def _pm(m, s, fmt):
  if m is None or not math.isfinite(m):
    return "-"
  return f"{m:{fmt}} ± {s:{fmt}}"


def write_report(out: pathlib.Path, args, results: dict, table: dict, command: str):
  lines = [f"# Convergence benchmark: preset `{args.preset}`, {args.steps} steps, "
           f"seeds {args.seeds}, data `{args.data}`", "",
           f"Learning rates tuned per optimizer at {args.sweep_steps} steps (seed "
           f"{args.sweep_seed}) on the grid `default * 2^k`; "
           + ("AdamW also over b2 in {0.95, 0.999} x weight decay in {0, 0.1}. "
              if args.adamw_hparams is None else
              f"AdamW's other hyperparameters fixed at {args.adamw_hparams}. ")
           + "Target: tuned AdamW's final eval "
           f"loss, {table['target']:.4f} ± {table['target_std']:.4f}. Speed-up (steps) = "
           "budget / steps to reach the target; speed-up (wall) = AdamW's training time "
           "to the target / this one's. ± is the standard deviation over seeds.", "",
           "| optimizer | tuned lr (hparams) | final eval loss | vs AdamW | reached target "
           "| speed-up (steps) | speed-up (wall) | tokens/s | state MB |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in table["rows"]:
    if not r["seeds"]:
      lines.append(f"| {r['optimizer']} | (not finished) | | | | | | | |")
      continue
    hp = ", ".join(f"{k}={v}" for k, v in r["hparams"].items())
    lr = f"{r['lr']:.3g}" + (f" ({hp})" if hp else "") + (" edge!" if r["lr_at_grid_edge"]
                                                          else "")
    seeds = f"{r['seeds']}" + ("" if r["complete"] else " (incomplete)")
    lines.append(
        f"| {r['optimizer']} | {lr} | {_pm(r['final_loss_mean'], r['final_loss_std'], '.4f')}"
        f" | {r['verdict']} | {r['reached']}/{seeds} | "
        f"{_pm(r['speedup_steps_mean'], r['speedup_steps_std'], '.2f')} | "
        f"{_pm(r['speedup_wall_mean'], r['speedup_wall_std'], '.2f')} | "
        f"{r['tokens_per_s']:,.0f} | {r['state_mb']:.2f} |")
  lines += ["", "## Sweeps (final eval loss at the sweep budget; x = diverged)", ""]
  for name, res in results.items():
    for sw in res["tuned"]["sweeps"]:
      hp = ", ".join(f"{k}={v}" for k, v in sw["hparams"].items())
      pts = []
      for k in sorted(sw["points"]):
        rec = sw["points"][k]
        lr = grid_lr(presets.default_lr(args.preset, name), k)
        v = "?" if rec is None else ("x" if not math.isfinite(score(rec)) else
                                     f"{score(rec):.4f}")
        pts.append(f"{lr:.3g}: {v}" + (" *" if k == sw["best_k"] else ""))
      lines.append(f"- {name}" + (f" ({hp})" if hp else "") + ": " + "; ".join(pts))
  lines += ["", f"Command: `{command}`", ""]
  (out / "summary.md").write_text("\n".join(lines))
  return "\n".join(lines)


def plot(out: pathlib.Path, args, results: dict, table: dict):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for i, (name, res) in enumerate(results.items()):
    for j, sw in enumerate(res["tuned"]["sweeps"]):
      ks = sorted(k for k, r in sw["points"].items() if r is not None)
      if not ks:
        continue
      base = presets.default_lr(args.preset, name)
      lrs = [grid_lr(base, k) for k in ks]
      sc = [score(sw["points"][k]) for k in ks]
      hp = ", ".join(f"{k}={v}" for k, v in sw["hparams"].items())
      fin = [s if math.isfinite(s) else np.nan for s in sc]
      ax.plot(lrs, fin, marker="o", color=f"C{i}", alpha=1.0 if j == 0 else 0.55,
              ls=["-", "--", ":", "-."][j % 4], label=name + (f" ({hp})" if hp else ""))
      top = np.nanmax(fin) if np.isfinite(fin).any() else 10.0
      for lr, s in zip(lrs, sc):
        if not math.isfinite(s):
          ax.plot([lr], [top], "x", color=f"C{i}", ms=9)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("peak learning rate")
  ax.set_ylabel(f"eval loss after {args.sweep_steps} steps")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(out / "sweep.png", dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for i, (name, res) in enumerate(results.items()):
    runs = [r for r in res["finals"] if r["rows"]]
    if not runs:
      continue
    n = min(len(r["rows"]) for r in runs)
    steps = np.array([float(x["step"]) for x in runs[0]["rows"][:n]])
    ls = np.array([[float(x["eval_loss"]) for x in r["rows"][:n]] for r in runs])
    m, s = ls.mean(0), ls.std(0)
    ax.plot(steps, m, color=f"C{i}", label=name)
    ax.fill_between(steps, m - s, m + s, color=f"C{i}", alpha=0.2)
  if math.isfinite(table["target"]):
    ax.axhline(table["target"], color="k", lw=0.8, ls="--", label="tuned AdamW final")
  ax.set_xlabel("step")
  ax.set_ylabel("eval loss (mean ± std over seeds)")
  ax.set_ylim(top=min(ax.get_ylim()[1], table["target"] + 1.5)
              if math.isfinite(table["target"]) else None)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out / "curves.png", dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------------------- main


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny", choices=list(presets.MODELS))
  ap.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS)
  ap.add_argument("--steps", type=int, default=2000, help="full budget (final runs)")
  ap.add_argument("--sweep-steps", type=int, default=500, help="budget of sweep runs")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--sweep-seed", type=int, default=0)
  ap.add_argument("--max-extend", type=int, default=3,
                  help="grid extensions per side while the best lr is at an edge")
  ap.add_argument("--adamw-hparams", type=json.loads, default=None,
                  help="JSON dict fixing AdamW's b2/weight decay (then only its lr is swept)")
  ap.add_argument("--data", default="shakespeare")
  ap.add_argument("--batch-size", type=int, default=None)
  ap.add_argument("--vocab-size", type=int, default=None)
  ap.add_argument("--eval-batches", type=int, default=16)
  ap.add_argument("--out", default=None, help="default: benchmarks/results/convergence_PRESET")
  ap.add_argument("--work-dir", default="runs/convergence_work",
                  help="checkpoints of unfinished runs (not results)")
  ap.add_argument("--phase", default="all", choices=("sweep", "all"),
                  help="'sweep' stops after the sweeps")
  ap.add_argument("--report-only", action="store_true", help="no training; report the cache")
  ap.add_argument("--progress", action="store_true", help="tqdm bar per run")
  args = ap.parse_args(argv)
  args.seed_list = [int(s) for s in args.seeds.split(",")]
  args.out = args.out or f"benchmarks/results/convergence_{args.preset}"
  return args


def main(argv=None, runner=train_run):
  args = parse_args(argv)
  out = pathlib.Path(args.out)
  cache = Cache(out, pathlib.Path(args.work_dir), runner, args.progress,
                train=not args.report_only)
  names = [s.strip() for s in args.optimizers.split(",") if s.strip()]
  for n in names:
    if n not in presets.OPTIMIZERS:
      raise SystemExit(f"unknown optimizer {n!r}; choose from {presets.OPTIMIZERS}")
  results = {}
  for name in names:  # sweeps first: they decide what the final runs are
    results[name] = dict(tuned=tune(name, args, cache), finals=[],
                         expected_seeds=len(args.seed_list))
  if args.phase == "all":
    for name in names:
      results[name]["finals"] = finals(name, results[name]["tuned"], args, cache)
  table = analyse(results)
  command = "python benchmarks/convergence.py " + " ".join(
      a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only")
  out.mkdir(parents=True, exist_ok=True)
  (out / "summary.json").write_text(json.dumps(_finite(
      dict(table, preset=args.preset, steps=args.steps, sweep_steps=args.sweep_steps,
           seeds=args.seed_list, data=args.data,
           sweeps={n: [dict(hparams=s["hparams"], best_lr=s["best_lr"], at_edge=s["at_edge"],
                            points={str(grid_lr(presets.default_lr(args.preset, n), k)):
                                    (None if r is None else score(r))
                                    for k, r in sorted(s["points"].items())})
                       for s in r["tuned"]["sweeps"]] for n, r in results.items()})),
      indent=1))
  text = write_report(out, args, results, table, command)
  plot(out, args, results, table)
  print(text)
  if cache.missing:
    print(f"[convergence] {len(cache.missing)} runs not in the cache (report-only):")
    for c in cache.missing:
      print("   ", c.label())
  return results, table


if __name__ == "__main__":
  main()
