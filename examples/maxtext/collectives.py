"""What MaxText's own training step sends per device with each optimizer, read from its
compiled program:

    python examples/maxtext/collectives.py [--devices 8] [--tensor 1] \\
        [--optimizers adamw,muon,fo_muon,racs,alice,...] [--owner-layouts auto,specs,off] \\
        [--json FILE] [MaxText key=value overrides ...]

Each optimizer runs one step of MaxText's training loop (``train.py`` here, on
``--devices`` CPU devices, FSDP over all of them, or FSDP x ``--tensor`` tensor
parallelism), with XLA writing the compiled training step out
(``--xla_dump_to``). Its program after SPMD partitioning is read by the parser of
``benchmarks/collectives.py``: bytes each device sends per collective kind (ring
algorithms, loops times their trip counts), on an ordinary step (each conditional's
cheapest branch) and on a refresh step (its dearest). Figures are ratios to the model's
parameter bytes. The step includes FSDP's own traffic (parameters gathered for the
forward and backward passes, gradients reduced), so MaxText's AdamW, whose update sends
nothing, is the yardstick: what an optimizer *adds* is its step's figure minus AdamW's.

``adamw`` and ``muon (MaxText)`` are MaxText's own optimizers (``opt_type``); every other
name is a fisher_optax optimizer through the launcher, with each ``--owner-layouts``
setting (``auto``: its default, the split read from the parameters' logical names under
MaxText's rules in force at ``init``; ``specs``: the launcher's mesh and specs; ``off``).

MaxText needs Python 3.12 or newer (``pip install maxtext``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# A 4-layer decoder of width 128 (about 2.6M parameters; half of them in the embedding
# and the output layer).
MODEL = ["dataset_type=synthetic", "steps=1", "per_device_batch_size=1",
         "max_target_length=64", "base_emb_dim=128", "base_num_query_heads=4",
         "base_num_kv_heads=4", "base_mlp_dim=512", "base_num_decoder_layers=4", "head_dim=32",
         "vocab_size=4096", "enable_checkpointing=false", "hardware=cpu",
         "skip_jax_distributed_system=true"]

MAXTEXT = {"adamw": ["opt_type=adamw"], "muon (MaxText)": ["opt_type=muon"]}
LOW_RANK = {"alice", "alice0", "alice_soap", "galore", "fira", "apollo"}


def parser_module():
  """``benchmarks/collectives.py`` (its HLO parser), imported by path."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("fo_collectives",
                                                ROOT / "benchmarks" / "collectives.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # its dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def parameter_bytes(log: str) -> int:
  """The model's parameter bytes from the launcher's report line."""
  m = re.search(r"parameters: ([0-9,]+) bytes", log)
  if not m:
    raise ValueError("the launcher printed no 'parameters: N bytes' line")
  return int(m.group(1).replace(",", ""))


def train_step_program(dump: pathlib.Path) -> str:
  """The compiled training step's HLO after optimizations from an XLA dump directory
  (the last one compiled, where there are several)."""
  found = sorted(dump.glob("module_*.jit_train_step*after_optimizations.txt"),
                 key=lambda p: int(re.match(r"module_(\d+)", p.name).group(1)))
  if not found:
    raise FileNotFoundError(f"no compiled train_step in {dump}")
  return found[-1].read_text()


def command(name: str, layout: str, rank: int, overrides: list) -> list:
  """The launcher's command line for one optimizer and owner-layout setting."""
  if name in MAXTEXT:
    flags = ["--optimizer", "maxtext"]
    extra = MAXTEXT[name]
  else:
    flags = ["--optimizer", name, "--owner-layout", layout]
    flags += ["--rank", str(rank)] if name in LOW_RANK else []
    extra = []
  return [sys.executable, str(HERE / "train.py"), *flags, *extra, *overrides]


def measure(name: str, layout: str, args, collectives) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    dump = pathlib.Path(tmp) / "dump"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"--xla_force_host_platform_device_count={args.devices} --xla_dump_to={dump} "
        "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"))
    mesh = [f"ici_fsdp_parallelism={args.devices // args.tensor}",
            f"ici_tensor_parallelism={args.tensor}"]
    overrides = [f"run_name=c{os.getpid()}", f"base_output_directory={tmp}/out", *MODEL,
                 *mesh, *args.overrides]
    out = subprocess.run(command(name, layout, args.rank, overrides), env=env,
                         capture_output=True, text=True, timeout=1800)
    log = out.stdout + out.stderr
    if out.returncode:
      raise RuntimeError(f"{name} ({layout}) failed:\n{log[-3000:]}")
    text = train_step_program(dump)
  pbytes = parameter_bytes(log)
  row = dict(optimizer=name, owner_layout=None if name in MAXTEXT else layout,
             devices=args.devices, tensor=args.tensor, param_bytes=pbytes)
  for step, refresh in (("ordinary", False), ("refresh", True)):
    t, unknown = collectives.traffic(text, args.devices, refresh=refresh)
    row[f"{step}_ratio"] = t.total / pbytes
    row[f"{step}_collectives"] = t.collectives
    row[f"by_kind_{step}"] = {k: v / pbytes for k, v in t.sent.items() if v}
    row["loops_without_trip_count"] = len(unknown)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (FSDP over "
                 "the rest)")
  p.add_argument("--optimizers", default="adamw,muon (MaxText),muon,racs,alice,galore,"
                 "alice_soap,soap,eigen_adam,shampoo")
  p.add_argument("--owner-layouts", default="auto,specs,off")
  p.add_argument("--rank", type=int, default=32, help="rank of the low-rank optimizers")
  p.add_argument("--json", default=None)
  args, args.overrides = p.parse_known_args(argv)
  collectives = parser_module()
  rows = []
  print(f"MaxText train step, {args.devices} CPU devices, FSDP {args.devices // args.tensor}"
        f" x TP {args.tensor}: bytes sent per device per step / parameter bytes")
  print(f"{'optimizer':22s} {'owner layout':12s} {'ordinary':>9s} {'refresh':>9s} "
        f"{'added':>15s}")
  base = None
  for name in args.optimizers.split(","):
    for layout in (["-"] if name in MAXTEXT else args.owner_layouts.split(",")):
      row = measure(name, layout, args, collectives)
      rows.append(row)
      if name == "adamw":
        base = row["ordinary_ratio"]
      added = ("" if base is None else
               f"{row['ordinary_ratio'] - base:+.3f} / {row['refresh_ratio'] - base:+.3f}")
      print(f"{name:22s} {layout:12s} {row['ordinary_ratio']:8.3f}x {row['refresh_ratio']:8.3f}x "
            f"{added:>15s}", flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
