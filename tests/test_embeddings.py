"""Embedding tables: the model rules send them to the fallback, as the paper trains
embeddings (Adam), tied or not; ``describe`` labels them, and flags a table that reaches
the structured rule by its name when no model rule was given."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import fisher_optax as fo

V, D = 40, 16


class TiedLM(nnx.Module):
  """An embedding used again as the output layer (``attend``), and one hidden matrix."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.hidden = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.hidden(self.embed(tokens)))


class Embedder(nn.Module):
  """Gemma's convention: a module named ``Embedder`` owning ``input_embedding``."""

  @nn.compact
  def __call__(self, tokens):
    table = self.param("input_embedding", nn.initializers.normal(), (V, D))
    x = table[tokens]
    return nn.Dense(D)(x) @ table.T


def _rows(tx, params):
  return {r.path: r for r in fo.describe(tx, params).rows}


def test_a_tied_nnx_embedding_trains_on_the_fallback_and_is_labelled():
  model = TiedLM(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  rule = fo.flax_dims(model)
  assert rule.table["embed/embedding"] is fo.EMBEDDING
  tx = fo.alice(1e-2, rank=4, dims=rule)
  desc = fo.describe(tx, params)
  rows = {r.path: r for r in desc.rows}
  assert (rows["embed/embedding"].rule, rows["embed/embedding"].view) == ("fallback",
                                                                          "embedding")
  assert rows["hidden/kernel"].rule == "alice"
  assert desc.embeddings == ("embed/embedding",) and "embedding:" in desc.note
  # the update of the table is Adam's (the fallback), the paper's choice
  grads = jax.tree.map(jnp.ones_like, params)
  state = tx.init(params)
  u, _ = tx.update(grads, state, params)
  np.testing.assert_allclose(np.asarray(u["embed"]["embedding"]), -1e-2, rtol=1e-5)


def test_overrides_route_an_embedding_to_the_structured_rule():
  model = TiedLM(nnx.Rngs(0))
  rule = fo.flax_dims(model, overrides={"embed": fo.MatrixDims()})
  rows = _rows(fo.racs(1e-2, dims=rule), nnx.state(model, nnx.Param))
  assert rows["embed/embedding"].rule == "racs"


def test_an_embedder_of_another_library_is_an_embedding_too():
  module, tokens = Embedder(), jnp.zeros((2, 5), jnp.int32)
  variables = module.init(jax.random.key(0), tokens)
  rule = fo.linen_dims(module, tokens)
  assert rule.table["input_embedding"] is fo.EMBEDDING
  rows = _rows(fo.muon(1e-2, dims=rule), variables["params"])
  assert rows["input_embedding"].rule == "fallback"
  assert rows["Dense_0/kernel"].rule == "muon"


def test_without_a_model_rule_a_table_is_flagged_by_its_name():
  params = {"embed": {"embedding": jnp.zeros((V, D))}, "w": jnp.zeros((D, D))}
  desc = fo.describe(fo.racs(1e-2), params)
  rows = {r.path: r for r in desc.rows}
  assert rows["embed/embedding"].rule == "racs" and rows["embed/embedding"].view.endswith("~")
  assert not rows["w"].embedding
  assert "~ embed/embedding" in desc.note and "path_mask(exclude=['embed'])" in desc.note
  masked = fo.describe(fo.racs(1e-2, mask=fo.path_mask(exclude=["embed"])), params)
  assert "~" not in masked.note


def test_equinox_and_haiku_embeddings():
  eqx = pytest.importorskip("equinox")
  hk = pytest.importorskip("haiku")
  emb = eqx.nn.Embedding(V, D, key=jax.random.key(0))
  assert fo.equinox_dims(emb).table["weight"] is fo.EMBEDDING

  def f(tokens):
    return hk.Linear(D)(hk.Embed(V, D)(tokens))

  params = hk.transform(f).init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
  table = fo.haiku_dims(params).table
  assert table["embed/embeddings"] is fo.EMBEDDING and table["linear/w"] == fo.MatrixDims()
