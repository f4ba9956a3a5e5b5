"""Builds the documentation site into docs/_build/html and runs every doctest in it
(docstring examples and pages), warnings as errors: ``python docs/build.py``."""

import pathlib
import subprocess
import sys

DOCS = pathlib.Path(__file__).resolve().parent


def sphinx(builder: str) -> None:
  out = DOCS / "_build" / builder
  cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder,
         "-d", str(DOCS / "_build" / "doctrees"), str(DOCS), str(out)]
  print("+", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True)


if __name__ == "__main__":
  sphinx("html")
  sphinx("doctest")
  print(f"site: {DOCS / '_build' / 'html' / 'index.html'}")
