"""The library on Flax NNX models it did not write, used as a new user writes it:
``optax.inject_hyperparams`` with ``fo.flax_dims``, ``fo.describe`` through the usual
optax wrappers, defaults at small ranks, dims that do not fit, the README's example on a
model without embeddings, and flax as an optional extra."""

import inspect
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fisher_optax as fo
from tests import registry

ALL = registry.NAMES

ROOT = pathlib.Path(__file__).resolve().parents[1]


class SmallCNN(nnx.Module):
  """Conv + LayerNorm + MLP on 8 x 8 images: no embeddings, no output layer name."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.hidden = nnx.Linear(8 * 8 * 8, 32, rngs=rngs)
    self.out = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm(self.conv(x)))
    return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def _model():
  return SmallCNN(nnx.Rngs(0))


def _grads(params, t):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(t), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, jnp.shape(x)) for k, x in
                                   zip(keys, leaves)])


def _static_in_docstring(fn):
  """The arguments a named optimizer's docstring marks static (``...; static.``)."""
  args = inspect.getdoc(fn).split("Args:", 1)[1].split("Returns:", 1)[0]
  entries = re.split(r"\n  (?=\w+:)", "\n" + args)
  return tuple(e.split(":", 1)[0].strip() for e in entries
               if re.search(r"\bstatic\b", e.split(":", 1)[-1]))


# -------------------------------------------------------- 1. inject_hyperparams + dims


@pytest.mark.parametrize("name", registry.params(default=["apollo"]))
def test_plain_inject_hyperparams_with_flax_dims_and_path_mask(name):
  """``optax.inject_hyperparams(fo.X, static_args=<the docstring's>)(..., dims=
  fo.flax_dims(model), mask=fo.path_mask(...))`` gives the same updates as ``fo.X``."""
  model = _model()
  params = nnx.state(model, nnx.Param)
  fn = getattr(fo, name)
  kw = registry.kwargs(name, dims=None)
  kw.update(dims=fo.flax_dims(model), mask=fo.path_mask(exclude=["out"]))
  # decays exact in float32, so that a traced decay and a Python one round alike (SOAP's
  # and Eigen-Adam's first rotated steps amplify a one-ulp difference in 1 - b)
  exact = dict(b1=0.875, b2=0.9375, b3=0.998046875, beta=0.875)
  kw.update({k: v for k, v in exact.items() if k in inspect.signature(fn).parameters})
  static = _static_in_docstring(fn)
  injected = optax.inject_hyperparams(fn, static_args=static)(0.01, **kw)
  plain = fn(0.01, **kw)
  s_inj, s_plain = injected.init(params), plain.init(params)
  step_inj, step_plain = jax.jit(injected.update), jax.jit(plain.update)
  for t in range(3):
    g = _grads(params, t)
    u_inj, s_inj = step_inj(g, s_inj, params)
    u_plain, s_plain = step_plain(g, s_plain, params)
  for a, b in zip(jax.tree.leaves(u_inj), jax.tree.leaves(u_plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-4 * float(np.abs(np.asarray(b)).max()))
  assert float(jnp.abs(u_inj["conv"]["kernel"][...]).sum()) > 0


def test_static_args_attribute_covers_the_docstring():
  for name in ALL:
    fn = getattr(fo, name)
    assert set(_static_in_docstring(fn)) <= set(getattr(fn, "static_args", ())), name


def test_fo_inject_hyperparams_keeps_a_callable_mask_static():
  """A user's own mask function is a rule, not a schedule, for fo.inject_hyperparams."""
  params = {"w": jnp.ones((6, 10)), "v": jnp.ones((6, 10))}
  mask = lambda p: {"w": True, "v": False}  # noqa: E731
  tx = fo.inject_hyperparams(fo.racs)(0.01, mask=mask)
  desc = fo.describe(tx, params)
  assert [r.rule for r in desc.rows] == ["fallback", "racs"]  # sorted paths: v, w


def test_rules_are_not_python_callables():
  model = _model()
  assert not callable(fo.flax_dims(model)) and not callable(fo.path_mask(exclude=["x"]))
  assert isinstance(fo.flax_dims(model), fo.DimsRule)


# ------------------------------------------------------------ 2. describe through wrappers


def _wrapped(inner_factory):
  label = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda k, _: "fo" if "hidden" in fo.matrices.path_to_str(k) else "sgd", p)
  return {
      "chain": optax.chain(optax.clip_by_global_norm(1.0), inner_factory()),
      "inject": optax.inject_hyperparams(fo.alice, static_args=("rank", "leading"))(
          0.02, rank=4, dims=fo.flax_dims(_model())),
      "multisteps": optax.MultiSteps(inner_factory(), 4),
      "apply_if_finite": optax.apply_if_finite(inner_factory(), 3),
      "partition": optax.partition({"fo": inner_factory(), "sgd": optax.sgd(0.1)}, label),
      "multi_transform": optax.multi_transform({"fo": inner_factory(), "sgd": optax.sgd(0.1)},
                                               label),
      "masked": optax.masked(inner_factory(), lambda p: jax.tree.map(
          lambda lab: lab == "fo", label(p))),
  }


@pytest.mark.parametrize("wrapper", ["chain", "inject", "multisteps", "apply_if_finite",
                                     "partition", "multi_transform", "masked"])
def test_describe_sees_through_optax_wrappers(wrapper):
  model = _model()
  params = nnx.state(model, nnx.Param)
  tx = _wrapped(lambda: fo.alice(0.02, rank=4, dims=fo.flax_dims(model)))[wrapper]
  rules = {r.path: r.rule for r in fo.describe(tx, params).rows}
  assert rules["hidden/kernel"] == "alice"
  if wrapper in ("partition", "multi_transform", "masked"):
    assert rules["conv/kernel"] == "other" and rules["hidden/bias"] == "fallback"
  else:
    assert rules["conv/kernel"] == "alice" and rules["norm/scale"] == "fallback"
  assert "rules unknown" not in fo.describe(tx, params).note


def test_describe_says_plainly_when_no_named_optimizer_is_inside():
  params = {"w": jnp.ones((6, 10))}
  desc = fo.describe(optax.chain(optax.clip(1.0), optax.adam(1e-3)), params)
  assert "no fisher_optax named optimizer" in desc.note
  assert desc.state_numbers == 120


def test_describe_marks_leaves_whose_state_exceeds_adams():
  """Alice at rank 4 on a 6 x 4 matrix: mr + r^2 + 2nr + n + 1 = 16 + 16 + 48 + 6 + 1
  = 87 numbers against Adam's 48; on 64 x 256 it is far below."""
  params = {"small": jnp.ones((6, 4)), "big": jnp.ones((64, 256))}
  desc = fo.describe(fo.alice(0.01, rank=4), params)
  rows = {r.path: r for r in desc.rows}
  assert rows["small"].state_numbers == 87 and rows["small"].above_adam
  assert not rows["big"].above_adam
  assert desc.above_adam == ("small",)
  assert "87 !" in str(desc) and "above Adam's" in str(desc)


# ------------------------------------------------------------------- 3. leading default


@pytest.mark.parametrize("rank,leading", [(256, 40), (128, 20), (64, 10), (8, 1), (2, 1),
                                          (1, 1), (512, 80)])
def test_default_leading_scales_with_rank(rank, leading):
  assert fo.default_leading(rank) == leading


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in ("alice", "alice_soap")]
                         + ["alice0"])
def test_small_rank_without_leading_builds_and_keeps_the_rule(name):
  fn = getattr(fo, name)
  tx = fn(0.02, rank=8)
  params = {"w": jnp.ones((16, 32))}
  u, _ = jax.jit(tx.update)(_grads(params, 0), tx.init(params), params)
  assert float(jnp.abs(u["w"]).sum()) > 0
  # the default equals the explicit rule
  ref = fn(0.02, rank=8, leading=fo.default_leading(8))
  ref_u, _ = jax.jit(ref.update)(_grads(params, 0), ref.init(params), params)
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(ref_u["w"]))
  with pytest.raises(ValueError, match="leading"):
    fn(0.02, rank=8, leading=9).init(params)


# ---------------------------------------------------------------------- 4. dims that misfit


def test_matrix_dims_for_a_vector_leaf_raise_naming_it():
  params = {"b": jnp.ones(4), "w": jnp.ones((3, 4))}
  with pytest.raises(ValueError, match="'b' of shape \\(4,\\)"):
    fo.racs(0.1, dims={"b": fo.MatrixDims(), "w": fo.MatrixDims()}).init(params)
  # None or NOT_A_MATRIX for the vector, and one MatrixDims for all, are fine
  for dims in ({"b": None, "w": fo.MatrixDims()}, {"b": fo.NOT_A_MATRIX, "w": fo.MatrixDims()},
               fo.MatrixDims()):
    rules = [r.rule for r in fo.describe(fo.racs(0.1, dims=dims), params).rows]
    assert rules == ["fallback", "racs"]


def test_a_dims_function_giving_a_vector_matrix_dims_raises():
  params = {"b": jnp.ones(4), "w": jnp.ones((3, 4))}
  with pytest.raises(ValueError, match="'b'"):
    fo.alice(0.1, rank=2, dims=lambda p: jax.tree.map(lambda _: fo.MatrixDims(), p)).init(
        params)


# ------------------------------------------------------------ 5. the README's usage example


def _readme_usage_block():
  text = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  usage = [b for b in blocks if "tx.init(params)" in b and "tx.update(" in b]
  assert usage, "README has no usage example with tx.init / tx.update"
  return usage[0]


@pytest.mark.parametrize("with_embeddings", [pytest.param(False, marks=pytest.mark.slow), True])
def test_readme_usage_example_runs_on_any_model(with_embeddings):
  model = _model()
  params = nnx.state(model, nnx.Param).to_pure_dict()
  if with_embeddings:
    params = dict(params, embed={"embedding": jnp.ones((50, 16))},
                  lm_head={"kernel": jnp.ones((16, 50))})
  grads = _grads(params, 0)
  scope = {"params": params, "grads": grads, "model": model}
  exec(compile(_readme_usage_block(), "README.md", "exec"), scope)
  # the example's schedule warms up from 0: take a second step with its tx and state
  tx, state = scope["tx"], scope["state"]
  updates, _ = tx.update(grads, state, scope["params"])
  new = optax.apply_updates(scope["params"], updates)
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new)
  assert all(jax.tree.leaves(changed))
  if with_embeddings:
    rules = {r.path: r.rule for r in fo.describe(scope["tx"], params).rows}
    assert rules["embed/embedding"] == "fallback" and rules["lm_head/kernel"] == "fallback"
    assert rules["hidden/kernel"] != "fallback"


# --------------------------------------------------------------- 6. flax as an extra


def test_flax_dims_without_flax_names_the_extra():
  code = ("import sys; sys.modules['flax'] = None\n"
          "import fisher_optax as fo\n"
          "try:\n  fo.flax_dims(object())\nexcept ImportError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, check=True).stdout
  assert "fisher-optax[flax]" in out


def test_pyproject_has_a_flax_extra():
  text = (ROOT / "pyproject.toml").read_text()
  extra = re.search(r"^flax = \[(.*?)\]", text, re.S | re.M)
  assert extra and "flax" in extra.group(1)


# ----------------------------------------------------------- the NNX vision example


@pytest.mark.example
def test_vision_example_short_run():
  """examples/vision/digits.py, shortened: every optimizer trains through nnx.Optimizer,
  learns (test accuracy far above chance, 0.1) and reports a step time."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("digits", ROOT / "examples/vision/digits.py")
  digits = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(digits)
  results = digits.main(["--steps", "40", "--lrs", "1e-2", "--seeds", "0"])
  assert set(results) == {"adamw", "racs", "alice", "soap"}
  for name, r in results.items():
    assert r["test_mean"] > 0.5, (name, r)
    assert r["step_ms"] > 0 and r["lr"] == 1e-2


def test_describe_labels_leaves_of_a_plain_optax_optimizer_other():
  """No fisher_optax named optimizer inside ``tx``: every leaf's rule is ``"other"``, as
  the docstring says, and the note says the rules are unknown."""
  desc = fo.describe(optax.adam(1e-3), {"w": jnp.ones((4, 8)), "b": jnp.ones((8,))})
  assert [r.rule for r in desc.rows] == ["other", "other"]
  assert "rules unknown" in desc.note
