"""Sphinx configuration of the fisher_optax documentation (optax's setup: autodoc +
autosummary, napoleon for the Google-style docstrings, doctest, MyST-NB executing the
notebooks). Build with ``python docs/build.py``: warnings are errors."""

import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import fisher_optax as fo  # noqa: E402

project = "fisher_optax"
author = "fisher_optax developers"
copyright = "2026, fisher_optax developers"
release = version = fo.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    # MathJax from the package instead of a CDN, so that the maths renders offline
    "sphinx-mathjax-offline",
    "myst_nb",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
templates_path = ["_templates"]
html_theme = "furo"
html_title = f"fisher_optax {release}"

autosummary_generate = ["api.rst"]
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 900
nb_merge_streams = True

# A reference to a fisher_optax object that does not resolve is an error; references to
# other packages' objects (no network here for intersphinx) are not checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(optax|jax|jnp|np|numpy|flax|nnx|chex|typing|collections|abc|builtins)\b.*"),
    (r"py:.*", r"(Any|Callable|Optional|Sequence|Union|NamedTuple|ArrayTree|Array|PyTree|"
               r"dtype|Axes|DimsSpec|ScalarOrSchedule|GradientTransformation\w*|Params|"
               r"Updates|OptState|Schedule|Mesh|Sharding|PartitionSpec|NamedSharding|"
               r"float|int|str|bool|tuple|dict|list|None|callable|optional|self)"),
    # private helpers named in signatures (the low-rank blocks' bound-chain type)
    (r"py:class", r"(_\w+|fisher_optax\.blocks\.subspace\.SubspaceSource)"),
]

# The notebooks live in notebooks/ (executed by the test suite too); the site executes
# copies of them, and shows the changelog from the repository's root.
_GENERATED = DOCS / "_generated"
_GENERATED.mkdir(exist_ok=True)
for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
  shutil.copy(nb, _GENERATED / nb.name)


def _check_public_api_is_documented():
  """Every name in ``fisher_optax.__all__`` has a docstring of its own and a page: an
  ``autosummary`` entry of api.rst or an ``autofunction`` on a page of its own."""
  pages = "\n".join(p.read_text() for p in list(DOCS.rglob("*.md")) + list(DOCS.rglob("*.rst"))
                    if "_build" not in p.parts and "generated" not in p.parts)
  listed = set(re.findall(r"^   (\w+)\s*$", _section(pages), re.M))
  listed |= set(re.findall(r"autofunction:: (\w+)", pages))
  problems = []
  for name in fo.__all__:
    obj = getattr(fo, name)
    doc = getattr(obj, "__doc__", None) or ""
    own = doc and not re.match(rf"{name}\(.*\)$", doc.strip())  # NamedTuple's default
    if not own:
      problems.append(f"{name}: no docstring")
    if name not in listed:
      problems.append(f"{name}: not on any page (add it to docs/api.rst)")
  if problems:
    raise RuntimeError("undocumented public API:\n  " + "\n  ".join(problems))


def _section(text):
  """The entries of every ``.. autosummary::`` directive in ``text``."""
  return "\n".join(m.group(1) for m in
                   re.finditer(r"\.\. autosummary::\n(?:   :.*\n)*\n((?:   \w+\n)+)", text))


_check_public_api_is_documented()


# Signatures: optax's type aliases by name. Sphinx expands ``optax.ScalarOrSchedule``
# into the union it stands for (``float | Array | Callable[[Array | ndarray | ...``);
# the recorded annotations are rewritten before they become the parameter lists.
def _alias_names():
  import optax
  from sphinx.util.typing import stringify_annotation
  return {stringify_annotation(getattr(optax, n), mode): f"optax.{n}"
          for n in ("ScalarOrSchedule", "Schedule") for mode in ("fully-qualified", "smart")}


_ALIASES = _alias_names()


def _name_type_aliases(app, domain, objtype, contentnode):
  del domain, objtype, contentnode
  for annotations in app.env.current_document.autodoc_annotations.values():
    for key, text in annotations.items():
      for long, short in _ALIASES.items():
        text = text.replace(long, short)
      annotations[key] = text


def setup(app):
  # before autodoc's own handler (priority 500) merges the annotations into the page
  app.connect("object-description-transform", _name_type_aliases, priority=400)
