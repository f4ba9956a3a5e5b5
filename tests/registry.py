"""The optimizers under test, in one place (as optax contrib's ``_common_test.py``).

Every test that runs across optimizers reads this module: the names, the small settings
they run with, the variants some tests need (no random draws, full-rank rotation bases, a
rank above a leaf's size, no ``dims``) and the settings of their dense float64 references
(``tests/reference.py``). A test that varies a setting on purpose (a rank against a
paper formula, a longer interval to stop mid-way, decay rates exact in float32) says so
where it does; the base settings come from here.

Heavy cross-cutting tests (several compilations per optimizer) run on a few optimizers by
default (:data:`DEFAULT_RUN`, or a test's own choice) and on all of them with ``-m slow``
(CI's slow step): :func:`params` marks the others. Every block still runs in the default
run, through one of those optimizers or in its own module's tests.
"""

import dataclasses
from typing import Any, Optional

import pytest

import fisher_optax as fo

LR = 0.01

# Leaves with more than two dims are routed only when ``dims`` says how: here, as optax's
# scanned layers, every axis but the last two is a stack of independent matrices.
STACK = fo.MatrixDims()


@dataclasses.dataclass(frozen=True)
class Case:
  """One optimizer under test.

  Attributes:
    kwargs: its small-test settings (refreshes every 2 steps), without ``dims``.
    family: the blocks it is built from.
    draws: whether its updates use random draws.
    draw_free: overrides that remove the draws (Alice-type methods draw complement
      directions only when ``leading < rank``).
    full_rank_bases: overrides under which every rotated side of the test trees is
      full-rank (SOAP's step-1 basis of a singular statistic is arbitrary in its null
      space, so its last bits depend on the reduction order).
    reference: settings of its dense float64 reference (interval 3), if it has one.
    train: all the settings, learning rate included, under which it trains the small
      Flax model of ``tests/test_flax_training.py`` (60 full-batch steps).
  """
  kwargs: dict
  family: str
  draws: bool = False
  draw_free: dict = dataclasses.field(default_factory=dict)
  full_rank_bases: dict = dataclasses.field(default_factory=dict)
  reference: Optional[dict] = None
  train: dict = dataclasses.field(default_factory=dict)


CASES = {
    "racs": Case({}, "two-sided", reference={},
                 train=dict(learning_rate=0.02, alpha=0.5, mask=fo.path_mask(exclude=["embed"]))),
    "alice": Case(dict(rank=3, leading=1, interval=2), "low-rank switching", draws=True,
                  draw_free=dict(leading=3),
                  reference=dict(rank=3, leading=1, interval=3),
                  train=dict(learning_rate=0.02, rank=8, leading=3, interval=10)),
    "alice0": Case(dict(rank=3, leading=1, interval=2), "low-rank switching", draws=True,
                   draw_free=dict(leading=3),
                   reference=dict(rank=3, leading=1, interval=3),
                   train=dict(learning_rate=0.02, rank=8, leading=3, interval=10)),
    "alice_soap": Case(dict(rank=3, leading=1, interval=2), "nested low-rank",
                       draws=True, draw_free=dict(leading=3),
                       reference=dict(rank=3, leading=1, interval=3, right_rank=2),
                       train=dict(learning_rate=0.02, rank=8, leading=3, interval=10)),
    "galore": Case(dict(rank=3, interval=2), "projection",
                   reference=dict(rank=3, interval=3),
                   train=dict(learning_rate=0.02, rank=8, interval=10, scale=1.0)),
    "fira": Case(dict(rank=3, interval=2), "projection",
                 reference=dict(rank=3, interval=3),
                 train=dict(learning_rate=0.02, rank=8, interval=10, scale=1.0)),
    # Dion draws its initial Q at random (per matrix index: other draws when stacked)
    "dion": Case(dict(rank=3), "power tracking", draws=True,
                 train=dict(learning_rate=0.02, rank=0.5)),
    "apollo": Case(dict(rank=3, interval=2), "random projection", draws=True,
                   train=dict(learning_rate=0.02, rank=8, interval=10)),
    "apollo_mini": Case(dict(interval=2), "random projection", draws=True,
                        train=dict(learning_rate=0.02, interval=10)),
    "soap": Case(dict(precondition_frequency=2), "rotation",
                 full_rank_bases=dict(max_precond_dim=16),
                 reference=dict(precondition_frequency=3), train=dict(learning_rate=1e-2)),
    "eigen_adam": Case(dict(interval=2), "rotation", reference=dict(interval=3),
                       train=dict(learning_rate=3e-3, interval=10)),
    # eps well above the float32 resolution of Shampoo's L and R, so that float32 runs in
    # different layouts (and the float64 reference) agree
    # Shampoo trains like AdaGrad: a larger learning rate
    "shampoo": Case(dict(interval=2, eps=0.1), "rotation",
                    reference=dict(interval=3, eps=0.1),
                    train=dict(learning_rate=0.1, eps=1e-4, interval=5)),
    "swan": Case({}, "whitening", train=dict(learning_rate=0.02)),
    "muon": Case({}, "whitening", train=dict(learning_rate=0.02)),
    "normuon": Case({}, "normalized whitening", reference={},
                    train=dict(learning_rate=0.05)),
}

NAMES = list(CASES)
RANDOM = [n for n, c in CASES.items() if c.draws and not c.draw_free]
WITH_REFERENCE = {n: c.reference for n, c in CASES.items() if c.reference is not None}
# The optimizers that the cross-cutting tests (every optimizer through one property) run
# in the default run: the paper's two methods, one low-rank method with a tracked basis,
# one rotation and one whitening method. The other families' own tests run there too;
# their cross-cutting cases run with ``-m slow`` (CI's slow step).
DEFAULT_RUN = ["racs", "alice", "galore", "soap", "normuon"]


def kwargs(name: str, *, dims: Any = STACK, draw_free: bool = False,
           full_rank_bases: bool = False, rank: Optional[int] = None) -> dict:
  """Keyword arguments of ``name`` under test, in one of the registry's variants.

  Args:
    dims: the ``dims`` argument (``None``: left out, the optimizer's default).
    draw_free: without random draws (an error for optimizers that always draw).
    full_rank_bases: with every rotated side of the test trees full-rank.
    rank: a ``rank`` for the optimizers that take one (e.g. above a leaf's size).
  """
  case = CASES[name]
  kw = dict(case.kwargs)
  if draw_free:
    if name in RANDOM:
      raise ValueError(f"{name} always draws at random")
    kw.update(case.draw_free)
  if full_rank_bases:
    kw.update(case.full_rank_bases)
  if rank is not None and "rank" in kw:
    kw["rank"] = rank
    if "leading" in kw:
      kw["leading"] = rank if draw_free else min(kw["leading"], rank)
  if dims is not None:
    kw["dims"] = dims
  return kw


def make(name: str, learning_rate=LR, **variant):
  """``fo.<name>(learning_rate, **kwargs(name, **variant))``; keys other than the
  variants of :func:`kwargs` override settings (e.g. ``weight_decay=0.1``)."""
  keys = ("dims", "draw_free", "full_rank_bases", "rank")
  kw = kwargs(name, **{k: v for k, v in variant.items() if k in keys})
  kw.update({k: v for k, v in variant.items() if k not in keys})
  return getattr(fo, name)(learning_rate, **kw)


def params(names=None, default=None):
  """``names`` (default: all) for ``pytest.mark.parametrize``: those in ``default``
  (:data:`DEFAULT_RUN` unless given) in the default run, the others marked ``slow``."""
  default = DEFAULT_RUN if default is None else default
  return [n if n in default else pytest.param(n, marks=pytest.mark.slow)
          for n in (NAMES if names is None else names)]
