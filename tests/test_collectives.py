"""benchmarks/collectives.py: its HLO reader on programs with known collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks import collectives as C

# A program with every construct the reader follows: a collective in the entry, one in a
# loop of 5 trips, one in each branch of a conditional, the three replica-group
# spellings, an async all-reduce.
HLO = """\
%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%body (p: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %ag = f32[64,32]{1,0} all-gather(f32[8,32]{1,0} %x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, metadata={op_name="jit(f)/while/body/all_gather"}
  ROOT %t = (s32[], f32[8,32]) tuple(%i, %x)
}

%cond (p: (s32[], f32[8,32])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

%cheap (p: (f32[16])) -> (f32[16]) {
  %ar = f32[16]{0} all-reduce(f32[16]{0} %a), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %t = (f32[16]) tuple(%ar)
}

%dear (p: (f32[16])) -> (f32[16]) {
  %a2a = f32[1024]{0} all-to-all(f32[1024]{0} %b), replica_groups=mesh['a'=2,'b'=4] {'a','b'}, dimensions={0}
  %rs = f32[16]{0} reduce-scatter(f32[128]{0} %c), replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, to_apply=%add
  ROOT %t = (f32[16]) tuple(%rs)
}

ENTRY %main (a: f32[8,32]) -> f32[16] {
  %ars = f32[256]{0} all-reduce-start(f32[256]{0} %a), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(f)/(jit(g)/dot_general:jit(h)/reduce_sum:jit(g)/dot_general)" stack_frame_id=3}
  %ard = f32[256]{0} all-reduce-done(f32[256]{0} %ars)
  %cp = bf16[100]{0} collective-permute(bf16[100]{0} %z), source_target_pairs={{0,1},{1,0}}
  %w = (s32[], f32[8,32]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %c = (f32[16]) conditional(pred[] %p, %x, %x), branch_computations={%cheap, %dear}
}
"""


def test_reader_on_a_program_with_known_collectives():
  entry = 2 * 1024 * 7 / 8 + 200                 # async all-reduce (g=8), permute
  loop = 5 * 64 * 32 * 4 * 7 / 8                  # all-gather, g=8, 5 trips
  cheap = 2 * 64 * 3 / 4                           # all-reduce of 64 bytes, g=4
  dear = 4096 * 7 / 8 + 64 * 3                     # all-to-all g=8; reduce-scatter g=4
  ordinary, unknown = C.traffic(HLO, 8, refresh=False)
  refresh, _ = C.traffic(HLO, 8, refresh=True)
  assert unknown == []
  assert ordinary.total == pytest.approx(entry + loop + cheap)
  assert refresh.total == pytest.approx(entry + loop + dear)
  assert refresh.count == {"all-gather": 5, "reduce-scatter": 1, "all-reduce": 1,
                           "all-to-all": 1, "collective-permute": 1}
  assert ordinary.count["all-reduce"] == 2 and ordinary.count["all-to-all"] == 0


def test_reader_names_the_sources_of_the_traffic():
  """``--top``: bytes per issuing operation (``op_name``), loops multiplied and the chosen
  branch only, as in the totals; collectives XLA combined list their operations once."""
  ordinary, _ = C.traffic(HLO, 8, refresh=False)
  (loop, k1, n1), (combined, k2, n2) = ordinary.largest(2)
  assert (k1, n1) == ("all-gather", "jit(f)/while/body/all_gather")
  assert loop == pytest.approx(5 * 64 * 32 * 4 * 7 / 8)
  assert (k2, n2) == ("all-reduce", "jit(f)/[jit(g)/dot_general + jit(h)/reduce_sum]")
  assert combined == pytest.approx(2 * 1024 * 7 / 8)
  assert sum(b for b, _, _ in ordinary.largest(99)) == pytest.approx(ordinary.total)
  refresh, _ = C.traffic(HLO, 8, refresh=True)
  assert ("all-to-all", "") in refresh.by_source and ("all-to-all", "") not in ordinary.by_source


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
def test_reader_on_a_compiled_all_gather_and_all_reduce():
  """A sharded array gathered to every device: ``(g - 1) / g`` of its bytes sent by each;
  a sum over the sharded axis: one all-reduce of the result."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  gather = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
  got, _ = C.traffic(gather.lower(x).compile().as_text(), 8, refresh=False)
  assert got.total == pytest.approx(64 * 32 * 4 * 7 / 8)
  assert got.count["all-gather"] == 1
  reduce = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))
  got, _ = C.traffic(reduce.lower(x).compile().as_text(), 8, refresh=False)
  assert got.count["all-reduce"] == 1 and got.total == pytest.approx(2 * 32 * 4 * 7 / 8)


def test_reader_on_groups_of_devices_placed_on_a_mesh():
  """XLA's mesh spelling with ``device_ids``: the devices laid out on a mesh of its own;
  a group spans the named axes of that mesh. Read as positions in the benchmark's mesh
  (data 2 x fsdp 4, devices in id order), each group is one mesh axis or both."""
  placed = ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
            "device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}")
  assert C.group_size(placed, 8) == 4
  assert C.first_group(placed, 8) == [0, 1, 2, 3]
  listed = "replica_groups=mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'a'}"
  assert C.group_size(listed, 8) == 2 and C.first_group(listed, 8) == [7, 3]
  mesh = {"data": 2, "fsdp": 4}
  assert C.group_axes(placed, 8, mesh) == "fsdp"
  assert C.group_axes("replica_groups=[4,2]<=[2,4]T(1,0), dims", 8, mesh) == "data"
  assert C.group_axes("replica_groups={{0,4},{1,5},{2,6},{3,7}}", 8, mesh) == "data"
  assert C.group_axes("replica_groups=mesh['a'=2,'b'=4] {'a','b'}", 8, mesh) == "data+fsdp"
  assert C.group_axes("replica_groups=[2,4]<=[8], dims", 8, mesh) == "fsdp"
  assert C.group_axes("replica_groups=[2,4]<=[8], dims", 8, None) == ""


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
def test_reader_tells_the_mesh_axes_of_compiled_collectives():
  """On data 2 x fsdp 4: a sum over ``data`` and a gather over ``fsdp`` (``shard_map``),
  each counted once, under its own axis, with its own group size."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))

  def body(x):
    return jax.lax.all_gather(jax.lax.psum(x, "data"), "fsdp", axis=0, tiled=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P(),
                            check_vma=False))
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  got, _ = C.traffic(f.lower(x).compile().as_text(), 8, refresh=False,
                     mesh_shape={"data": 2, "fsdp": 4})
  shard = 16 * 32 * 4
  assert got.by_axes == pytest.approx({"data": 2 * shard / 2, "fsdp": 4 * shard * 3 / 4})
  assert got.total == pytest.approx(sum(got.by_axes.values()))


@pytest.mark.example
def test_collectives_script_runs_on_tiny(tmp_path):
  """The script on 4 devices: Adam's update sends nothing, GaLore's refresh more than its
  ordinary step, the yardstick (FSDP's gradient step) first."""
  import json
  import pathlib
  import subprocess
  import sys

  from tests.util import HANG_S
  root = pathlib.Path(__file__).resolve().parents[1]
  out = tmp_path / "rows.json"
  subprocess.run([sys.executable, str(root / "benchmarks" / "collectives.py"), "--preset",
                  "tiny", "--devices", "4", "--optimizers", "adam,galore", "--json",
                  str(out)], capture_output=True, text=True, timeout=HANG_S, check=True)
  rows = {r["optimizer"]: r for r in json.loads(out.read_text())}
  assert list(rows) == ["train step (yardstick)", "adam", "galore"]
  assert rows["adam"]["ordinary_bytes"] == rows["adam"]["refresh_bytes"] == 0
  assert rows["galore"]["refresh_bytes"] > rows["galore"]["ordinary_bytes"] > 0
  assert rows["train step (yardstick)"]["ordinary_ratio"] > 1  # parameters gathered
  assert all(r["devices"] == 4 for r in rows.values())
  # GaLore's subspace iterations run a run-time number of times: counted once, and said
  assert rows["adam"]["loops_without_trip_count"] == 0
  assert rows["galore"]["loops_without_trip_count"] >= 1


def test_donated_state_takes_over_its_buffers():
  """``donate=True`` (``--donate``): the update's new state takes the old state's buffers,
  all of them (Adam's two moments and its count, on one device); without it, none."""
  from benchmarks import collectives
  donated = collectives.measure("adam", "tiny", "dp", 1, donate=True)
  kept = collectives.measure("adam", "tiny", "dp", 1)
  assert donated["donated"] and "donated" not in kept
  assert donated["alias_bytes"] == donated["state_bytes_per_device"] > 0


def test_max_precond_dim_reaches_the_rotation_family_only():
  """``--max-precond-dim``: SOAP's 2048-wide side (the ``tiny`` LLaMA's vocabulary) keeps
  no 2048 x 2048 statistic at 1024, and does at its default; an optimizer without the
  keyword is built as before."""
  from benchmarks import step_time
  params, _ = step_time.abstract_params("tiny")

  def squares(tx):  # the sizes of the state's square matrices
    return {x.shape[-1] for x in jax.tree.leaves(jax.eval_shape(tx.init, params))
            if x.ndim >= 2 and x.shape[-1] == x.shape[-2]}

  assert 2048 in squares(C.build("soap", "tiny", "off"))
  assert max(squares(C.build("soap", "tiny", "off", max_precond_dim=1024))) <= 1024
  assert "max_precond_dim" not in C._keywords("galore")
  C.build("galore", "tiny", "off", max_precond_dim=1024)  # not passed to GaLore


def _script_rows(tmp_path, axis_types: str) -> dict:
  """The script's rows for the library's Muon and ``optax.contrib.muon`` under FSDP x TP
  on 4 devices with ``--axis-types axis_types``, by optimizer."""
  import json
  import pathlib
  import subprocess
  import sys

  from tests.util import HANG_S
  root = pathlib.Path(__file__).resolve().parents[1]
  out = tmp_path / "rows.json"
  subprocess.run([sys.executable, str(root / "benchmarks" / "collectives.py"), "--preset",
                  "tiny", "--devices", "4", "--layout", "fsdp_tp", "--axis-types", axis_types,
                  "--no-train-step", "--optimizers", "fo_muon,muon", "--json", str(out)],
                 capture_output=True, text=True, timeout=HANG_S, check=True)
  return {r["optimizer"]: r for r in json.loads(out.read_text())}


@pytest.mark.example
def test_collectives_script_reads_the_split_on_explicit_axes(tmp_path):
  """The script with ``--axis-types explicit`` under FSDP x TP on 4 devices: the library's
  Muon is its two packed exchanges, and ``optax.contrib.muon``, which does not trace
  there, is a row that says so instead of an error."""
  rows = _script_rows(tmp_path, "explicit")
  assert rows["fo_muon"]["axis_types"] == "explicit"
  assert rows["fo_muon"]["ordinary_collectives"] == 2, rows["fo_muon"]
  assert rows["muon"]["error"].startswith("ShardingTypeError"), rows["muon"]


@pytest.mark.example
def test_collectives_script_reads_the_split_from_named_boxes(tmp_path):
  """The script with ``--axis-types boxes`` under FSDP x TP on 4 devices (``Auto`` axes,
  ``init`` given the parameters in boxes named by their specs): the library's Muon is its
  two packed exchanges, as with the split read on ``Explicit`` axes; optax's own Muon,
  which reads no boxes, is measured as it is."""
  rows = _script_rows(tmp_path, "boxes")
  assert rows["fo_muon"]["axis_types"] == "boxes"
  assert rows["fo_muon"]["ordinary_collectives"] == 2, rows["fo_muon"]
  assert rows["muon"]["ordinary_ratio"] > 10 * rows["fo_muon"]["ordinary_ratio"], rows


@pytest.mark.example
def test_collectives_script_reads_the_split_from_placed_arrays(tmp_path):
  """The script with ``--axis-types arrays`` under FSDP x TP on 4 devices (``Auto`` axes,
  ``init`` given concrete arrays placed by their specs): the library's Muon is its two
  packed exchanges, as with boxes named by mesh axes."""
  rows = _script_rows(tmp_path, "arrays")
  assert rows["fo_muon"]["axis_types"] == "arrays"
  assert rows["fo_muon"]["ordinary_collectives"] == 2, rows["fo_muon"]
  assert rows["muon"]["ordinary_ratio"] > 10 * rows["fo_muon"]["ordinary_ratio"], rows


@pytest.mark.example
def test_collectives_script_keeps_the_low_rank_state_on_the_owners(tmp_path):
  """The script with ``--owner-layout state`` (GaLore at ``tiny``, FSDP on 8 devices, the
  split given): GaLore's ordinary step is its two exchanges, as by default, and sends
  less than with its state laid out as the parameters (``--owner-layout leaf``)."""
  import json
  import pathlib
  import subprocess
  import sys

  from tests.util import HANG_S
  root = pathlib.Path(__file__).resolve().parents[1]
  rows = {}
  for owner in ("state", "default", "leaf"):
    out = tmp_path / f"{owner}.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "collectives.py"), "--preset",
                    "tiny", "--devices", "8", "--axis-types", "given", "--no-train-step",
                    "--optimizers", "galore", "--owner-layout", owner, "--json", str(out)],
                   capture_output=True, text=True, timeout=HANG_S, check=True)
    rows[owner] = json.loads(out.read_text())[0]
  assert rows["state"]["owner_layout"] == "state"
  assert rows["state"]["ordinary_collectives"] == 2, rows["state"]
  assert rows["default"]["ordinary_ratio"] == rows["state"]["ordinary_ratio"], rows
  assert rows["state"]["ordinary_ratio"] < rows["leaf"]["ordinary_ratio"], rows


def _largest_collective(text):
  """Bytes of the largest collective result in an HLO text (async starts included)."""
  out = 0
  for line in text.splitlines():
    op = C._OP.match(line)
    if op and op.group(2).removesuffix("-start") in C.KINDS:
      parts = C._ARRAY.findall(op.group(1))
      if parts:  # an async start's (operands, result): the result is the last
        out = max(out, C.shape_bytes("{}[{}]".format(*parts[-1])))
  return out


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
def test_dion_sends_factors_where_muon_sends_matrices():
  """FSDP on 8 devices, matrices split along their larger side. No collective of Dion's
  update is larger than a leaf's factors (``n x r`` per matrix, the stack's two at once:
  a quarter of its matrices at rank ``m / 4``): no matrix is gathered. Muon's Newton--Schulz iterations on the split matrices send
  more than the parameters' own bytes per device; Dion's whole update sends what its
  factors cost, ``P`` gathered and ``R = B P`` all-reduced (``(n r + 2 m r) (g - 1) / g``
  floats per matrix, the paper's ``(m + n) r`` with the all-reduce's two passes), within
  20%, under a quarter of Muon's."""
  import fisher_optax as fo
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
  shapes = {"wide": (64, 256), "tall": (256, 64), "stack": (2, 64, 256)}
  specs = {"wide": P(None, "fsdp"), "tall": P("fsdp", None), "stack": P(None, None, "fsdp")}
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, specs[k]))
            for k, s in shapes.items()}
  p_sh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  param_bytes = 4 * 64 * 256 * 4
  largest, sent = {}, {}
  for name, tx in [("dion", fo.dion(0.01, rank=16, dims=fo.MatrixDims())),
                   ("muon", fo.muon(0.01, dims=fo.MatrixDims()))]:
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(tx.init, params), s_sh)
    step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
    text = step.lower(params, state, params).compile().as_text()
    largest[name] = _largest_collective(text)
    sent[name] = C.traffic(text, 8, refresh=False)[0].total
  assert 0 < largest["dion"] <= 2 * 256 * 16 * 4, largest
  assert sent["muon"] > param_bytes
  factors = 4 * 4 * (256 * 16 + 2 * 64 * 16) * 7 / 8
  assert factors <= sent["dion"] <= 1.2 * factors, (sent, factors)
  assert sent["dion"] < sent["muon"] / 4, sent


def _maxtext_reader():
  """examples/maxtext/collectives.py, imported by path (it needs no MaxText to import)."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "maxtext" / "collectives.py"
  spec = importlib.util.spec_from_file_location("maxtext_collectives", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_maxtext_reader_takes_the_last_train_step_and_the_parameter_bytes(tmp_path):
  """The MaxText measurement reads the training step compiled last (module numbers
  compared as numbers, not as text) and the launcher's parameter bytes; without either
  it says what is missing."""
  M = _maxtext_reader()
  for number, text in (("0099", "old"), ("0100", HLO), ("0031", "older")):
    (tmp_path / f"module_{number}.jit_train_step.cpu_after_optimizations.txt").write_text(text)
  (tmp_path / "module_0200.jit_eval_step.cpu_after_optimizations.txt").write_text("eval")
  program = M.train_step_program(tmp_path)
  assert program == HLO
  t, _ = C.traffic(program, 8, refresh=True)
  assert t.sent["all-to-all"] == 1024 * 4 * 7 / 8
  assert M.parameter_bytes("x\nparameters: 1,234,567 bytes\n") == 1234567
  with pytest.raises(ValueError, match="parameters: N bytes"):
    M.parameter_bytes("no report")
  with pytest.raises(FileNotFoundError):
    M.train_step_program(tmp_path / "missing")


def test_maxtext_reader_commands():
  """MaxText's own optimizers go by ``opt_type``; the library's get the owner-layout
  setting, and a rank where they take one."""
  M = _maxtext_reader()
  adamw = M.command("adamw", "-", 32, ["steps=1"])
  assert adamw[2:] == ["--optimizer", "maxtext", "opt_type=adamw", "steps=1"]
  alice = M.command("alice", "specs", 16, [])
  assert alice[2:] == ["--optimizer", "alice", "--owner-layout", "specs", "--rank", "16"]
  assert "--rank" not in M.command("muon", "off", 16, [])
