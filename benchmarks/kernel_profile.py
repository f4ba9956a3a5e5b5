"""Where a jitted step's device time goes: a profiler trace summarised per kernel.

    from benchmarks import kernel_profile
    summary = kernel_profile.profile(lambda: step(...), steps=3, log_dir="/tmp/trace")

Runs ``fn`` ``steps`` times under ``jax.profiler`` and reads the trace that jaxlib writes
(``*.trace.json.gz``, no extra package needed). On a GPU it counts the kernels on the
device's streams; on a CPU the XLA operations the runtime executes. Per step it reports
the device's busy time (the union of its kernels' intervals), the wall time, their
difference (the device waiting on the host: launches, synchronisations), the number of
kernels, and the time per kind of kernel (matrix products, reductions, elementwise
fusions, copies and data movement, solver and other library calls), the kinds being
comparable between two optimizers' programs where kernel names are not. The largest
kernels are listed by name.

``benchmarks/train_throughput.py --profile DIR`` profiles each optimizer's training step
this way; the device check runs it for Adam and RACS.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import time

import jax

KINDS = ("matmul", "reduction", "elementwise", "data movement", "library", "other")


def kind_of(name: str) -> str:
  """The kind of one kernel or XLA operation, from its HLO op or kernel name."""
  n = name.lower()
  if any(k in n for k in ("gemm", "cublas", "matmul", "dot", "xmma", "cutlass", "triton_gemm")):
    return "matmul"
  if any(k in n for k in ("solver", "syevd", "potrf", "geqrf", "trsm", "triangular",
                          "custom-call", "custom_call", "lapack")):
    return "library"
  if "reduce" in n or "reduction" in n:
    return "reduction"
  if any(k in n for k in ("copy", "transpose", "concatenate", "slice", "memcpy", "memset",
                          "dynamic-update", "gather", "scatter", "pad", "bitcast")):
    return "data movement"
  if "fusion" in n or "loop" in n or "elementwise" in n or "wrapped" in n:
    return "elementwise"
  return "other"


def _union_us(intervals) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop <= end:
      continue
    total += stop - max(start, end)
    end = stop
  return total


def summarize(trace: dict, steps: int, wall_s: float) -> dict:
  """Per-step kernel times of a Chrome-format ``trace`` (``traceEvents``) of ``steps``
  steps that took ``wall_s`` seconds."""
  events = trace.get("traceEvents", [])
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  device = {p for p, name in procs.items() if "/device:" in name}
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if device:
    spans = [e for e in spans if e["pid"] in device]
    streams = {k for k, name in threads.items() if k[0] in device and "stream" in name.lower()}
    if streams:  # kernels on the streams, not the per-op summary lines beside them
      spans = [e for e in spans if (e["pid"], e.get("tid")) in streams]
    where = "device"
  else:  # a CPU: the XLA operations the runtime ran
    spans = [e for e in spans if "hlo_op" in e.get("args", {})]
    where = "host (no device in the trace)"
  per_name = collections.Counter()
  per_count = collections.Counter()
  per_kind = collections.Counter()
  for e in spans:
    name = e.get("args", {}).get("hlo_op") or e["name"]
    per_name[name] += e["dur"]
    per_count[name] += 1
    per_kind[kind_of(name + " " + e["name"])] += e["dur"]
  busy_us = _union_us((e["ts"], e["ts"] + e["dur"]) for e in spans)
  wall_ms = 1e3 * wall_s / steps
  busy_ms = busy_us / 1e3 / steps
  return dict(
      where=where, steps=steps, wall_ms=wall_ms, busy_ms=busy_ms,
      idle_ms=max(wall_ms - busy_ms, 0.0), kernels_per_step=len(spans) / steps,
      kinds_ms={k: per_kind.get(k, 0) / 1e3 / steps for k in KINDS},
      top=[dict(name=n, ms=us / 1e3 / steps, calls=per_count[n] / steps)
           for n, us in per_name.most_common(15)])


def load_trace(log_dir: str) -> dict:
  """The newest ``*.trace.json.gz`` under ``log_dir`` (jaxlib's export)."""
  paths = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
  if not paths:
    raise FileNotFoundError(f"no trace under {log_dir}")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    return json.load(f)


def profile(fn, *, steps: int, log_dir: str) -> dict:
  """Runs ``fn()`` (which returns arrays) ``steps`` times under the profiler; the
  summary of its trace. ``fn`` should be compiled and warmed up already."""
  jax.block_until_ready(fn())
  jax.profiler.start_trace(log_dir)
  try:
    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
      out = fn()
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
  finally:
    jax.profiler.stop_trace()
  return summarize(load_trace(log_dir), steps, wall)


def format_summary(name: str, s: dict) -> list[str]:
  kinds = ", ".join(f"{k} {v:.2f}" for k, v in s["kinds_ms"].items() if v > 0)
  out = [f"{name:10s} {s['where']}: busy {s['busy_ms']:.2f} ms of {s['wall_ms']:.2f} ms a step "
         f"(waiting {s['idle_ms']:.2f}), {s['kernels_per_step']:.0f} kernels; ms by kind: "
         f"{kinds}"]
  for t in s["top"][:8]:
    out.append(f"    {t['ms']:7.3f} ms  {t['calls']:5.1f}x  {t['name'][:90]}")
  return out
