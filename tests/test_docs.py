"""Named optimizers are documented as optax's aliases: every argument under Args, an
equation, a paper reference, and an example that runs (doctest)."""

import doctest
import inspect
import re

import pytest

import fisher_optax as fo
import importlib

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
  tests = [t for family in optimizers.FAMILIES
           for t in finder.find(importlib.import_module(f"fisher_optax.alias.{family}"))
           if t.examples]
  assert {t.name.rsplit(".", 1)[-1] for t in tests} >= set(NAMES)
  for t in tests:
    runner.run(t)
  assert runner.summarize(verbose=False).failed == 0


def test_the_docs_build_fails_on_a_page_that_loads_from_the_network(tmp_path):
  """``docs/build.py`` checks the built site: maths and scripts come from the site itself
  (bundled MathJax), so it renders offline; a script, stylesheet or font from another
  host fails the build. Links the reader follows are fine."""
  import importlib.util
  import pathlib
  spec = importlib.util.spec_from_file_location(
      "docs_build", pathlib.Path(__file__).resolve().parents[1] / "docs" / "build.py")
  build = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(build)
  (tmp_path / "ok.html").write_text(
      '<script defer src="_static/mathjax/tex-chtml.js"></script>'
      '<a href="https://arxiv.org/abs/2502.07752">paper</a>')
  build.check_offline(tmp_path)
  for bad in ('<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js">',
              "<link rel='stylesheet' href='//fonts.googleapis.com/css?family=Roboto'>"):
    (tmp_path / "bad.html").write_text(bad)
    with pytest.raises(SystemExit, match="bad.html"):
      build.check_offline(tmp_path)
