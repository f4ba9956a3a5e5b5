"""examples/maxtext/train.py: MaxText's own training loop with fisher_optax optimizers on
4 CPU devices (FSDP), a tiny decoder, synthetic data. Runs only where MaxText is
installed (Python 3.12+, ``pip install maxtext``); skipped otherwise. The pieces it
relies on -- state named by its own shape, ``dims`` from optax's Muon dimension numbers,
``fo.flax_dims`` on MaxText's DenseGeneral -- are tested without MaxText
(``tests/test_nnx_sharding.py``, ``tests/test_muon_dims.py``)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.util import HANG_S

pytest.importorskip("maxtext")
pytestmark = pytest.mark.example

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["dataset_type=synthetic", "steps=3", "per_device_batch_size=1", "max_target_length=32",
        "base_emb_dim=64", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=128",
        "base_num_decoder_layers=2", "head_dim=32", "vocab_size=256",
        "enable_checkpointing=false", "hardware=cpu", "skip_jax_distributed_system=true",
        "ici_fsdp_parallelism=4"]


@pytest.mark.parametrize("optimizer,extra", [("racs", []), ("alice", ["--rank", "16"])])
def test_maxtext_trains_with_named_optimizer(optimizer, extra, tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  cmd = [sys.executable, str(ROOT / "examples" / "maxtext" / "train.py"), "--optimizer",
         optimizer, *extra, "--learning-rate", "1e-3", f"run_name={optimizer}",
         f"base_output_directory={tmp_path}", *TINY]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
  log = out.stdout + out.stderr
  assert out.returncode == 0, log[-3000:]
  assert re.search(rf"decoder/layers/mlp/wi_0/kernel\s+64x2x128\s+{optimizer}\s+2 x 64 x 128", log)
  losses = [float(x) for x in re.findall(r"completed step: \d+, .* loss: ([0-9.]+)", log)]
  assert len(losses) == 3 and losses[-1] < losses[0], losses
  first, total = (int(x.replace(",", "")) for x in
                  re.search(r"optimizer state: ([0-9,]+) bytes on device 0 of ([0-9,]+)", log).groups())
  assert first < 0.6 * total  # sharded over the 4 devices by MaxText's rules, not replicated


def test_maxtext_owner_layout_from_its_logical_rules_trains_alike(tmp_path):
  """``--owner-layout specs``: Muon's whole-matrix work on owners of MaxText's mesh, each
  matrix moved from its split under MaxText's logical axis rules; the losses of the
  three steps are those with the owner layout off."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  losses = {}
  for layout in ("specs", "off"):
    cmd = [sys.executable, str(ROOT / "examples" / "maxtext" / "train.py"), "--optimizer",
           "muon", "--owner-layout", layout, "--learning-rate", "1e-3", f"run_name=owner_{layout}",
           f"base_output_directory={tmp_path}", *TINY]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    losses[layout] = [float(x) for x in
                      re.findall(r"completed step: \d+, .* loss: ([0-9.]+)", log)]
  assert len(losses["specs"]) == 3
  assert losses["specs"] == pytest.approx(losses["off"], rel=1e-4), losses
