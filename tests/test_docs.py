"""Named optimizers are documented as optax's aliases: every argument under Args, an
equation, a paper reference, and an example that runs (doctest)."""

import doctest
import inspect
import re

import pytest

import fisher_optax as fo
from fisher_optax import alias as optimizers
from tests.registry import NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_argument_is_documented(name):
  fn = getattr(fo, name)
  doc = inspect.getdoc(fn)
  args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
  documented = set(re.findall(r"^  (\w+):", args, re.M))
  params = set(inspect.signature(fn).parameters)
  assert params == documented, (params - documented, documented - params)
  assert ".. math::" in doc and "arXiv:" in doc and ">>> tx = fo." in doc


def test_examples_run():
  finder = doctest.DocTestFinder()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  tests = [t for t in finder.find(optimizers) if t.examples]
  assert {t.name.rsplit(".", 1)[-1] for t in tests} >= set(NAMES)
  for t in tests:
    runner.run(t)
  assert runner.summarize(verbose=False).failed == 0
