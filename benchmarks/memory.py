"""Optimizer memory of the LLaMA presets, from the real state trees, next to the paper's table.

    python benchmarks/memory.py [--json]

For each preset (60M, 130M, 350M, 1B) and optimizer, ``jax.eval_shape`` builds the
parameter and optimizer-state trees (nothing is allocated) and the estimate of the
paper's Table "Memory consumption estimation" is formed the same way: weights + Adam
states for non-matrix parameters (embeddings, norms) + the optimizer's states for the
matrices, all at 2 bytes per number (bf16), in GiB. ``Mem`` trains the output layer with
the structured optimizer, ``Mem*`` with Adam. Step counters and PRNG keys are counted
too (a few bytes). It also prints XLA's temp bytes for one jitted update of the 60M model
(``compiled.memory_analysis()``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fisher_optax as fo
from examples.llama import presets
from examples.llama.model import Llama

PAPER = {  # GiB: (Mem, Mem*) per preset; None = not reported
    "adam": {"60M": (None, 0.32), "130M": (None, 0.75), "350M": (None, 2.05), "1B": (None, 7.48)},
    "galore": {"60M": (0.21, 0.26), "130M": (0.51, 0.57), "350M": (1.2, 1.29), "1B": (4.25, 4.43)},
    "fira": {"60M": (0.21, 0.26), "130M": (0.51, 0.57), "350M": (1.2, 1.29), "1B": (4.25, 4.43)},
    "apollo_mini": {"60M": (None, 0.23), "130M": (None, 0.43), "350M": (None, 0.93),
                    "1B": (None, 2.98)},
    "apollo": {"60M": (None, 0.26), "130M": (None, 0.57), "350M": (None, 1.29), "1B": (None, 4.43)},
    "racs": {"60M": (None, 0.23), "130M": (None, 0.43), "350M": (None, 0.93), "1B": (None, 2.98)},
    "alice0": {"60M": (0.21, 0.26), "130M": (0.51, 0.57), "350M": (1.2, 1.29), "1B": (4.25, 4.44)},
    "alice": {"60M": (0.22, 0.26), "130M": (0.53, 0.59), "350M": (1.24, 1.33), "1B": (4.42, 4.6)},
}
# Not in the paper (its low-rank SOAP is future work there; NorMuon and Dion are later
# work; dion16: Dion at rank 1/16):
# measured, no paper value.
OURS = ("alice_soap", "normuon", "dion", "dion16")
# The paper's Apollo-svd row: rank as GaLore, projection by SVD; our apollo is the random-
# projection release, whose state has no m x r basis, so its Mem* is compared for reference.
PRESETS = ("60M", "130M", "350M", "1B")


def abstract_params(preset: str):
  cfg = presets.model_config(preset, param_dtype="bfloat16", dtype="bfloat16")
  return nnx.state(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))), nnx.Param)


def estimate_gib(name: str, preset: str, lm_head_on_adam: bool) -> float:
  params = abstract_params(preset)
  tx = presets.make_optimizer(name, preset, 1e-3, lm_head_on_adam=lm_head_on_adam)
  state = jax.eval_shape(tx.init, params)
  numbers = fo.state_numbers(params) + fo.state_numbers(state)
  return numbers * 2 / 2 ** 30


def table(names=tuple(PAPER) + OURS, preset_names=PRESETS) -> list[dict]:
  rows = []
  for name in names:
    for preset in preset_names:
      mem = None if name in ("adam", "racs", "apollo", "apollo_mini") else \
          estimate_gib(name, preset, False)
      mem_star = estimate_gib(name, preset, True)
      p_mem, p_star = PAPER[name][preset] if name in PAPER else (None, None)
      rows.append(dict(optimizer=name, preset=preset, mem=mem, mem_star=mem_star,
                       paper_mem=p_mem, paper_mem_star=p_star))
  return rows


def temp_bytes(name: str, preset: str = "60M") -> int:
  params = abstract_params(preset)
  tx = presets.make_optimizer(name, preset, 1e-3)
  state = jax.eval_shape(tx.init, params)
  compiled = jax.jit(tx.update).lower(params, state, params).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--no-temp", action="store_true", help="skip XLA's temp-bytes compile")
  args = ap.parse_args()
  rows = table()
  if args.json:
    print(json.dumps(rows, indent=2))
    return
  fmt = lambda x: "  -  " if x is None else f"{x:5.2f}"
  print(f"{'optimizer':12s} {'preset':6s} {'Mem':>6s} {'paper':>6s} {'Mem*':>6s} {'paper':>6s}"
        f" {'diff*':>6s}")
  for r in rows:
    diff = (r["mem_star"] / r["paper_mem_star"] - 1) * 100 if r["paper_mem_star"] else 0.0
    print(f"{r['optimizer']:12s} {r['preset']:6s} {fmt(r['mem'])} {fmt(r['paper_mem'])}"
          f" {fmt(r['mem_star'])} {fmt(r['paper_mem_star'])} {diff:+5.1f}%")
  if not args.no_temp:
    print("\nXLA temp bytes of one jitted update, 60M preset (bf16 params):")
    for name in ("adam", "racs", "alice", "galore"):
      print(f"  {name:8s} {temp_bytes(name) / 2 ** 20:8.1f} MiB")


if __name__ == "__main__":
  main()
