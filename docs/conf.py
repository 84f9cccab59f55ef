"""Sphinx configuration of posenc's reference site (``make docs``: html into build/docs, warnings
as errors). Pages are Markdown (MyST); the Python reference is autodoc from the docstrings; the
C++ reference comes from the public headers' own comments (``_ext/cppheaders.py``); the pictures
are drawn at build time from the library itself by ``figures.py`` into ``_generated/``."""

import importlib.util
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(DOCS / "_ext"))

project = "posenc"
author = "the posenc authors"
copyright = "the posenc authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "cppheaders",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/*.md", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The C++ headers the cpp-header directive reads (paths in the directive are relative to it).
cpp_headers_root = str(ROOT / "csrc" / "include")

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Docstrings name torch types that Sphinx cannot cross-reference here (no intersphinx:
# the build runs offline); a reference it cannot resolve is left as text, not a warning.
nitpicky = False

html_theme = "furo"
html_title = "posenc"
html_static_path = []
pygments_style = "sphinx"
pygments_dark_style = "monokai"


def _generate_figures(app) -> None:
    """Draw the pictures into docs/_generated (figures.py, from the library itself)."""
    figures = DOCS / "figures.py"
    spec = importlib.util.spec_from_file_location("posenc_docs_figures", figures)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out_dir = DOCS / "_generated"
    out_dir.mkdir(exist_ok=True)
    module.generate(out_dir)


def setup(app):
    app.connect("builder-inited", _generate_figures)
    return {"parallel_read_safe": True}
