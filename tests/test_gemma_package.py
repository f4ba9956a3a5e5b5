"""The official ``gemma`` package (``pip install gemma``), where it is installed: its Linen
``gm.nn.Transformer`` routes with ``fo.linen_dims`` and no overrides. The package is not a
dependency (its tree is heavy); ``tests/test_linen_lifted.py`` runs a faithful copy of its
``Einsum`` call convention everywhere."""

import jax
import jax.numpy as jnp
import pytest

import fisher_optax as fo

gm = pytest.importorskip("gemma.gm")


def test_gemma3_transformer_routes_every_kernel_without_overrides():
  """Gemma 3 1B on abstract shapes (nothing allocated): every einsum kernel reaches the
  structured rule, the gate/up kernels as stacks of two, the embedding table the
  fallback, and no parameter is unclassified."""
  model = gm.nn.Gemma3_1B(text_only=True)
  tokens = jnp.ones((1, 8), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
  rule = fo.linen_dims(model, tokens)
  desc = fo.describe(fo.muon(1e-2, dims=rule), params)
  assert desc.unclassified == ()
  rows = {r.path: r for r in desc.rows}
  tables = [p for p in rows if p.endswith("input_embedding")]
  # einsum weights are "w", or named after their einsum under a shared scope (the MLP's
  # "gating_einsum" and "linear")
  kernels = [p for p, r in rows.items() if len(r.shape) >= 2 and p not in tables]
  assert kernels and all(rows[p].rule == "muon" for p in kernels), kernels
  gating = [p for p in kernels if "gating_einsum" in p]
  assert gating and all(rows[p].view.startswith("2 x ") for p in gating)
  assert tables and all(rows[p].view == "embedding" for p in tables)
