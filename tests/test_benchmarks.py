"""The benchmark scripts run, and the paper's memory table is reproduced."""

import subprocess
import sys
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.util import HANG_S

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import memory  # noqa: E402


@pytest.mark.parametrize("name", ["adam", "galore"] + [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("fira", "apollo_mini", "racs", "alice0", "alice")])
def test_paper_memory_table_reproduced(name):
  """Within 2% (plus the paper's rounding to 0.01 GiB) for 60M and 130M."""
  rows = memory.table((name,), ("60M", "130M"))
  for r in rows:
    for ours, paper in [(r["mem"], r["paper_mem"]), (r["mem_star"], r["paper_mem_star"])]:
      if paper is not None:
        assert abs(ours - paper) <= 0.02 * paper + 0.005, (name, r)


@pytest.mark.example
def test_step_time_benchmark_runs_on_tiny():
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--preset",
                        "tiny", "--optimizers", "racs,alice", "--reps", "2", "--json"],
                       capture_output=True, text=True, timeout=HANG_S, check=True)
  import json
  rows = json.loads(out.stdout)
  assert [r["optimizer"] for r in rows] == ["racs", "alice"]
  for r in rows:  # the ratios are the printed times' ratios to Adam's, same process
    assert r["adam_ms"] > 0 and r["ordinary_ms"] > 0 and r["refresh_ms"] > 0
    assert abs(r["ratio_ordinary"] - r["ordinary_ms"] / r["adam_ms"]) < 1e-9
    assert abs(r["ratio_refresh"] - r["refresh_ms"] / r["adam_ms"]) < 1e-9
    k = r["interval"]
    amortised = ((k - 1) * r["ordinary_ms"] + r["refresh_ms"]) / k / r["adam_ms"]
    assert abs(r["ratio_amortised"] - amortised) < 1e-9
  assert rows[0]["interval"] == 1 and rows[1]["interval"] > 1  # RACS has no refresh


@pytest.mark.example
def test_step_time_compile_only_runs_on_tiny():
  import json
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--preset",
                        "tiny", "--optimizers", "apollo_mini", "--compile-only", "--json",
                        "--repeat", "2"],
                       capture_output=True, text=True, timeout=HANG_S, check=True)
  (row,) = json.loads(out.stdout)
  assert row["optimizer"] == "apollo_mini" and row["compile_s"] > 0 and row["adam_compile_s"] > 0
  assert row["repeat"] == 2 and len(row["ratios"]) == 2  # the fastest of two rounds
  assert abs(row["ratio_compile"] - row["compile_s"] / row["adam_compile_s"]) < 1e-9
  assert row["ratio_compile"] in row["ratios"]
  assert row["temp_mib"] >= 0 and row["adam_temp_mib"] >= 0  # XLA's memory_analysis


def test_step_time_builds_optax_peers_as_optax_builds_them():
  """The yardsticks are optax's own transformations: same state structure and updates as
  optax.adafactor and optax.contrib.galore (embeddings masked out) built directly."""
  from benchmarks import step_time
  params = {"embed": {"embedding": jnp.ones((16, 8))}, "w": jnp.ones((40, 48)) * 0.1}
  grads = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape),
                       params)
  rank, _, gap = step_time.presets.LOW_RANK["tiny"]
  assert gap > 1 and rank >= 1
  direct = {"adafactor": optax.adafactor(1e-3),
            "optax_galore": optax.contrib.galore(
                1e-3, rank=rank, update_proj_gap=gap,
                mask=lambda p: {"embed": {"embedding": False}, "w": True})}
  for name, want_tx in direct.items():
    tx = step_time.build(name, "tiny")
    got, want = tx.update(grads, tx.init(params), params), want_tx.update(
        grads, want_tx.init(params), params)
    assert jax.tree.structure(got) == jax.tree.structure(want), name
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=name)
  assert step_time.interval_of("adafactor", "tiny") == 1


@pytest.mark.example
def test_step_time_stacked_tree_routes_layer_stacks():
  """``--stacked``: one ``[L, ...]`` leaf per layer parameter; kernels routed as stacks of
  matrices, norm stacks to the fallback; the compile-only path runs on it."""
  import json
  import fisher_optax as fo
  from benchmarks import step_time
  params, dims = step_time.abstract_params("tiny", stacked=True, layers=3)
  flat, _ = step_time.abstract_params("tiny", layers=3)
  assert sorted(params["layers"]) == sorted(flat["layers"][0])
  mask = fo.default_mask(params, dims)
  for x in jax.tree_util.tree_leaves(params["layers"]):
    assert x.shape[0] == 3
  routed = {fo.matrices.path_to_str(k): v
            for k, v in jax.tree_util.tree_leaves_with_path(mask["layers"])}
  assert routed["attn/q_proj/kernel"] and routed["mlp/down_proj/kernel"]
  assert not routed["attn_norm/weight"] and not routed["mlp_norm/weight"]
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--preset",
                        "tiny", "--optimizers", "racs", "--compile-only", "--stacked",
                        "--layers", "3", "--json"],
                       capture_output=True, text=True, timeout=HANG_S, check=True)
  (row,) = json.loads(out.stdout)
  assert row["stacked"] and row["layers"] == 3 and row["compile_s"] > 0


@pytest.mark.example
def test_train_throughput_benchmark_runs_on_tiny():
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"),
                        "--preset", "tiny", "--optimizers", "racs", "--steps", "1",
                        "--rounds", "1", "--batch-size", "2", "--json"],
                       capture_output=True, text=True, timeout=HANG_S, check=True)
  import json
  rows = {r["optimizer"]: r for r in json.loads(out.stdout)}
  assert abs(rows["adam"]["ratio_to_adam"] - 1) < 1e-9  # the reference, same process
  row = rows["racs"]
  assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
  assert abs(row["ratio_to_adam"] - row["tokens_per_s"] / rows["adam"]["tokens_per_s"]) < 1e-9
  assert 0 < row["ratio_to_adam"] < 100 and row["compile_s"] > 0
  assert row["interval"] == 1 and row["amortised_ratio_to_adam"] > 0  # RACS: no refresh


@pytest.mark.example
def test_update_trace_compares_runs(tmp_path):
  """Two recordings of the same code compare equal (exit 0); a changed update is reported
  as ``DIFFERS`` with exit 1."""
  script = str(ROOT / "benchmarks" / "update_trace.py")
  a, b = tmp_path / "a.npz", tmp_path / "b.npz"
  for out in (a, b):
    subprocess.run([sys.executable, script, "--steps", "3", "--out", str(out)], check=True,
                   cwd=ROOT)
  same = subprocess.run([sys.executable, script, "--compare", str(a), str(b)],
                        capture_output=True, text=True, cwd=ROOT)
  assert same.returncode == 0 and "DIFFERS" not in same.stdout
  assert same.stdout.count(" ok") == 11
  changed = dict(np.load(a))
  changed["galore/2/square"] = changed["galore/2/square"] * (1 + 1e-3)
  np.savez(b, **changed)
  diff = subprocess.run([sys.executable, script, "--compare", str(a), str(b)],
                        capture_output=True, text=True, cwd=ROOT)
  assert diff.returncode == 1
  assert [line.split()[0] for line in diff.stdout.splitlines() if "DIFFERS" in line] == ["galore"]


@pytest.mark.example
def test_device_check_smoke_writes_every_part(tmp_path):
  """``device_check.py --smoke``: every part at toy sizes, the report and its JSON."""
  import json
  subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--smoke",
                  "--out", str(tmp_path)], capture_output=True, text=True, timeout=HANG_S,
                 check=True)
  (md,) = tmp_path.glob("*.md")
  (js,) = tmp_path.glob("*.json")
  data = json.loads(js.read_text())
  assert data["skipped"] == [] and data["env"]["jax"]
  assert data["parts"]["tests"]["counts"]["passed"] > 0
  assert not data["parts"]["tests"]["failures"]
  steps = data["parts"]["steps"]
  assert {(r["optimizer"], r["layout"]) for r in steps} >= {("racs", "stacked"),
                                                            ("racs", "per-leaf")}
  assert all(r["ratio_ordinary"] > 0 and r["compile_s"] > 0 for r in steps)
  assert [r["optimizer"] for r in data["parts"]["train"]][0] == "adam"
  profiled = {r["optimizer"]: r for r in data["parts"]["train_profile"]}
  assert set(profiled) == {"adam", "racs"}
  assert all(r["kernels_per_step"] > 0 and r["wall_ms"] > 0 for r in profiled.values())
  assert not (tmp_path / "trace-tmp").exists()  # raw traces are not kept
  (bf16,) = data["parts"]["update_dtype"]
  assert bf16["dtype"] == "bfloat16" and bf16["optimizer"] == "racs" and bf16["stacked"]
  assert data["parts"]["precision"][0]["matmul_precision"] == "tensorfloat32"
  prim = {r["primitive"]: r for r in data["parts"]["primitives"]}
  assert prim["alice refresh_from (switching)"]["ms"] > 0 and "cholesky_qr m x r" in prim
  comp = {(r["optimizer"], r["how"]): r for r in data["parts"]["compile"]}
  assert set(comp) == {(n, h) for n in ("adam", "galore") for h in ("cached", "autotune off")}
  assert [len(comp["galore", h]["rounds_s"]) for h in ("cached", "autotune off")] == [2, 1]
  assert all(s > 0 for r in comp.values() for s in r["rounds_s"] + r["adam_rounds_s"])
  text = md.read_text()
  for heading in ("Test suite", "Update step", "Training step", "Matmul precision",
                  "refresh's factorizations", "device time goes", "bfloat16 parameters",
                  "Compile time of the update"):
    assert heading in text
  assert "| galore | " in text.split("Compile time of the update")[1]


def test_device_check_reads_an_interrupted_parallel_pytest_run():
  """A test part cut at its limit is interrupted, and pytest's counts so far are kept
  with how many collected tests never finished."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import device_check
  out = ("created: 16/16 workers\n16 workers [40 items]\n\n....F...\n"
         "!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!\n"
         "FAILED tests/test_a.py::test_b[3] - AssertionError\n"
         "12.50s call     tests/test_a.py::test_slow\n"
         "=========== 1 failed, 30 passed, 4 skipped, 2 xfailed in 220.5s ===========\n")
  got = device_check.parse_pytest(out)
  assert got["counts"] == dict(failed=1, passed=30, skipped=4, xfailed=2)
  assert got["failures"] == ["tests/test_a.py::test_b[3]"]
  assert got["unfinished"] == 3
  assert got["slowest"] == [dict(seconds=12.5, test="tests/test_a.py::test_slow")]


def test_device_check_plans_are_two_runs_that_cover_the_open_targets(tmp_path, monkeypatch):
  """Without ``--parts`` the check runs a plan: ``targets`` (the default) the training
  step and the 60M stacked step grid of the refresh and Muon targets, ``suite`` the tests
  first; each under its own budget of at most 6 minutes, writing files of its own."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import device_check
  seen = []
  fake = {n: (lambda chk, cfg, n=n: seen.append((n, cfg, chk.budget)))
          for n in device_check.PARTS}
  monkeypatch.setattr(device_check, "PARTS", fake)
  monkeypatch.setattr(device_check, "environment",
                      lambda: dict(backend="gpu", device_kind="NVIDIA H200"))
  device_check.main(["--out", str(tmp_path)])
  device_check.main(["--out", str(tmp_path), "--plan", "suite"])
  assert [n for n, _, _ in seen] == ["train", "steps", "tests", "profile", "compile"]
  steps = seen[1][1]
  assert steps["presets"] == ("60M",) and steps["layouts"] == ("stacked",)
  assert {"alice", "soap", "eigen_adam", "shampoo", "fo_muon", "muon"} <= set(
      steps["optimizers"])
  assert {"racs", "alice", "muon"} <= set(seen[0][1]["train_optimizers"])
  # the suite: the default run and every optimizer's long optax cases
  assert seen[2][1]["markers"] == "(not slow and not example) or long_run"
  assert all(budget <= 360 for _, _, budget in seen)
  names = sorted(p.name for p in tmp_path.glob("*.json"))
  assert len(names) == 2 and all(n.startswith("nvidia-h200-") for n in names), names
  assert names[0].endswith("-suite.json") and names[1].endswith("-targets.json"), names
  with pytest.raises(SystemExit):
    device_check.main(["--out", str(tmp_path), "--plan", "suite", "--parts", "tests"])


def test_device_check_compile_table_reads_adams_first_compile_from_the_first_row():
  """The compile part's table: each optimizer's first round with nothing cached, its last
  read back from the persistent cache; Adam's own rows come after Adam was first compiled
  (before the first optimizer), so its uncached figure is the first row's."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import device_check
  rows = [dict(optimizer="galore", how="cached", rounds_s=[3.0, 1.0], adam_rounds_s=[0.5, 0.1]),
          dict(optimizer="adam", how="cached", rounds_s=[0.2, 0.1], adam_rounds_s=[0.1, 0.1]),
          dict(optimizer="adam", how="autotune off", rounds_s=[0.4], adam_rounds_s=[0.4])]
  assert device_check.compile_table(rows) == ["| galore | 3.0 | 1.0 | n/a |",
                                              "| adam | 0.5 | 0.1 | 0.4 |"]


@pytest.mark.example
def test_fallback_lr_benchmark_runs_and_writes_its_table(tmp_path):
  """``benchmarks/fallback_lr.py`` on both models for a few steps: every configuration
  named here runs, and the table has one row per configuration, one column per model."""
  table = tmp_path / "table.md"
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fallback_lr.py"),
                        "--models", "linen,equinox", "--steps", "3", "--seeds", "0",
                        "--configs", "adam 1e-3;racs 2e-2, no dims;racs 2e-2, dims",
                        "--json", str(tmp_path / "r.json"), "--table", str(table)],
                       capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = table.read_text().splitlines()
  assert lines[0] == "| optimizer | linen | equinox |" and len(lines) == 2 + 3


@pytest.mark.parametrize("n", [2, 7, 16, 33])
def test_primitives_jacobi_candidate_is_an_eigendecomposition(n):
  """The Jacobi candidate that ``benchmarks/primitives.py`` times against cuSOLVER is an
  eigendecomposition (eigenvalues descending, the same eigenvectors up to sign as
  LAPACK's), odd sizes included; its round-robin schedule meets every pair once."""
  from benchmarks import primitives
  pairs = primitives.round_robin(n + n % 2).reshape(-1, 2)
  assert len({tuple(sorted(p)) for p in pairs}) == len(pairs) == (n + n % 2) * (n + n % 2 - 1) // 2
  x = np.random.default_rng(n).standard_normal((n, 2 * n))
  h = x @ x.T / n
  w, v = primitives.jacobi_eigh(jnp.asarray(h))
  wn, vn = np.linalg.eigh(h)
  np.testing.assert_allclose(w, wn[::-1], rtol=1e-5, atol=1e-5 * wn[-1])
  np.testing.assert_allclose(np.abs(np.sum(np.asarray(v) * vn[:, ::-1], axis=0)), 1.0, atol=1e-4)


def test_primitives_racs_candidates_compute_the_library_fixed_point():
  """The RACS fixed-point variants that ``benchmarks/primitives.py`` times (products as
  ``dot``; ``P`` recomputed from a bfloat16 gradient) give the library's ``(s, q)``."""
  from benchmarks import primitives
  from fisher_optax.blocks.two_sided import two_sided_fixed_point
  g = jnp.asarray(np.random.default_rng(3).standard_normal((12, 20)), jnp.float32)
  for x in (g, g.astype(jnp.bfloat16)):
    want = two_sided_fixed_point(x, 5)
    for recompute in (False, True):
      got = primitives.fixed_point_by_dots(x, recompute=recompute)
      np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
      np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
  # the recomputing variant is another program: P is never stored (XLA would otherwise
  # hoist it out of the loop and compile the library's form)
  big = jax.ShapeDtypeStruct((4, 64, 96), jnp.float32)
  temp = lambda f: jax.jit(jax.vmap(f)).lower(big).compile().memory_analysis()  # noqa: E731
  stored = temp(lambda x: two_sided_fixed_point(x, 5)).temp_size_in_bytes
  assert stored >= 4 * 64 * 96 * 4
  assert temp(lambda x: primitives.fixed_point_by_dots(x, recompute=True)
              ).temp_size_in_bytes < stored // 4
