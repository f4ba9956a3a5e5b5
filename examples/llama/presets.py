"""Model presets (paper Table "Model architectures") and per-preset optimizer settings
(paper App. tables for Adam, RACS, Alice, GaLore/Fira; APOLLO's release scripts).

The 1B row uses hidden 2048, 24 layers, 32 heads, intermediate 5461: the paper's row
(4096/32/24) contradicts its own parameter count. ``tiny`` and ``small`` are sized for a
2-core CPU. Rotation-family learning rates (not in the paper) are ours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import fisher_optax as fo
from fisher_optax.fisher import fisher_report, structure_choice
from examples.llama.model import LlamaConfig

MODELS = {
    "tiny": dict(hidden=128, intermediate=344, heads=4, layers=4, context=128, vocab_size=2048),
    "small": dict(hidden=256, intermediate=688, heads=4, layers=4, context=256, vocab_size=8192),
    "60M": dict(hidden=512, intermediate=1376, heads=8, layers=8, context=256, vocab_size=32000),
    "130M": dict(hidden=768, intermediate=2048, heads=12, layers=12, context=256,
                 vocab_size=32000),
    "350M": dict(hidden=1024, intermediate=2736, heads=16, layers=24, context=256,
                 vocab_size=32000),
    "1B": dict(hidden=2048, intermediate=5461, heads=32, layers=24, context=256, vocab_size=32000),
}

# Low-rank settings per preset: (rank, leading, interval). Paper: 60M r=128, 130M/350M r=256,
# 1B r=512 with l=160; interval 200. tiny/small scale the rank to the width.
LOW_RANK = {"tiny": (32, 10, 100), "small": (64, 20, 200), "60M": (128, 40, 200),
            "130M": (256, 40, 200), "350M": (256, 40, 200), "1B": (512, 160, 200)}

# The paper trains the output layer with Adam for RACS, APOLLO and Adam (its "Ppl*"),
# and with the structured optimizer for Alice, GaLore and Fira ("Ppl").
LM_HEAD_ON_ADAM = {"adam", "adamw", "muon", "fo_muon", "swan", "racs", "apollo", "apollo_mini",
                   "normuon", "racs_muon", "muon_racs", "dion", "dion16"}

# Largest side the rotation methods (eigen_adam, soap, shampoo) rotate here. Their reference
# default (10000) never rotates the vocabulary side of the 32k-50k vocabularies SOAP was
# tuned on; with the `small` preset's 8192-token vocabulary it would, at 2 x 8192^2 floats
# of state (537 MB, 11x Adam's whole state) and an 8192 x 8192 eigh per refresh (~3 min
# on a 2-core CPU). 4096 leaves `tiny` (vocabulary 2048) unchanged and gives `small` the
# behaviour of the larger presets: the output layer rotated on its model-width side only.
MAX_PRECOND_DIM = 4096

OPTIMIZERS = ("adam", "adamw", "muon", "fo_muon", "swan", "racs", "alice", "alice0",
              "alice_soap", "galore",
              "fira", "apollo", "apollo_mini", "eigen_adam", "soap", "shampoo", "per_layer",
              "normuon", "racs_muon", "muon_racs", "dion", "dion16")

# Structured whitening: RACS's two-sided scaling composed with Muon's whitening, before it
# (``racs_muon``: equilibrate the momentum, then whiten) or after it (``muon_racs``:
# NorMuon's idea on both sides), each with NorMuon's RMS convention. Compositions of
# public blocks, benchmarked here before either becomes a named optimizer.
def whitening_composition(name: str, learning_rate, *, beta: float = 0.95,
                          scale_beta: float = 0.9) -> optax.GradientTransformation:
  """The structured part (matrices) of ``racs_muon`` or ``muon_racs``."""
  two_sided = fo.scale_by_two_sided(beta=scale_beta)
  order = ([two_sided, fo.whiten()] if name == "racs_muon" else [fo.whiten(), two_sided])
  return optax.chain(fo.scale_by_momentum(beta), *order, fo.scale_to_rms(0.2),
                     optax.scale_by_learning_rate(learning_rate))

# ``per_layer``: the structure of each matrix chosen from a Fisher report under a memory
# budget (``fisher_optax.fisher.structure_choice``), each structure trained by its named
# optimizer at that optimizer's tuned learning rate (the convergence harness's sweep on
# the preset) times one common factor, the ``learning_rate`` given (swept like any
# other optimizer's, around 1). Leaves outside the report (embeddings, norms) get AdamW.
PER_LAYER_OPTIMIZERS = {"diagonal": "adamw", "two_sided": "racs", "alice": "alice",
                        "alice_no_comp": "alice0", "soap": "soap"}
PER_LAYER_LR = {
    "tiny": {"adamw": 2e-3, "racs": 0.04, "alice": 0.02, "alice0": 0.02, "soap": 6e-3},
    "small": {"adamw": 4e-3, "racs": 0.02, "alice": 0.01, "alice0": 0.01, "soap": 6e-3},
}


def model_config(preset: str, vocab_size: int | None = None, **overrides) -> LlamaConfig:
  kw = dict(MODELS[preset])
  if vocab_size is not None:
    kw["vocab_size"] = vocab_size
  kw.update(overrides)
  return LlamaConfig(**kw)


def default_lr(preset: str, name: str) -> float:
  big = preset == "1B"
  return {"adam": 7e-4 if big else 1e-3, "adamw": 7e-4 if big else 1e-3,
          "muon": 7e-4 if big else 1e-3, "fo_muon": 7e-4 if big else 1e-3,
          "swan": 7e-4 if big else 1e-3, "racs": 0.02,
          "normuon": 2e-3, "racs_muon": 2e-3, "muon_racs": 2e-3, "dion": 0.01, "dion16": 0.01,
          "alice": 0.02, "alice0": 0.02, "alice_soap": 0.02, "galore": 0.01 if big else 0.02,
          "fira": 0.01 if big else 0.02, "apollo": 0.01, "apollo_mini": 0.01,
          "eigen_adam": 3e-3, "soap": 3e-3, "shampoo": 0.03, "per_layer": 1.0}[name]


def _matrices(params):
  """Weight-decay mask of AdamW and Muon: every leaf with two or more dims."""
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(name: str, preset: str, learning_rate, *, lm_head_on_adam: bool | None = None,
                   params=None, on_unmatched: str = "raise",
                   **hparams) -> optax.GradientTransformation:
  """The paper's optimizer ``name`` for ``preset``; embeddings always go to Adam.

  ``hparams`` override the named optimizer's keywords (e.g. ``b2``, ``weight_decay``);
  ``adamw`` defaults to ``weight_decay=0.01`` on matrices. ``muon`` is
  ``optax.contrib.muon`` with ``consistent_rms=0.2`` (its matrix updates get AdamW's RMS,
  so one learning rate serves its matrices and its own Adam for the other leaves) and the
  embeddings and output layer on that Adam, as Muon is used in practice. ``fo_muon`` is
  ``fisher_optax.muon`` (the same Muon, composed of fisher_optax blocks) and ``swan``
  ``fisher_optax.swan``, both with ``consistent_rms=0.2`` and the same routing.
  """
  if name not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")
  if name == "per_layer":
    return per_layer_optimizer(preset, learning_rate, params, **hparams)
  if name == "adam":
    return optax.adam(learning_rate, **hparams)
  if name == "adamw":
    kw = dict(weight_decay=0.01, mask=_matrices)
    kw.update(hparams)
    return optax.adamw(learning_rate, **kw)
  if lm_head_on_adam is None:
    lm_head_on_adam = name in LM_HEAD_ON_ADAM
  exclude = ["embed"] + (["lm_head"] if lm_head_on_adam else [])
  mask = fo.path_mask(exclude=exclude, on_unmatched=on_unmatched)
  if name == "muon":
    # optax.contrib.muon also evaluates this on its own partition (embeddings and output
    # layer absent there), so unmatched patterns must not raise inside it
    sub_mask = fo.path_mask(exclude=exclude, on_unmatched="ignore")

    def dim_numbers(params):
      sel = sub_mask.resolve(params)
      return jax.tree.map(lambda s: optax.contrib.MuonDimensionNumbers() if s else None, sel)
    kw = dict(consistent_rms=0.2, muon_weight_dimension_numbers=dim_numbers)
    kw.update(hparams)
    return optax.contrib.muon(learning_rate, **kw)
  big = preset == "1B"
  r, l, k = LOW_RANK[preset]
  if name == "racs":
    kw = dict(alpha=0.02 if big else 0.05)
  elif name in ("alice", "alice0", "alice_soap"):
    kw = dict(rank=r, leading=l, interval=k, alpha=0.25 if big else 0.3,
              alpha_c=0.2 if big else 0.4)
  elif name in ("galore", "fira"):
    kw = dict(rank=r, interval=k, scale=0.25 if big else 0.3)
  elif name == "apollo":
    kw = dict(rank=r, interval=k)
  elif name == "apollo_mini":
    kw = dict(interval=k)
  elif name == "eigen_adam":
    kw = dict(interval=10, max_precond_dim=MAX_PRECOND_DIM)
  elif name == "soap":
    kw = dict(max_precond_dim=MAX_PRECOND_DIM)
  elif name in ("racs_muon", "muon_racs"):
    from fisher_optax import routing
    structured = whitening_composition(name, learning_rate, **hparams)
    return routing.route(structured, mask=mask, dims=None,
                         fallback=routing.in_float32(optax.adam(learning_rate)),
                         info=dict(name=name))
  elif name == "normuon":
    kw = {}
  elif name in ("dion", "dion16"):  # rank 1/4 or 1/16 of each matrix's smaller side
    name, kw = "dion", dict(rank=0.25 if name == "dion" else 1 / 16)
  elif name in ("fo_muon", "swan"):  # Muon by composition, SWAN: AdamW-RMS updates
    name = "muon" if name == "fo_muon" else name
    kw = dict(consistent_rms=0.2)
  else:
    kw = dict(eps=1e-4, interval=10, max_precond_dim=MAX_PRECOND_DIM)
  kw.update(hparams)
  return getattr(fo, name)(learning_rate, mask=mask, **kw)


def latest_report(preset: str) -> str:
  """The preset's Fisher report CSV at its last step (``benchmarks/results``)."""
  import pathlib
  folder = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / (
      f"fim_report_{preset}")
  found = sorted(folder.glob("step_*.csv"), key=lambda p: int(p.stem.split("_")[1]))
  if not found:
    raise ValueError(f"no Fisher report under {folder}; run examples/llama/fim_report.py")
  return str(found[-1])


def per_layer_candidates(preset: str, factor) -> dict:
  """``{structure: its named optimizer}`` at the tuned learning rates times ``factor``."""
  # each sees only its own leaves inside the partition: no "embed" path there
  return {s: make_optimizer(o, preset, _per_layer_lr(preset, o, factor), lm_head_on_adam=False,
                            on_unmatched="ignore") for s, o in PER_LAYER_OPTIMIZERS.items()}


def per_layer_optimizer(preset: str, factor, params, *, report: str | None = None,
                        budget: float = 1.0, lm_head_on_adam: bool | None = None,
                        ) -> optax.GradientTransformation:
  """``per_layer``: see ``PER_LAYER_OPTIMIZERS``. ``report`` is a CSV written by
  ``examples/llama/fim_report.py`` (default: :func:`latest_report`); ``budget`` a
  fraction of Adam's state over the reported matrices. ``factor`` (a number or schedule)
  multiplies every learning rate; ``params`` (abstract arrays are enough) sizes each
  optimizer's state. Leaves outside the report train with AdamW."""
  if params is None:
    raise ValueError("per_layer needs params= to measure each optimizer's state")
  del lm_head_on_adam  # the report decides the output layer's structure
  optimizers = per_layer_candidates(preset, factor)
  choice = structure_choice.choose_structures(
      fisher_report.FisherReport.from_csv(report or latest_report(preset)), optimizers,
      params, budget=budget)
  fallback = make_optimizer("adamw", preset, _per_layer_lr(preset, "adamw", factor))
  return structure_choice.per_layer(choice, optimizers, fallback=fallback)


def _per_layer_lr(preset: str, name: str, factor):
  """``name``'s tuned learning rate on ``preset`` times ``factor`` (number or schedule)."""
  base = PER_LAYER_LR[preset][name]
  return (lambda step: base * factor(step)) if callable(factor) else base * factor
