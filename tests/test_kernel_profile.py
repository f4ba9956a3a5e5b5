"""benchmarks/kernel_profile.py: the device's kernels are read from a profiler trace,
per step, by kind; on a CPU the XLA operations stand in for them."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import kernel_profile as kp  # noqa: E402


def _gpu_trace():
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
          dict(ph="M", pid=7, name="process_name", args=dict(name="/device:GPU:0")),
          dict(ph="M", pid=7, tid=1, name="thread_name", args=dict(name="Stream #13(Compute)")),
          dict(ph="M", pid=7, tid=2, name="thread_name", args=dict(name="XLA Ops"))]
  k = lambda name, ts, dur, tid=1, **a: dict(ph="X", pid=7, tid=tid, name=name, ts=ts,  # noqa: E731
                                             dur=dur, args=a)
  return dict(traceEvents=meta + [
      k("sm90_xmma_gemm_bf16", 0, 400),
      k("input_reduce_fusion_3", 400, 100, hlo_op="reduce_fusion.3"),
      k("loop_multiply_fusion", 450, 100, hlo_op="multiply_fusion"),   # overlaps the last
      k("copy_fusion", 1000, 50),
      k("summary line, not a kernel", 0, 5000, tid=2),                  # not on a stream
      dict(ph="X", pid=1, tid=9, name="host op", ts=0, dur=9000, args=dict(hlo_op="x"))])


def test_gpu_trace_counts_stream_kernels_per_step():
  s = kp.summarize(_gpu_trace(), steps=2, wall_s=4e-3)
  assert s["where"] == "device"
  assert s["kernels_per_step"] == 2                       # 4 kernels over 2 steps
  assert s["busy_ms"] == pytest.approx((550 + 50) / 1e3 / 2)  # union of the intervals
  assert s["wall_ms"] == pytest.approx(2.0)
  assert s["idle_ms"] == pytest.approx(2.0 - 0.3)
  assert s["kinds_ms"]["matmul"] == pytest.approx(0.2)
  assert s["kinds_ms"]["reduction"] == pytest.approx(0.05)
  assert s["kinds_ms"]["elementwise"] == pytest.approx(0.05)
  assert s["kinds_ms"]["data movement"] == pytest.approx(0.025)
  assert s["top"][0]["name"] == "sm90_xmma_gemm_bf16"     # by time, HLO op name where given
  assert {t["name"] for t in s["top"]} >= {"reduce_fusion.3", "multiply_fusion"}


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_gemm_f32f32_tf32", "matmul"), ("cublas_gemm", "matmul"),
    ("input_reduce_fusion_2", "reduction"), ("transpose_copy_fusion", "data movement"),
    ("concatenate.4", "data movement"), ("loop_add_fusion", "elementwise"),
    ("cusolver_syevd_ffi", "library"), ("triangular-solve.2", "library"), ("argsort", "other")])
def test_kinds(name, kind):
  assert kp.kind_of(name) == kind


def test_profile_on_this_cpu(tmp_path):
  f = jax.jit(lambda x: jnp.sum(jnp.sin(x) @ x))
  x = jnp.ones((64, 64))
  s = kp.profile(lambda: f(x), steps=3, log_dir=str(tmp_path))
  assert s["where"].startswith("host") and s["steps"] == 3
  assert s["kernels_per_step"] >= 1 and s["wall_ms"] > 0 and s["top"]
