"""``dims=`` as optax and MaxText users hold it: a tree of
``optax.contrib.MuonDimensionNumbers`` with ``None`` for the leaves that are no matrices,
on MaxText's layouts (the layer axis at index 1, head-split attention kernels, MoE
experts)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers as MDN

import fisher_optax as fo

L = 2  # scanned layers, at index 1 as MaxText stacks them (param_scan_axis = 1)

# MaxText's shapes (embed 16, mlp 32, 4 heads of 8, 4 experts) and the dimension numbers
# its muon_utils.transform_logic gives them
MAXTEXT = {
    "token_embedder": {"embedding": ((64, 16), None)},
    "decoder": {
        "decoder_norm": {"scale": ((16,), None)},
        "layers": {
            "mlp": {"wi_0": {"kernel": ((16, L, 32), MDN((0,), (-1,)))},
                    "wo": {"kernel": ((32, L, 16), MDN((0,), (-1,)))}},
            "self_attention": {"query": {"kernel": ((16, L, 4, 8), MDN((0,), (-2, -1)))},
                               "out": {"kernel": ((4, L, 8, 16), MDN((0, -2), (-1,)))}},
            "moe": {"MoeBlock_0": {"wi_0": ((4, L, 16, 32), MDN((-2,), (-1,))),
                                   "gate": {"kernel": ((16, L, 4), MDN((0,), (-1,)))}}},
            "pre_self_attention_layer_norm": {"scale": ((16, L), None)},
        },
    },
}

# what each leaf must be read as (``describe``'s view: batch x fan-in x fan-out), or
# None: the fallback
WANT = {
    "token_embedder/embedding": None,
    "decoder/decoder_norm/scale": None,
    "decoder/layers/mlp/wi_0/kernel": f"{L} x 16 x 32",
    "decoder/layers/mlp/wo/kernel": f"{L} x 32 x 16",
    "decoder/layers/self_attention/query/kernel": f"{L} x 16 x 32",
    "decoder/layers/self_attention/out/kernel": f"{L} x 32 x 16",
    "decoder/layers/moe/MoeBlock_0/wi_0": f"4 x {L} x 16 x 32",
    "decoder/layers/moe/MoeBlock_0/gate/kernel": f"{L} x 16 x 4",
    "decoder/layers/pre_self_attention_layer_norm/scale": None,
}

_is_entry = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)  # noqa: E731


def _params():
  shapes = jax.tree.map(lambda e: e[0], MAXTEXT, is_leaf=_is_entry)
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  return jax.tree.map(lambda s: jax.random.normal(next(keys), s) * 0.1, shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def _mdn_tree():
  return jax.tree.map(lambda e: e[1], MAXTEXT, is_leaf=_is_entry)


def _matrix_dims_tree():
  """The same routing written as fo.MatrixDims by hand."""
  return jax.tree.map(lambda e: fo.NOT_A_MATRIX if e[1] is None else
                      fo.MatrixDims(rows=e[1].reduction_axis, cols=e[1].output_axis),
                      MAXTEXT, is_leaf=_is_entry)


def _views(tx, params):
  out = {}
  for row in fo.describe(tx, params).rows:
    out[row.path] = row
  return out


@pytest.mark.parametrize("name", ["muon", "alice", "racs"])
def test_muon_dimension_numbers_route_maxtext_layouts(name):
  params = _params()
  tx = getattr(fo, name)(1e-2, dims=_mdn_tree())
  rows = _views(tx, params)
  for path, want in WANT.items():
    row = rows[path]
    if want is None:
      assert row.rule == "fallback", (path, row)
    else:
      assert row.rule == name, (path, row)
      assert row.view == want, (path, row.view)


@pytest.mark.parametrize("name", ["muon", pytest.param("alice", marks=pytest.mark.slow)])
def test_muon_dimension_numbers_update_as_matrix_dims(name):
  """Same state and updates as the routing written with fo.MatrixDims, over 3 steps."""
  params = _params()
  kw = dict(rank=4, leading=4, interval=2) if name == "alice" else {}
  a = getattr(fo, name)(1e-2, dims=_mdn_tree(), **kw)
  b = getattr(fo, name)(1e-2, dims=_matrix_dims_tree(), **kw)
  sa, sb = a.init(params), b.init(params)
  step_a, step_b = jax.jit(a.update), jax.jit(b.update)
  pa = pb = params
  for t in range(3):
    g = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(t), p.shape), params)
    ua, sa = step_a(g, sa, pa)
    ub, sb = step_b(g, sb, pb)
    pa, pb = optax.apply_updates(pa, ua), optax.apply_updates(pb, ub)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), pa, pb)


def test_muon_dimension_numbers_in_other_containers_and_callables():
  """An ``nnx.State`` of them (as MaxText builds it) for dict params; a callable that
  returns them (as optax.contrib.muon takes); one for every leaf."""
  params = _params()
  want = _views(fo.muon(1e-2, dims=_matrix_dims_tree()), params)
  for dims in (nnx.State(_mdn_tree()), lambda p: _mdn_tree()):
    got = _views(fo.muon(1e-2, dims=dims), params)
    assert {k: (r.rule, r.view) for k, r in got.items()} == \
        {k: (r.rule, r.view) for k, r in want.items()}
  one = fo.muon(1e-2, dims=MDN((0,), (-1,)))
  rows = _views(one, {"w": jnp.ones((8, L, 4))})
  assert rows["w"].view == f"{L} x 8 x 4"


def test_muon_dimension_numbers_through_inject_hyperparams_and_state_specs():
  params = _params()
  tx = fo.inject_hyperparams(fo.alice)(learning_rate=1e-2, rank=4, dims=_mdn_tree())
  state = tx.init(params)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  specs = jax.tree.map(lambda e: jax.sharding.PartitionSpec(*([None] * len(e[0]))), MAXTEXT,
                       is_leaf=_is_entry)
  fo.state_partition_specs(fo.alice(1e-2, rank=4, dims=_mdn_tree()), params, specs)


def test_muon_dimension_numbers_that_do_not_fit_raise():
  with pytest.raises(ValueError, match="out of range"):
    fo.muon(1e-2, dims={"w": MDN((0,), (3,))}).init({"w": jnp.ones((4, 4))})
  with pytest.raises(ValueError, match="not a parameter"):
    fo.muon(1e-2, dims={"v": MDN()}).init({"w": jnp.ones((4, 4))})


# ---------------------------------------------------------------- fo.flax_dims on MaxText


class DenseGeneral(nnx.Module):
  """MaxText's DenseGeneral as it holds its kernel: declared ``in_features_shape`` and
  ``out_features_shape``, a kernel with logical axis names; scanned, the layer axis sits
  at index 1 (given here as the scanned model holds it)."""

  def __init__(self, in_shape, out_shape, names, layers=None, *, rngs):
    self.in_features_shape, self.out_features_shape = tuple(in_shape), tuple(out_shape)
    shape = self.in_features_shape + self.out_features_shape
    if layers is not None:
      shape = shape[:1] + (layers,) + shape[1:]
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), shape), out_sharding=names)


class MoeBlock(nnx.Module):
  def __init__(self, rngs):
    self.wi_0 = nnx.Param(jnp.zeros((4, L, 16, 32)),
                          out_sharding=("exp", "layers", "embed_moe", "mlp_moe"))


class Decoder(nnx.Module):
  def __init__(self, rngs):
    self.wi_0 = DenseGeneral((16,), (32,), ("embed", "layers", "mlp"), L, rngs=rngs)
    self.query = DenseGeneral((16,), (4, 8), ("embed", "layers", "q_heads", "kv"), L,
                              rngs=rngs)
    self.out = DenseGeneral((4, 8), (16,), ("heads", "layers", "kv", "embed"), L, rngs=rngs)
    self.plain = DenseGeneral((16,), (32,), ("embed", "mlp"), rngs=rngs)
    self.moe = MoeBlock(rngs)
    # layers of the same size as a feature axis: the names decide
    self.tied = DenseGeneral((4,), (4,), ("embed", "layers", "mlp"), 4, rngs=rngs)


def test_flax_dims_reads_maxtext_dense_general_and_logical_names():
  with nnx.use_eager_sharding(False):  # logical names, no rules to map them here
    model = Decoder(nnx.Rngs(0))
  table = fo.flax_dims(model).table
  assert table["wi_0/kernel"] == fo.MatrixDims(rows=(0,), cols=(2,))
  assert table["query/kernel"] == fo.MatrixDims(rows=(0,), cols=(2, 3))
  assert table["out/kernel"] == fo.MatrixDims(rows=(0, 2), cols=(3,))
  assert table["plain/kernel"] == fo.MatrixDims(rows=(0,), cols=(1,))
  assert table["moe/wi_0"] == fo.MatrixDims(rows=2, cols=3)
  assert table["tied/kernel"] == fo.MatrixDims(rows=(0,), cols=(2,))
  rows = {r.path: r.view for r in fo.describe(fo.muon(1e-2, dims=fo.flax_dims(model)),
                                              nnx.state(model, nnx.Param)).rows}
  assert rows["wi_0/kernel"] == f"{L} x 16 x 32"
  assert rows["out/kernel"] == f"{L} x 32 x 16"
  assert rows["moe/wi_0"] == f"4 x {L} x 16 x 32"


def test_flax_dims_without_names_cannot_tell_tied_layer_axes():
  """The same kernel with no logical names: the layer axis and a feature axis have one
  size, so the rule says it cannot tell (and why) instead of guessing."""

  class Tied(nnx.Module):
    def __init__(self):
      self.in_features_shape, self.out_features_shape = (4,), (4,)
      self.kernel = nnx.Param(jnp.zeros((4, 4, 4)))

  got = fo.flax_dims(Tied()).table["kernel"]
  assert isinstance(got, fo.Unclassified) and "several ways" in got.reason


def test_unclassified_kernels_warn_at_init_with_the_fix():
  """A kernel the rule cannot classify reaches the fallback with a warning naming it, why
  and the fix; routed by ``overrides=``, it does not warn."""

  class Odd(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((3, 4, 5)))
      self.lin = nnx.Linear(4, 5, rngs=nnx.Rngs(0))

  model = Odd()
  params = nnx.state(model, nnx.Param)
  with pytest.warns(fo.FallbackWarning, match=r"1 leaf the dims rule could not classify.*'w': "
                                       r"3-D parameter of Odd.*overrides="):
    fo.racs(1e-2, dims=fo.flax_dims(model)).init(params)
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fo.racs(1e-2, dims=fo.flax_dims(model, overrides={"^w$": fo.MatrixDims()})).init(params)


def test_fallback_warning_can_be_made_an_error():
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error", fo.FallbackWarning)
    with pytest.raises(fo.FallbackWarning, match="more than two dims"):
      fo.racs(1e-2).init({"w": jnp.ones((2, 4, 4))})


def test_a_path_mask_without_dims_still_warns_for_kernels_it_did_not_exclude():
  """The README's ``mask=fo.path_mask(exclude=[...])`` with no ``dims``: a 3-D kernel the
  patterns did not name goes to the fallback because nothing says which axes are its
  matrix, and ``init`` says so; one the patterns exclude goes there on purpose."""
  import warnings
  params = {"embed": jnp.ones((10, 4)), "attn": {"q": jnp.ones((4, 2, 8))},
            "w": jnp.ones((4, 4))}
  with pytest.warns(fo.FallbackWarning, match=r"1 leaf with more than two dims.*'attn/q'"):
    fo.racs(1e-2, mask=fo.path_mask(exclude=["embed"])).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error", fo.FallbackWarning)
    fo.racs(1e-2, mask=fo.path_mask(exclude=["embed", "attn"])).init(params)
    fo.racs(1e-2, mask=fo.path_mask(include=["^w$"])).init(params)
    fo.racs(1e-2, mask={"embed": False, "attn": {"q": False}, "w": True}).init(params)
