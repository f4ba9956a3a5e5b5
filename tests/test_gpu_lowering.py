"""benchmarks/gpu_lowering.py reads a GPU program right: solver calls and how jaxlib runs
them, run-time conditionals (host synchronisations), loop trip counts, and the branch a
step with fixed counters takes. Lowered for CUDA on this CPU-only machine."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.util import HANG_S

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_lowering as gl  # noqa: E402


def _audit(fn, *shapes):
  args = [jax.ShapeDtypeStruct(s, jnp.float32) if isinstance(s, tuple) else s
          for s in shapes]
  return gl.audit_text(gl.lowered_text(fn, *args))


@pytest.mark.parametrize("target,shape,expected", [
    ("cusolver_syevd_ffi", (57, 128, 128), ("per matrix", 57)),
    ("cusolver_syevd_ffi", (57, 32, 32), ("batched", 1)),
    ("cusolver_syevd_ffi", (128, 128), ("single", 1)),
    ("cusolver_potrf_ffi", (89, 512, 512), ("batched", 1)),
    ("cusolver_geqrf_ffi", (57, 512, 128), ("batched", 1)),      # 512 // 57 <= 128
    ("cusolver_geqrf_ffi", (2, 512, 128), ("per matrix", 2)),    # 512 // 2 > 128
    ("cusolver_orgqr_ffi", (8, 128, 128), ("batched", 1)),
    ("cusolver_ormqr_ffi", (57, 88, 512), ("per matrix", 57)),
    ("cusolver_getrf_ffi", (4, 64, 64), ("batched", 1)),
    ("cusolver_gesvd_ffi", (3, 64, 32), ("per matrix", 3)),
    ("cusolver_gesvdj_ffi", (3, 16, 16), ("batched", 1)),
])
def test_jaxlib_dispatch_rules(target, shape, expected):
  assert gl.gpu_execution(target, shape) == expected


def test_ormqr_dispatches_on_its_third_operand():
  shapes = [(57, 512, 128), (57, 128), (57, 88, 512)]
  assert gl.dispatch_shape("cusolver_ormqr_ffi", shapes) == (57, 88, 512)
  assert gl.dispatch_shape("cusolver_syevd_ffi", shapes) == (57, 512, 128)


def test_eigh_and_cholesky_calls_read_from_the_cuda_lowering():
  a = _audit(lambda x: (jnp.linalg.eigh(x)[1], jnp.linalg.cholesky(x)), (6, 64, 64))
  got = {(d.target, d.shape, d.execution, d.calls, d.when) for d in a.decompositions}
  assert got == {("cusolver_syevd_ffi", (6, 64, 64), "per matrix", 6, "every step"),
                 ("cusolver_potrf_ffi", (6, 64, 64), "batched", 1, "every step")}
  assert a.solver_calls("every step") == 6 + 1
  assert a.syncs_every_step == 0 and a.loops == []


def test_run_time_conditional_is_a_host_sync_and_its_branch_a_refresh():
  def f(x, count):
    return jax.lax.cond(count % 10 == 0, lambda: jnp.linalg.eigh(x)[1], lambda: x)
  a = _audit(f, (4, 48, 48), jax.ShapeDtypeStruct((), jnp.int32))
  assert (a.syncs_every_step, a.syncs_at_refresh) == (1, 1)
  assert [(d.when, d.calls) for d in a.decompositions] == [("refresh", 4)]
  assert a.solver_calls("every step") == 0 and a.solver_calls("refresh") == 4


@pytest.mark.parametrize("count,calls", [(10, 4), (3, 0)])
def test_fixed_counter_folds_the_conditional_to_its_branch(count, calls):
  """With the counter a constant (one kind of step), the conditional is no run-time
  branch: only the branch taken is counted, as XLA folds it; ``jnp`` ``%`` lowers to a
  private function that the folding follows."""
  def f(x):
    c = jnp.asarray(count, jnp.int32)
    return jax.lax.cond(c % 10 == 0, lambda: jnp.linalg.eigh(x)[1], lambda: x)
  a = _audit(f, (4, 48, 48))
  assert a.syncs_at_refresh == 0
  assert sum(d.calls for d in a.decompositions) == calls


@pytest.mark.parametrize("count,calls", [(0, 4), (3, 0)])
def test_a_conditional_in_a_jitted_lambda_folds_with_its_call_sites_constant(count, calls):
  """A jitted lambda lowers to a function with a quoted name (``@"<lambda>"``) whose
  predicate is an argument: the audit walks into it and folds the conditional with the
  constant the call passes, as XLA does once it inlines the call."""
  inner = jax.jit(lambda x, first: jax.lax.cond(first, lambda: jnp.linalg.eigh(x)[1],
                                                 lambda: x))

  def f(x):
    return inner(x, jnp.asarray(count, jnp.int32) == 0)
  text = gl.lowered_text(f, jax.ShapeDtypeStruct((4, 48, 48), jnp.float32))
  assert 'call @"<lambda>"' in text
  a = gl.audit_text(text)
  assert a.syncs_at_refresh == 0
  assert sum(d.calls for d in a.decompositions) == calls


def test_matrix_products_counted_as_compiled_with_their_precision():
  """A product in a function called twice counts twice (XLA inlines each call), one in a
  loop body once; float32-pinned (``Precision.HIGHEST``) told from default ones."""
  hi = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))

  def f(x, y):
    loop = jax.lax.fori_loop(0, 3, lambda i, z: hi(z, x), x)
    return hi(x, x) + hi(y, y) + loop + x @ x
  a = _audit(f, (8, 8), (8, 8))
  row = a.row()
  assert (row["products_float32"], row["products_default"]) == (3, 1)
  assert row["products_float32_distinct"] == 1
  assert {w for _, w, _ in a.products} == {"every step"}


def test_switch_index_through_where_and_clamp_folds():
  def f(x):
    c = jnp.asarray(20, jnp.int32)
    which = jnp.where(c % 10 == 0, jnp.where(c == 0, 1, 2), 0)  # keep / eigh / cholesky
    return jax.lax.switch(which, [lambda: x, lambda: jnp.linalg.eigh(x)[1],
                                  lambda: jnp.linalg.cholesky(x)])
  a = _audit(f, (4, 48, 48))
  assert [d.target for d in a.decompositions] == ["cusolver_potrf_ffi"]


def test_loop_trip_counts():
  def f(x, n):
    fixed = jax.lax.fori_loop(0, 5, lambda i, y: y * 2.0, x)
    runtime = jax.lax.fori_loop(0, n, lambda i, y: y + 1.0, x)
    return fixed + runtime
  a = _audit(f, (3,), jax.ShapeDtypeStruct((), jnp.int32))
  assert sorted(lp.static_trip_count for lp in a.loops) == [False, True]


def test_platform_dependent_is_not_a_run_time_conditional():
  f = lambda x: jax.lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos)  # noqa: E731
  a = _audit(f, (3,))
  assert a.syncs_at_refresh == 0


def test_first_refresh_is_told_apart_by_its_function():
  """A call made from a function named ``first_from`` is the first refresh's."""
  def first_from(x):
    return jnp.linalg.eigh(x)[1]

  def f(x, first):
    return jax.lax.cond(first, lambda: first_from(x), lambda: jnp.linalg.cholesky(x))
  a = _audit(f, (4, 48, 48), jax.ShapeDtypeStruct((), jnp.bool_))
  assert {(d.target, d.when) for d in a.decompositions} == {
      ("cusolver_syevd_ffi", "first refresh only"), ("cusolver_potrf_ffi", "refresh")}


def test_library_alice_refresh_has_no_householder_qr_on_gpu():
  """The GPU program of Alice's refresh (tiny preset, stacked): its only per-matrix solver
  call is the Rayleigh-Ritz ``r x r`` eigh, as GaLore's; no QR (switching's complement
  columns are products and triangular solves) and no run-time conditional on an ordinary
  step beyond the keep/refresh one."""
  program = gl.audit_optimizer("alice", "tiny")
  assert program.syncs_every_step == 1
  refresh = gl.audit_optimizer("alice", "tiny", count=gl.step_counts("alice", "tiny")["refresh"])
  galore = gl.audit_optimizer("galore", "tiny",
                              count=gl.step_counts("galore", "tiny")["refresh"])
  targets = lambda a: sorted((d.target, d.shape, d.execution) for d in a.decompositions)  # noqa: E731
  assert targets(refresh) == targets(galore)
  assert not any("qr" in d.target for d in refresh.decompositions)
  ordinary = gl.audit_optimizer("alice", "tiny", count=1)
  assert ordinary.decompositions == []


def test_racs_update_has_no_host_sync_and_fixed_loops():
  a = gl.audit_optimizer("racs", "tiny")
  assert a.syncs_at_refresh == 0 and a.decompositions == []
  assert a.loops and all(lp.static_trip_count for lp in a.loops)


@pytest.mark.example
def test_gpu_lowering_script_runs(tmp_path):
  out = tmp_path / "rows.json"
  subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_lowering.py"), "--preset",
                  "tiny", "--optimizers", "adam,racs,alice,soap", "--json", str(out)],
                 check=True, timeout=HANG_S, capture_output=True, text=True)
  rows = json.loads(out.read_text())
  steps = {(r["optimizer"], r["step"]) for r in rows}
  assert {("adam", "program"), ("racs", "ordinary"), ("alice", "refresh"),
          ("soap", "first")} <= steps
  soap = {r["step"]: r for r in rows if r["optimizer"] == "soap"}
  # SOAP: the exact eigh at the first refresh only; later ones are Cholesky power steps
  # (per-step rows: every call of that step's program counts as "every step")
  assert soap["first"]["solver_calls_every_step"] > soap["refresh"]["solver_calls_every_step"]
  assert all("potrf" in d["target"] for d in soap["refresh"]["decompositions"])


@pytest.mark.parametrize("name", ["eigen_adam", pytest.param("shampoo", marks=pytest.mark.slow)])
def test_power_qr_refresh_runs_no_eigh_after_the_first_on_gpu(name):
  """``refresh="power_qr"``: the exact eigh at the first refresh (one call per matrix on
  a GPU above 32 x 32), later refreshes one batched Cholesky factor per shape; the
  default ``"eigh"`` loops eigh at every refresh."""
  refresh = gl.step_counts(name, "tiny")["refresh"]
  calls = lambda a: {(d.target, d.execution) for d in a.decompositions}  # noqa: E731
  pqr = dict(hparams=dict(refresh="power_qr"))
  # "single": a shape with one matrix (the output layer's side)
  first = calls(gl.audit_optimizer(name, "tiny", count=0, **pqr))
  assert ("cusolver_syevd_ffi", "per matrix") in first
  assert first <= {("cusolver_syevd_ffi", "per matrix"), ("cusolver_syevd_ffi", "single")}
  later = calls(gl.audit_optimizer(name, "tiny", count=refresh, **pqr))
  assert ("cusolver_potrf_ffi", "batched") in later
  assert later <= {("cusolver_potrf_ffi", "batched"), ("cusolver_potrf_ffi", "single")}
  assert ("cusolver_syevd_ffi", "per matrix") in calls(
      gl.audit_optimizer(name, "tiny", count=refresh))
