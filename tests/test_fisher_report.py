"""fisher_optax.fisher.fisher_report on a small model: it routes as the optimizers do and its
numbers are structure_errors of the per-batch gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fisher_optax as fo
from fisher_optax.fisher import fisher_report as fr
from fisher_optax.fisher import structure_errors as se


def _model():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k[0], (6, 10)) * 0.3, "b1": jnp.zeros((10,)),
            "stack": jax.random.normal(k[1], (2, 10, 4)) * 0.3,
            "head": jax.random.normal(k[2], (4, 3)) * 0.3}

  def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    for i in range(2):
      h = jnp.tanh(h @ p["stack"][i][:, :10] if i == 0 else h)
    return jnp.mean((h[:, :4] @ p["head"] - y) ** 2) + jnp.sum(p["stack"] ** 2) * 1e-3

  rng = np.random.default_rng(0)
  batches = [(rng.standard_normal((8, 6)).astype(np.float32),
              rng.standard_normal((8, 3)).astype(np.float32)) for _ in range(6)]
  return params, loss_fn, batches


def test_report_routes_as_the_optimizers_and_matches_structure_errors():
  params, loss_fn, batches = _model()
  rep = fr.fisher_report(loss_fn, params, batches, rank=2, dims=fo.MatrixDims())
  # the bias goes to the fallback; the stack is two matrices; the head is read 3 x 4
  assert rep.matrices == ["head", "stack[0]", "stack[1]", "w1"]
  assert rep.samples == 6
  grads = [jax.grad(loss_fn)(params, b) for b in batches]
  w1 = np.stack([np.asarray(g["w1"]) for g in grads])  # 6 x 10: already m <= n
  want = se.structure_errors(w1, rank=2, smaller_first=False)
  got = rep.table()["w1"]
  for s in se.STRUCTURES:
    np.testing.assert_allclose(got[s], want[s].relative, rtol=1e-5)
  head = np.stack([np.asarray(g["head"]).T for g in grads])  # 4 x 3 -> 3 x 4
  np.testing.assert_allclose(rep.table()["head"]["diagonal"],
                             se.structure_errors(head, rank=1)["diagonal"].relative, rtol=1e-5)
  assert set(rep.best()) == set(rep.matrices)


def test_report_outputs(tmp_path):
  params, loss_fn, batches = _model()
  rep = fr.fisher_report(loss_fn, params, batches, rank=2,
                         structures=("diagonal", "two_sided", "alice"))
  md = rep.to_markdown()
  assert md.splitlines()[0] == "| matrix | m x n | diagonal | two_sided | alice |"
  assert "numbers vs Adam's" in md and "**" in md
  rep.to_csv(tmp_path / "r.csv")
  lines = (tmp_path / "r.csv").read_text().splitlines()
  assert lines[0].startswith("matrix,m,n,structure,relative_error") and len(lines) == 1 + 3 * 2
  rep.heatmap(tmp_path / "r.png")
  assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_report_needs_two_batches_and_finite_gradients():
  params, loss_fn, batches = _model()
  with pytest.raises(ValueError, match="at least two batches"):
    fr.fisher_report(loss_fn, params, batches[:1], rank=2)
  bad = [(x * np.nan, y) for x, y in batches]
  with pytest.raises(ValueError, match="w1.*non-finite|non-finite"):
    fr.fisher_report(loss_fn, params, bad, rank=2)


@pytest.mark.slow
def test_llama_fim_report_example(tmp_path):
  """examples/llama/fim_report.py, shortened: trains the tiny LLaMA 2 steps and reports at
  steps 0 and 2 for every routed matrix (28 per step), with a summary."""
  from examples.llama import fim_report
  reports = fim_report.main(["--preset", "tiny", "--at-steps", "0,2", "--samples", "3",
                             "--out", str(tmp_path)])
  assert sorted(reports) == [0, 2]
  assert len(reports[2].matrices) == 29  # 4 layers x 7 matrices + the output layer
  for t in (0, 2):
    assert (tmp_path / f"step_{t}.png").exists() and (tmp_path / f"step_{t}.csv").exists()
  assert "Lowest-error structure per matrix" in (tmp_path / "summary.md").read_text()


@pytest.mark.example
def test_llama_fim_report_example_with_chosen_structures(tmp_path):
  """``--structures`` limits the report (the iterative ones dominate on wide layers)."""
  from examples.llama import fim_report
  reports = fim_report.main(["--preset", "tiny", "--at-steps", "0", "--samples", "3",
                             "--structures", "diagonal,two_sided,soap", "--out", str(tmp_path)])
  rep = reports[0]
  assert rep.structures == ("diagonal", "two_sided", "soap")
  assert len(rep.rows) == 3 * 29
  assert "| step | group | diagonal | two_sided | soap |" in (tmp_path / "summary.md").read_text()
