"""Builds the documentation site into docs/_build/html and runs every doctest in it
(docstring examples and pages), warnings as errors: ``python docs/build.py``."""

import pathlib
import re
import subprocess
import sys

DOCS = pathlib.Path(__file__).resolve().parent


def sphinx(builder: str, *, fresh: bool = False) -> None:
  out = DOCS / "_build" / builder
  # fresh: read every page again, so that a docstring changed since the last build is
  # checked here as on a clean clone (an incremental build keeps the old doctree)
  cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder,
         *(["-E"] if fresh else []),
         "-d", str(DOCS / "_build" / "doctrees"), str(DOCS), str(out)]
  print("+", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True)


# a script, stylesheet, font or image fetched from another host: the site must work offline
_REMOTE = re.compile(r"""<(script|link|img|iframe)\b[^>]*\b(src|href)=["'](https?:)?//""", re.I)


def check_offline(html_dir: pathlib.Path) -> None:
  """Raises ``SystemExit`` naming every page that loads a resource from the network
  (links the reader follows are fine; ``<script src>``, ``<link href>`` and the like
  are not)."""
  bad = []
  for page in sorted(html_dir.rglob("*.html")):
    for m in _REMOTE.finditer(page.read_text(errors="replace")):
      bad.append(f"{page.relative_to(html_dir)}: {m.group(0)[:120]}")
  if bad:
    raise SystemExit("pages load resources from the network:\n  " + "\n  ".join(bad[:20]))
  print(f"offline: no page of {html_dir} loads a resource from the network")


if __name__ == "__main__":
  sphinx("html", fresh=True)
  check_offline(DOCS / "_build" / "html")
  sphinx("doctest")
  print(f"site: {DOCS / '_build' / 'html' / 'index.html'}")
