"""The convergence harness (benchmarks/convergence.py) on synthetic runs and one real
minimal run: edge extension, caching/resume, divergence, target interpolation."""

import json
import math

import numpy as np
import pytest

from benchmarks import convergence
from examples.llama import curves, presets


def _curve(final, steps, n=10, start=8.0):
  """Eval rows decaying geometrically from ``start`` to ``final``."""
  xs = np.linspace(steps / n, steps, n)
  ls = final + (start - final) * np.exp(-4 * xs / steps)
  ls = ls - ls[-1] + final
  return [dict(step=int(x), wall_s=float(x) * 0.1, eval_loss=float(l)) for x, l in zip(xs, ls)]


class FakeRunner:
  """Deterministic stand-in for training: loss is a parabola in log2(lr / best_lr)."""

  def __init__(self, best_lr, diverge_above=math.inf, seed_noise=0.01):
    self.best_lr, self.diverge_above, self.seed_noise = best_lr, diverge_above, seed_noise
    self.calls = []

  def __call__(self, cfg, work_dir, progress):
    self.calls.append(cfg)
    best = self.best_lr[cfg.optimizer] if isinstance(self.best_lr, dict) else self.best_lr
    if cfg.lr > self.diverge_above:
      return dict(config={"steps": cfg.steps}, key=cfg.key(), rows=[],
                  final_eval_loss=None, diverged_at=3, tokens_per_s=1.0, wall_s=0.1,
                  state_bytes=100, compile_s=0.0)
    final = 3.0 + 0.1 * math.log2(cfg.lr / best) ** 2 + self.seed_noise * cfg.seed
    if cfg.optimizer == "racs":
      final -= 0.2
    rows = _curve(final, cfg.steps)
    return dict(config={"steps": cfg.steps}, key=cfg.key(), rows=rows, final_eval_loss=final,
                diverged_at=None, tokens_per_s=1000.0, wall_s=rows[-1]["wall_s"],
                state_bytes=2 ** 20, compile_s=0.0)


def _argv(tmp_path, *extra):
  return ["--preset", "tiny", "--steps", "40", "--sweep-steps", "10", "--seeds", "0,1",
          "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), *extra]


def test_sweep_extends_the_grid_until_the_best_point_is_inside(tmp_path):
  base = presets.default_lr("tiny", "racs")
  runner = FakeRunner(best_lr=base * 2 ** 3)  # best is 3 grid points above the default
  results, _ = convergence.main(_argv(tmp_path, "--optimizers", "racs", "--phase", "sweep"),
                                runner=runner)
  sw = results["racs"]["tuned"]["sweeps"][0]
  assert sw["best_lr"] == convergence.grid_lr(base, 3)
  assert sorted(sw["points"]) == [-2, -1, 0, 1, 2, 3, 4]  # extended to the right 3 times
  assert not sw["at_edge"]
  assert len(runner.calls) == 7 and {c.steps for c in runner.calls} == {10}


def test_edge_is_flagged_when_extensions_run_out(tmp_path):
  base = presets.default_lr("tiny", "racs")
  runner = FakeRunner(best_lr=base / 2 ** 6)
  results, _ = convergence.main(
      _argv(tmp_path, "--optimizers", "racs", "--phase", "sweep", "--max-extend", "1"),
      runner=runner)
  sw = results["racs"]["tuned"]["sweeps"][0]
  assert sorted(sw["points"]) == [-3, -2, -1, 0, 1] and sw["best_k"] == -3 and sw["at_edge"]
  assert "edge!" not in (tmp_path / "out" / "summary.md").read_text()  # no finals yet


def test_runs_are_cached_and_a_rerun_trains_nothing(tmp_path):
  runner = FakeRunner(best_lr=presets.default_lr("tiny", "racs"))
  argv = _argv(tmp_path, "--optimizers", "racs")
  convergence.main(argv, runner=runner)
  first = len(runner.calls)
  assert first == 4 + 2  # four sweep points (best inside), two seeds at the full budget
  files = sorted((tmp_path / "out" / "runs").glob("*.json"))
  assert len(files) == first
  runner2 = FakeRunner(best_lr=presets.default_lr("tiny", "racs"))
  convergence.main(argv, runner=runner2)
  assert runner2.calls == []
  # one more seed: only that run is trained
  convergence.main(argv[:argv.index("--seeds") + 1] + ["0,1,2"] + argv[argv.index("--seeds") + 2:],
                   runner=runner2)
  assert [c.seed for c in runner2.calls] == [2] and runner2.calls[0].steps == 40


def test_keys_depend_on_every_field():
  cfg = convergence.RunConfig("tiny", "racs", 0.02, (), 100, 0, "shakespeare", None, 16, None)
  keys = {cfg.key()}
  for change in (dict(lr=0.04), dict(hparams=(("b2", 0.95),)), dict(steps=200), dict(seed=1),
                 dict(data="brown"), dict(batch_size=4), dict(eval_batches=8),
                 dict(optimizer="alice"), dict(vocab_size=512), dict(preset="small")):
    keys.add(convergence.RunConfig(**{**cfg.__dict__, **change}).key())
  assert len(keys) == 11


def test_diverged_runs_are_recorded_and_rank_last(tmp_path):
  base = presets.default_lr("tiny", "racs")
  runner = FakeRunner(best_lr=base * 4, diverge_above=base * 1.5)  # best two points diverge
  results, _ = convergence.main(_argv(tmp_path, "--optimizers", "racs", "--phase", "sweep"),
                                runner=runner)
  sw = results["racs"]["tuned"]["sweeps"][0]
  assert sw["best_lr"] == base and sw["points"][1]["diverged_at"] == 3
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert f"{convergence.grid_lr(base, 1):.3g}: x" in summary
  saved = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert saved["sweeps"]["racs"][0]["points"][str(convergence.grid_lr(base, 1))] is None


def test_adamw_sweeps_b2_and_weight_decay_and_report_compares_to_it(tmp_path):
  runner = FakeRunner(best_lr={"adamw": 1e-3, "racs": 0.02})
  results, table = convergence.main(_argv(tmp_path, "--optimizers", "adamw,racs"),
                                    runner=runner)
  grids = [s["hparams"] for s in results["adamw"]["tuned"]["sweeps"]]
  assert grids == convergence.ADAMW_GRID
  rows = {r["optimizer"]: r for r in table["rows"]}
  assert rows["adamw"]["verdict"] == "reference"
  assert rows["racs"]["verdict"] == "wins"  # 0.2 lower, seed std 0.005
  assert rows["racs"]["reached"] == 2 and rows["racs"]["speedup_steps_mean"] > 1
  assert table["target"] == pytest.approx(3.005)
  for f in ("summary.md", "summary.json", "sweep.png", "curves.png"):
    assert (tmp_path / "out" / f).exists()


def test_crossing_interpolates_and_reports_not_reached():
  rows = [dict(step=10, wall_s=1.0, eval_loss=5.0), dict(step=20, wall_s=2.0, eval_loss=4.0),
          dict(step=30, wall_s=3.5, eval_loss=3.0)]
  assert curves.crossing(rows, 3.5) == pytest.approx(25.0)
  assert curves.crossing(rows, 3.5, "wall_s") == pytest.approx(2.75)
  assert curves.crossing(rows, 4.0) == 20.0
  assert curves.crossing(rows, 5.5) == 10.0  # first evaluation already below
  assert curves.crossing(rows, 2.9) is None
  assert curves.crossing(rows + [dict(step=40, wall_s=4.0, eval_loss=float("nan"))], 2.0) is None
  # a synthetic exponential curve sampled every 2.5%: interpolation within 5% of the truth
  steps = np.arange(1, 41) * 50.0
  loss = 3.0 + 5.0 * np.exp(-steps / 400.0)
  target = 3.0 + 5.0 * np.exp(-1234.0 / 400.0)
  got = curves.crossing([dict(step=s, eval_loss=l) for s, l in zip(steps, loss)], target)
  assert abs(got - 1234.0) / 1234.0 < 0.05


def test_verdict_uses_seed_spread():
  assert curves.verdict(3.0, 0.01, 3.1, 0.01) == "wins"
  assert curves.verdict(3.0, 0.06, 3.1, 0.05) == "ties"
  assert curves.verdict(3.2, 0.01, 3.1, 0.01) == "loses"
  assert curves.verdict(float("inf"), 0.0, 3.1, 0.01).startswith("loses")


@pytest.mark.example
def test_real_minimal_run_and_divergence(tmp_path):
  """Two real trainings of the tiny LLaMA (4 steps): one finishes, one diverges."""
  pytest.importorskip("flax")
  cfg = dict(preset="tiny", optimizer="adam", hparams=(), steps=4, seed=0, data="shakespeare",
             batch_size=2, eval_batches=1, vocab_size=512)
  ok = convergence.train_run(convergence.RunConfig(lr=1e-3, **cfg), tmp_path / "a", False)
  assert ok["diverged_at"] is None and len(ok["rows"]) == 4 and ok["state_bytes"] > 0
  assert math.isfinite(ok["final_eval_loss"])
  bad = convergence.train_run(convergence.RunConfig(lr=1e30, **cfg), tmp_path / "b", False)
  assert bad["diverged_at"] is not None and bad["diverged_at"] <= 4
  assert convergence.score(bad) == math.inf
