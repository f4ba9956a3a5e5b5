"""benchmarks/cost_model.py: what it adds to XLA's cost analysis is right on programs
whose FLOPs are known by hand, and its per-optimizer figures have the expected order."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import cost_model  # noqa: E402


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def test_loop_bodies_count_once_per_trip():
  """A 64 x 64 matmul run 6 times in a fori_loop: 6 * 2 * 64^3 FLOPs, where XLA's own
  analysis counts the body once."""
  x = jnp.ones((64, 64))
  c = _compiled(lambda x: jax.lax.fori_loop(0, 6, lambda i, y: y @ x, x), x)
  cost = cost_model.cost_of(c)
  one = 2 * 64 ** 3
  assert cost["xla_flops"] < 2 * one  # the blind spot being corrected
  assert cost["flops"] == pytest.approx(6 * one, rel=0.05)
  assert cost["unknown_trip_counts"] == 0


def test_decompositions_in_a_sequential_map_are_counted_per_matrix():
  """eigh of 5 matrices of 32 x 32 through lax.map (one loop body): 5 * 9 * 32^3."""
  a = jnp.eye(32)[None].repeat(5, 0)
  c = _compiled(lambda a: jax.lax.map(jnp.linalg.eigh, a), a)
  cost = cost_model.cost_of(c)
  assert cost["decomposition_flops"] == pytest.approx(5 * 9 * 32 ** 3)
  assert sum(cost["decomposition_calls"].values()) == 5


@pytest.mark.parametrize("target,shape,flops", [
    ("lapack_ssyevd_ffi", (4, 10, 10), 4 * 9 * 1000),
    ("lapack_sgeqrf_ffi", (20, 10), 2 * 20 * 100 - 2 * 1000 / 3),
    ("lapack_sgesdd_ffi", (10, 20), 6 * 20 * 100 + 20 * 1000),
    ("lapack_spotrf_ffi", (3, 10, 10), 3 * 1000 / 3),
    ("lapack_sgetrf_ffi", (10, 10), 0.0),
])
def test_decomposition_flop_counts(target, shape, flops):
  assert cost_model.decomposition_flops(target, shape) == pytest.approx(flops)


def test_triangular_solve_flops_count_the_right_hand_sides():
  """``n^2 k``: a 10 x 10 factor (batch 3) applied to 7 right-hand sides."""
  assert cost_model.decomposition_flops("lapack_strsm_ffi", (3, 10, 10), (3, 10, 7)) == \
      pytest.approx(3 * 100 * 7)


@pytest.mark.example
def test_refresh_costs_more_than_an_ordinary_step_and_counters_fold():
  """On the tiny LLaMA's shapes: Alice's refresh (subspace iteration, QR, eigh on every
  routed matrix) costs more than its ordinary step, which runs no decomposition; RACS
  has no refresh; Adam's update is a few FLOPs per parameter."""
  params, _ = cost_model.step_time.abstract_params("tiny")
  n = sum(x.size for x in jax.tree.leaves(params))
  alice = cost_model.optimizer_costs("alice", "tiny", params)
  assert alice["ordinary"]["decomposition_flops"] == 0
  assert alice["refresh"]["decomposition_flops"] > 0
  assert alice["refresh"]["flops"] > 2 * alice["ordinary"]["flops"]
  adam = cost_model.update_cost(cost_model.step_time.build("adam", "tiny"), params, count=1)
  assert 5 * n < adam["flops"] < 50 * n
