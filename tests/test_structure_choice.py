"""A structure chosen per layer: the knapsack against brute force, the per-leaf rule, the
partition's updates against each optimizer alone, describe, shardings, orbax, bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fisher_optax as fo
from fisher_optax.fisher import fisher_report as fr
from fisher_optax.fisher import structure_choice as sc

SHAPES = {"a": (8, 24), "b": (16, 16), "c": (24, 8), "d": (12, 20), "emb": (30, 8),
          "bias": (16,)}
REPORTED = ("a", "b", "c", "d")


def _params():
  return {k: jax.random.normal(jax.random.PRNGKey(i), s) * 0.1
          for i, (k, s) in enumerate(SHAPES.items())}


def _optimizers():
  return {"diagonal": optax.adam(1e-3), "two_sided": fo.racs(0.02),
          "alice": fo.alice(0.02, rank=2, interval=3), "soap": fo.soap(3e-3)}


def _report(seed=0, structures=("diagonal", "two_sided", "alice", "soap")):
  rng = np.random.default_rng(seed)
  rows = []
  for k in REPORTED:
    m, n = sorted(SHAPES[k])
    for s in structures:
      rows.append(fr.ReportRow(k, m, n, s, float(rng.uniform(0.2, 1.0)), 0))
  return fr.FisherReport(tuple(rows), 8, tuple(structures))


def _brute_force(choice, budget_bytes):
  """Least summed error over every assignment within the budget."""
  opts = choice.options
  best = (np.inf, None)
  for combo in itertools.product(*[list(opts[k]) for k in REPORTED]):
    used = sum(opts[k][s][1] for k, s in zip(REPORTED, combo))
    err = sum(opts[k][s][0] for k, s in zip(REPORTED, combo))
    if used <= budget_bytes and err < best[0]:
      best = (err, dict(zip(REPORTED, combo)))
  return best


@pytest.mark.parametrize("budget", [0.1, 0.4, 0.8, 1.5, 3.0])
def test_global_budget_matches_brute_force(budget):
  params = _params()
  for seed in range(3):
    choice = sc.choose_structures(_report(seed), _optimizers(), params, budget=budget,
                                  resolution=200_000)
    assert choice.state_bytes <= choice.budget_bytes
    want_err, want = _brute_force(choice, choice.budget_bytes)
    got_err = sum(c.relative for c in choice.layers)
    assert got_err == pytest.approx(want_err, abs=1e-12), (choice.structures, want)
    assert choice.budget_bytes == int(budget * sum(8 * np.prod(SHAPES[k]) for k in REPORTED))


def test_state_bytes_are_each_optimizers_own():
  params = _params()
  choice = sc.choose_structures(_report(), _optimizers(), params, budget=5.0)
  for k in REPORTED:
    m, n = sorted(SHAPES[k])
    assert choice.options[k]["diagonal"][1] == 8 * m * n        # Adam: two float32 moments
    assert choice.options[k]["two_sided"][1] == 4 * (m + n + 1)  # RACS: s, q, limiter norm
    assert choice.options[k]["soap"][1] == 4 * (2 * m * m + 2 * n * n + 2 * m * n)


def test_per_leaf_budget_takes_the_best_structure_that_fits():
  params = _params()
  report = _report(1)
  choice = sc.choose_structures(report, _optimizers(), params, budget=0.6, per_leaf=True)
  errors = report.table()
  for c in choice.layers:
    fits = {s: e for s, (e, b) in choice.options[c.path].items() if b <= 0.6 * c.adam_bytes}
    assert c.structure == min(fits, key=fits.get)
    assert c.relative == errors[c.path][c.structure]
    assert c.state_bytes <= 0.6 * c.adam_bytes


def test_a_generous_budget_takes_the_lowest_error_everywhere():
  report = _report(2)
  choice = sc.choose_structures(report, _optimizers(), _params(), budget=100.0)
  best = {k: min(v, key=v.get) for k, v in report.table().items()}
  assert choice.structures == best


def _step(tx, params, state, g):
  u, state = tx.update(g, state, params)
  return optax.apply_updates(params, u), state


def _grads(t):
  return {k: jax.random.normal(jax.random.PRNGKey(100 + 7 * t + i), s)
          for i, (k, s) in enumerate(SHAPES.items())}


def test_partition_updates_equal_each_optimizer_alone():
  params = _params()
  opts = _optimizers()
  report = _report(3)
  choice = sc.choose_structures(report, opts, params, budget=1.0)
  assert len(set(choice.structures.values())) >= 2, choice.structures
  fallback = optax.adamw(1e-3)
  tx = sc.per_layer(choice, opts, fallback=fallback)
  alone = {s: opts[s] for s in set(choice.structures.values())} | {"fallback": fallback}
  p, state = params, tx.init(params)
  ref = {s: (params, t.init(params)) for s, t in alone.items()}
  step = jax.jit(lambda p, s, g: _step(tx, p, s, g))
  for t in range(5):  # past alice's refresh interval of 3
    g = _grads(t)
    p, state = step(p, state, g)
    ref = {s: _step(alone[s], *ref[s], g) for s in alone}
  for k in SHAPES:
    s = choice.structures.get(k, "fallback")
    np.testing.assert_allclose(p[k], ref[s][0][k], rtol=2e-5, atol=1e-7, err_msg=f"{k} {s}")
    assert not np.allclose(p[k], params[k])


def test_describe_names_each_leafs_optimizer():
  params = _params()
  opts = _optimizers()
  choice = sc.choose_structures(_report(3), opts, params, budget=1.0)
  tx = sc.per_layer(choice, opts, fallback=optax.adam(1e-3))
  rules = {r.path: r.rule for r in fo.describe(tx, params).rows}
  named = {"two_sided": "racs", "alice": "alice", "soap": "soap", "diagonal": "other"}
  for k, s in choice.structures.items():
    assert rules[k] == named[s], (k, s, rules[k])
  assert rules["emb"] == rules["bias"] == "other"


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
def test_sharded_and_checkpointed(tmp_path):
  params = _params()
  opts = _optimizers()
  choice = sc.choose_structures(_report(3), opts, params, budget=1.0)
  tx = sc.per_layer(choice, opts, fallback=optax.adam(1e-3))
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
  specs = {k: P("fsdp", "tensor") if len(s) == 2 else P() for k, s in SHAPES.items()}
  specs["c"] = P("tensor", "fsdp")
  p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
  s_sh = fo.state_shardings(tx, params, specs, mesh)
  step = jax.jit(lambda p, s, g: _step(tx, p, s, g), in_shardings=(p_sh, s_sh, p_sh),
                 out_shardings=(p_sh, s_sh))
  p = jax.device_put(params, p_sh)
  state = jax.jit(tx.init, out_shardings=s_sh)(p)
  for t in range(2):
    p, state = step(p, state, jax.device_put(_grads(t), p_sh))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = ocp.StandardCheckpointer().restore(tmp_path / "state", abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  p1, s1 = step(p, state, jax.device_put(_grads(2), p_sh))
  p2, s2 = step(p, restored, jax.device_put(_grads(2), p_sh))
  for k in SHAPES:
    np.testing.assert_array_equal(p1[k], p2[k])
  # the single-device run gives the same parameters
  q, qs = params, tx.init(params)
  for t in range(3):
    q, qs = _step(tx, q, qs, _grads(t))
  for k in SHAPES:
    np.testing.assert_allclose(p1[k], q[k], rtol=1e-4, atol=1e-6)


def test_from_a_real_report_of_a_model():
  """End to end: fisher_report of a two-layer model, a choice, a working optimizer."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 12)).astype(np.float32)
  y = rng.standard_normal((64, 4)).astype(np.float32)
  params = {"w1": jnp.asarray(rng.standard_normal((12, 16)) * 0.3, jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((16, 4)) * 0.3, jnp.float32),
            "b": jnp.zeros((4,))}

  def loss(p, batch):
    xb, yb = batch
    return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] + p["b"] - yb) ** 2)

  batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 64, 4)]
  report = fr.fisher_report(loss, params, batches, rank=2,
                            structures=("diagonal", "two_sided", "soap"))
  opts = {"diagonal": optax.adam(1e-2), "two_sided": fo.racs(0.05), "soap": fo.soap(1e-2)}
  choice = sc.choose_structures(report, opts, params, budget=2.0)
  assert set(choice.structures) == {"w1", "w2"}
  tx = sc.per_layer(choice, opts, fallback=optax.adam(1e-2))
  step = jax.jit(lambda p, s: _step(tx, p, s, jax.grad(loss)(p, (x, y))))
  p, state = params, tx.init(params)
  for _ in range(20):
    p, state = step(p, state)
  assert loss(p, (x, y)) < 0.7 * loss(params, (x, y))
  assert "w1" in choice.to_markdown() and "Leaves per structure" in choice.to_markdown()


def test_report_csv_round_trip(tmp_path):
  report = _report(4)
  report.to_csv(tmp_path / "r.csv")
  back = fr.FisherReport.from_csv(tmp_path / "r.csv")
  assert back.structures == report.structures and back.samples == report.samples
  for a, b in zip(back.rows, report.rows):
    assert a.matrix == b.matrix and a.structure == b.structure
    assert a.relative == pytest.approx(b.relative, rel=1e-5)


def test_bad_input_raises_naming_the_problem():
  params = _params()
  opts = _optimizers()
  report = _report()
  with pytest.raises(ValueError, match="largest cheapest leaf is 'a' at 132 bytes"):
    sc.choose_structures(report, opts, params, budget=1e-3)
  with pytest.raises(ValueError, match="leaf 'a' has no structure within"):
    sc.choose_structures(report, opts, params, budget=1e-4, per_leaf=True)
  with pytest.raises(ValueError, match="exactly one"):
    sc.choose_structures(report, opts, params, budget=1.0, budget_bytes=10)
  with pytest.raises(ValueError, match="exactly one"):
    sc.choose_structures(report, opts, params)
  with pytest.raises(ValueError, match="positive"):
    sc.choose_structures(report, opts, params, budget=0.0)
  with pytest.raises(ValueError, match=r"no structure \['shampoo'\]"):
    sc.choose_structures(report, opts | {"shampoo": fo.shampoo(1e-3)}, params, budget=1.0)
  with pytest.raises(ValueError, match="report leaf 'a' is not in params"):
    sc.choose_structures(report, opts, {k: v for k, v in params.items() if k != "a"},
                         budget=1.0)
  choice = sc.choose_structures(report, opts, params, budget=100.0)
  used = sorted(set(choice.structures.values()))
  with pytest.raises(ValueError, match="the choice uses"):
    sc.per_layer(choice, {"diagonal": opts["diagonal"]} if used != ["diagonal"] else {},
                 fallback=optax.adam(1e-3))
  tx = sc.per_layer(choice, opts, fallback=optax.adam(1e-3))
  with pytest.raises(ValueError, match="chosen leaf 'a' is not in the parameters"):
    tx.init({k: v for k, v in params.items() if k != "a"})
  choice_bytes = sc.choose_structures(report, opts, params, budget_bytes=10 ** 6)
  assert choice_bytes.budget_bytes == 10 ** 6


def test_a_non_finite_report_error_is_a_value_error_naming_the_matrix():
  report = _report()
  rows = list(report.rows)
  rows[1] = fr.ReportRow(rows[1].matrix, rows[1].m, rows[1].n, rows[1].structure,
                         float("nan"), 0)
  bad = fr.FisherReport(tuple(rows), report.samples, report.structures)
  with pytest.raises(ValueError, match="error of 'a' is nan"):
    sc.choose_structures(bad, _optimizers(), _params(), budget=1.0)
