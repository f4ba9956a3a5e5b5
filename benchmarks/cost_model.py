"""A cost model of the optimizer update for accelerators we cannot measure here.

    python benchmarks/cost_model.py [--presets 60M,130M,350M,1B] [--optimizers ...]
    python benchmarks/cost_model.py --check-cpu     # the model against step_time.py

For each named optimizer at a LLaMA preset's parameter shapes (float32, embeddings on
Adam, the output layer as the paper's runs route it), the jitted update is compiled on
abstract shapes twice: an *ordinary* step and a *refresh* step. The step counters in the
state are compile-time constants there, so XLA folds every refresh ``lax.cond`` to the
branch that step takes and ``compiled.cost_analysis()`` counts that branch alone.

What XLA's cost analysis does not count, and how the model adds it:

- a ``while`` loop's body is counted once whatever its trip count. Newton--Schulz
  (``steps``) compiles unrolled (its count scales with ``steps``: checked by
  ``--check-loops``), but RACS's fixed-point loop stays a loop: its ``iters - 1`` further
  iterations are added from their count, two passes over each routed ``m x n`` matrix
  ``P = G * G`` (``4 m n`` FLOPs, ``8 m n`` bytes read), for the matrices
  ``fo.describe`` lists;
- decompositions are library calls (``custom-call``: LAPACK here, cuSOLVER on GPU) that
  it counts as free: their FLOPs are added from the textbook counts (Golub & Van Loan)
  for each call's operand shape -- ``9 n^3`` for a symmetric eigendecomposition with
  vectors, ``2 m n^2 - 2 n^3 / 3`` for a Householder QR and as much again to form the
  thin ``Q``, ``6 m n^2 + 20 n^3`` for a thin SVD, ``n^3 / 3`` for a Cholesky factor,
  ``n^2 k`` for a triangular solve with ``k`` right-hand sides -- and their operands'
  bytes.

Each step's time is a roofline, ``max(FLOPs / peak FLOP/s, bytes / peak bandwidth)`` on
the whole update (a lower bound: it assumes every kernel runs at whichever peak binds),
at stated H100 SXM figures: float32 arithmetic at 67 TFLOP/s (CUDA cores; optimizer math
is float32), HBM3 at 3.35 TB/s. The refresh is amortised over its interval ``K``:
``((K - 1) ordinary + refresh) / K``. The training step it is compared with does
``6 * params * tokens`` FLOPs at the preset's batch (``--tokens``, default the LLaMA
example's batch x context) at 989 TFLOP/s (BF16 tensor cores, dense, at peak: real runs
reach 30-50% of it, which makes the optimizer's share smaller than shown).

``--check-cpu`` prints the ratios to Adam's update that the same model predicts at this
CPU's peak figures (stated below; the bandwidth measured by a large array copy) next to
``benchmarks/step_time.py``'s measured ratios on the same shapes, so the model's
error is visible where it can be measured.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import fisher_optax as fo
from benchmarks import step_time
from examples.llama import presets, train

OPTIMIZERS = ("racs", "alice", "alice0", "alice_soap", "galore", "fira", "apollo",
              "apollo_mini", "eigen_adam", "soap", "shampoo", "swan", "fo_muon")

# Stated peak figures. H100 SXM5 (NVIDIA datasheet): FP32 67 TFLOP/s, BF16 dense tensor
# 989 TFLOP/s, HBM3 3.35 TB/s.
H100 = dict(name="H100 SXM", flops=67e12, train_flops=989e12, bandwidth=3.35e12)

# A loop inside a block that XLA keeps as a ``while`` (its cost analysis counts the body
# once): optimizer -> (iterations in the LLaMA runs, FLOPs and bytes of one iteration on
# one m x n matrix). RACS: s = colsum(q * P), q = rowsum(P * s) over P = G * G.
LOOPS = {"racs": (5, lambda m, n: (4.0 * m * n, 8.0 * m * n))}

_SHAPE = re.compile(r"(?P<dtype>f32|f64|bf16|f16|s32|u32|s8|u8|pred)\[(?P<dims>[0-9,]*)\]")
_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
          "pred": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = "
                          r"(?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+) "
                          r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$")


def _shapes(text: str) -> list:
  return [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
          for m in _SHAPE.finditer(text)]


def _nbytes(shapes) -> float:
  return float(sum(_BYTES[d] * np.prod(s) for d, s in shapes))


def loop_weighted_ops(hlo: str) -> dict:
  """Reads a compiled module's text: how many times each computation runs per call of
  the entry (``while`` bodies multiplied by their known trip counts, nested loops
  multiplied through; fusions, calls and branches inherit their caller's count), and the
  FLOPs and operand bytes of its ``dot``s and decomposition calls. Returns the extra
  FLOPs and bytes that XLA's cost analysis, which counts every computation once and
  every library call as free, leaves out, and what could not be weighed."""
  comps, current = {}, None
  for line in hlo.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = comps.setdefault(head.group("name"), [])
      continue
    ins = _INSTRUCTION.match(line)
    if ins and current is not None:
      current.append(ins.groupdict())
  callers: dict[str, list] = {}
  unknown_trips = 0
  for name, instrs in comps.items():
    for ins in instrs:
      attrs = ins["attrs"]
      trips = 1
      if ins["op"] == "while":
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
        trips = int(m.group(1)) if m else 1
        unknown_trips += m is None
      for callee in re.findall(r"(?:calls|to_apply|body|condition|branch_computations|"
                               r"true_computation|false_computation)=\{?([^,}]+(?:, %[^,}]+)*)",
                               attrs):
        for c in re.findall(r"%([\w.\-]+)", callee):
          callers.setdefault(c, []).append((name, trips))
  memo: dict[str, float] = {}

  def runs(name: str) -> float:
    if name not in memo:
      memo[name] = 1.0  # cycle guard; HLO call graphs are acyclic
      memo[name] = (sum(runs(c) * t for c, t in callers[name]) if name in callers else 1.0)
    return memo[name]

  extra_flops = extra_bytes = decomposition = 0.0
  calls: dict[str, int] = {}
  for name, instrs in comps.items():
    k = runs(name)
    shapes = {ins["name"]: _shapes(ins["shape"]) for ins in instrs}
    for ins in instrs:
      if ins["op"] == "dot" and k > 1:
        operands = re.findall(r"%([\w.\-]+)", ins["args"])
        lhs = shapes.get(operands[0], [])
        contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins["attrs"])
        if lhs and contract:
          size = np.prod([lhs[0][1][int(d)] for d in contract.group(1).split(",") if d])
          out = _shapes(ins["shape"])
          flops = 2.0 * float(np.prod(out[0][1])) * float(size)
          nbytes = _nbytes(out) + sum(_nbytes(shapes.get(o, [])) for o in operands)
          extra_flops += (k - 1) * flops
          extra_bytes += (k - 1) * nbytes
      elif ins["op"] == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins["attrs"])
        operands_ = _shapes(ins["attrs"].split("operand_layout_constraints=", 1)[-1])[:2]
        operand = operands_[:1]
        if target and operand:
          f = decomposition_flops(target.group(1), operand[0][1],
                                  operands_[1][1] if len(operands_) > 1 else None)
          if f:
            decomposition += k * f
            extra_bytes += k * 2 * _nbytes(operand)
            calls[target.group(1)] = calls.get(target.group(1), 0) + int(k)
  return dict(extra_flops=extra_flops + decomposition, extra_bytes=extra_bytes,
              decomposition_flops=decomposition, decomposition_calls=calls,
              unknown_trip_counts=unknown_trips)


def decomposition_flops(target: str, shape: tuple, rhs: tuple | None = None) -> float:
  """Textbook FLOPs of one library decomposition call on an operand of ``shape``
  (leading axes are a batch); 0 for a call that is no decomposition. ``rhs``: the second
  operand's shape (a triangular solve's right-hand sides)."""
  *batch, m, n = shape if len(shape) >= 2 else (1, 1)
  b = float(np.prod(batch)) if batch else 1.0
  lo, hi = min(m, n), max(m, n)
  t = target.lower()
  if "syevd" in t or "heevd" in t or "eigh" in t or "syev" in t:
    return b * 9.0 * m ** 3
  if "geqrf" in t or "orgqr" in t or "householder" in t or "qr" in t:
    return b * (2.0 * hi * lo ** 2 - 2.0 * lo ** 3 / 3.0)
  if "gesdd" in t or "gesvd" in t or "svd" in t:
    return b * (6.0 * hi * lo ** 2 + 20.0 * lo ** 3)
  if "potrf" in t or "cholesky" in t:
    return b * m ** 3 / 3.0
  if "trsm" in t or "triangular" in t:
    # an n x n triangular factor applied to the other side's k columns (or rows): n^2 k
    k = float(np.prod(rhs)) / (b * m) if rhs else float(m)
    return b * m * m * k
  return 0.0


def cost_of(compiled) -> dict:
  """XLA's FLOPs and bytes of a compiled program, plus what it leaves out: loop bodies
  beyond their first run and decompositions (:func:`loop_weighted_ops`)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  extra = loop_weighted_ops(compiled.as_text())
  return dict(flops=float(cost.get("flops", 0.0)) + extra["extra_flops"],
              bytes=float(cost.get("bytes accessed", 0.0)) + extra["extra_bytes"],
              xla_flops=float(cost.get("flops", 0.0)),
              decomposition_flops=extra["decomposition_flops"],
              decomposition_calls=extra["decomposition_calls"],
              unknown_trip_counts=extra["unknown_trip_counts"])


def with_constant_counts(state, count: int):
  """A function of the state's arrays that rebuilds it with every step counter (a scalar
  integer leaf named ``count``) fixed to ``count``, a compile-time constant."""
  def is_counter(path, leaf):
    name = getattr(path[-1], "name", getattr(path[-1], "key", None)) if path else None
    return (name == "count" and jnp.ndim(leaf) == 0
            and jnp.issubdtype(jnp.result_type(leaf), jnp.integer))

  flags = jax.tree_util.tree_map_with_path(is_counter, state)

  def rebuild(arrays):
    return jax.tree.map(lambda f, x: jnp.asarray(count, jnp.result_type(x)) if f else x,
                        flags, arrays)
  return rebuild


def update_cost(tx, params, count: int) -> dict:
  """Cost of ``tx.update`` at the step whose counters read ``count``."""
  state = jax.eval_shape(tx.init, params)
  rebuild = with_constant_counts(state, count)

  def step(grads, state, params):
    return tx.update(grads, rebuild(state), params)

  compiled = jax.jit(step).lower(params, state, params).compile()
  return cost_of(compiled)


def optimizer_costs(name: str, preset: str, params) -> dict:
  """Ordinary and refresh step costs of ``name`` at ``preset``, loops counted."""
  interval = step_time.interval_of(name, preset)

  def costs():
    tx = step_time.build(name, preset)
    ordinary = update_cost(tx, params, count=1 if interval > 1 else 0)
    refresh = update_cost(tx, params, count=interval) if interval > 1 else dict(ordinary)
    return ordinary, refresh

  ordinary, refresh = costs()
  if name in LOOPS:
    trips, per_iteration = LOOPS[name]
    tx = step_time.build(name, preset)
    extra = np.zeros(2)
    for row in fo.describe(tx, params).rows:
      if row.rule == "fallback" or row.view == "-":
        continue
      *batch, m, n = (int(v) for v in row.view.split(" x "))
      extra += (trips - 1) * int(np.prod(batch or [1])) * np.asarray(per_iteration(m, n))
    for c in (ordinary, refresh):
      c["flops"] += extra[0]
      c["bytes"] += extra[1]
  return dict(interval=interval, ordinary=ordinary, refresh=refresh)


def roofline_s(cost: dict, peak: dict) -> float:
  return max(cost["flops"] / peak["flops"], cost["bytes"] / peak["bandwidth"])


def amortised(ordinary: float, refresh: float, interval: int) -> float:
  return ((interval - 1) * ordinary + refresh) / interval


def model_rows(preset: str, names, peak: dict, tokens: int | None) -> list[dict]:
  params, _ = step_time.abstract_params(preset)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  cfg = presets.model_config(preset)
  tokens = tokens or train.BATCH[preset] * cfg.context
  train_flops = 6.0 * n_params * tokens
  train_s = train_flops / peak["train_flops"]
  rows = []
  for name in ("adam",) + tuple(names):
    t0 = time.perf_counter()
    if name == "adam":
      c = update_cost(step_time.build("adam", preset), params, count=1)
      costs = dict(interval=1, ordinary=c, refresh=c)
    else:
      costs = optimizer_costs(name, preset, params)
    k = costs["interval"]
    o_s, r_s = roofline_s(costs["ordinary"], peak), roofline_s(costs["refresh"], peak)
    a_flops = amortised(costs["ordinary"]["flops"], costs["refresh"]["flops"], k)
    a_s = amortised(o_s, r_s, k)
    rows.append(dict(
        preset=preset, optimizer=name, interval=k, params=n_params, tokens=tokens,
        ordinary_gflop=costs["ordinary"]["flops"] / 1e9,
        ordinary_gb=costs["ordinary"]["bytes"] / 1e9,
        refresh_gflop=costs["refresh"]["flops"] / 1e9,
        refresh_gb=costs["refresh"]["bytes"] / 1e9,
        refresh_decomposition_gflop=costs["refresh"]["decomposition_flops"] / 1e9,
        amortised_gflop=a_flops / 1e9,
        flop_share=a_flops / train_flops,
        ordinary_ms=1e3 * o_s, refresh_ms=1e3 * r_s, amortised_ms=1e3 * a_s,
        train_step_ms=1e3 * train_s, time_share=a_s / (train_s + a_s),
        compile_s=time.perf_counter() - t0))
    print(_row(rows[-1]), flush=True)
  return rows


def _row(r: dict) -> str:
  return (f"| {r['preset']} | {r['optimizer']} | {r['ordinary_gflop']:.2f} / "
          f"{r['ordinary_gb']:.2f} | {r['refresh_gflop']:.2f} / {r['refresh_gb']:.2f} | "
          f"{r['interval']} | {100 * r['flop_share']:.2f}% | {r['ordinary_ms']:.3f} | "
          f"{r['refresh_ms']:.3f} | {r['amortised_ms']:.3f} | {100 * r['time_share']:.1f}% |")


HEADER = ("| preset | optimizer | ordinary GFLOP / GB | refresh GFLOP / GB | K | FLOPs vs "
          "6ND (amortised) | ordinary ms | refresh ms | amortised ms | share of step time |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def measure_bandwidth(mib: int = 512, reps: int = 5) -> float:
  """This machine's copy bandwidth (bytes read + written per second), best of ``reps``."""
  a = np.ones(mib * 2 ** 20 // 4, np.float32)
  b = np.empty_like(a)
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    np.copyto(b, a)
    best = min(best, time.perf_counter() - t0)
  return 2 * a.nbytes / best


def cpu_peak() -> dict:
  """This CPU's stated peak: cores x clock x 32 float32 FLOPs a cycle (two 8-wide AVX2
  FMA units; the clock from /proc/cpuinfo's bogomips / 2), and its measured bandwidth."""
  text = pathlib.Path("/proc/cpuinfo").read_text()
  cores = len(re.findall(r"^processor\s*:", text, re.M))
  mhz = float(re.search(r"bogomips\s*:\s*([0-9.]+)", text).group(1)) / 2
  return dict(name=f"this CPU ({cores} cores, {mhz / 1e3:.2f} GHz, AVX2 FMA)",
              flops=cores * mhz * 1e6 * 32, train_flops=cores * mhz * 1e6 * 32,
              bandwidth=measure_bandwidth())


def check_cpu(preset: str, names, reps: int) -> list[dict]:
  """Predicted (at this CPU's peak) and measured (step_time.py) ratios to Adam."""
  peak = cpu_peak()
  print(f"peak: {peak['flops'] / 1e9:.0f} GFLOP/s, {peak['bandwidth'] / 1e9:.1f} GB/s "
        f"({peak['name']})")
  rows = {r["optimizer"]: r for r in model_rows(preset, names, peak, None)}
  out = []
  for name in names:
    measured = step_time.measure(name, preset, reps=reps, refresh_reps=1)
    pred_o = rows[name]["ordinary_ms"] / rows["adam"]["ordinary_ms"]
    pred_r = rows[name]["refresh_ms"] / rows["adam"]["ordinary_ms"]
    out.append(dict(optimizer=name, predicted_ordinary=pred_o, measured_ordinary=measured[
        "ratio_ordinary"], predicted_refresh=pred_r, measured_refresh=measured["ratio_refresh"]))
    print(f"| {name} | {pred_o:.2f}x | {measured['ratio_ordinary']:.2f}x | {pred_r:.1f}x | "
          f"{measured['ratio_refresh']:.1f}x |", flush=True)
  return out


def check_loops(preset: str) -> dict:
  """XLA's FLOPs of one update at 1 and 2 iterations of each loop: a count that does not
  grow is a ``while`` body counted once (RACS), one that doubles is unrolled (Muon)."""
  params, _ = step_time.abstract_params(preset)
  out = {}
  for name, key in (("racs", "iters"), ("fo_muon", "steps")):
    flops = [update_cost(step_time.build(name, preset, **{key: k}), params, count=1)["flops"]
             for k in (1, 2)]
    out[name] = flops
    print(f"{name}: {key}=1 {flops[0] / 1e9:.3f} GFLOP, {key}=2 {flops[1] / 1e9:.3f} GFLOP",
          flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--presets", default="60M,130M,350M,1B")
  ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  ap.add_argument("--tokens", type=int, default=None,
                  help="tokens per training step (default: the example's batch x context)")
  ap.add_argument("--check-cpu", default=None, metavar="PRESET",
                  help="predict at this CPU's peak and measure with step_time.py")
  ap.add_argument("--check-loops", default=None, metavar="PRESET",
                  help="show which loops XLA's cost analysis counts once")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args(argv)
  names = [n for n in args.optimizers.split(",") if n]
  if args.check_loops:
    return check_loops(args.check_loops)
  if args.check_cpu:
    print("| optimizer | predicted ordinary | measured | predicted refresh | measured |\n"
          "|---|---|---|---|---|")
    rows = check_cpu(args.check_cpu, names, args.reps)
  else:
    print(f"Roofline at {H100['name']}: {H100['flops'] / 1e12:.0f} TFLOP/s float32, "
          f"{H100['bandwidth'] / 1e12:.2f} TB/s; training at "
          f"{H100['train_flops'] / 1e12:.0f} TFLOP/s\n\n{HEADER}")
    rows = []
    for preset in args.presets.split(","):
      rows += model_rows(preset, names, H100, args.tokens)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
