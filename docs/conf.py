"""Sphinx configuration of shardlab's site (docs/).

    pip install -e ".[docs]"
    python -m sphinx -W -b html docs docs/_build/html   # then open docs/_build/html/index.html

The tutorials are executed from their jupytext scripts (tutorials/NN_name.py, through the
docs/tutorials link), each on the 4 gloo CPU ranks it starts; a cell that raises fails the
build. Outputs are cached in docs/_build/.jupyter_cache, keyed on the cells and on a hash of
shardlab's sources: a rebuild with nothing changed executes nothing.
"""

import os
import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

import shardlab  # noqa: E402

project = "shardlab"
author = "the shardlab developers"
copyright = "the shardlab developers"
release = version = shardlab.__version__

# Where the repository is published: the Binder buttons of the tutorial pages point there.
REPOSITORY = os.environ.get("SHARDLAB_REPOSITORY", "https://github.com/shardlab/shardlab")
BRANCH = os.environ.get("SHARDLAB_BRANCH", "main")

# No sphinx.ext.viewcode: its [docs] back-links take the anchor of the first page that
# documents a module, wrong for names re-exported by shardlab (shardlab.enable from patch).
extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx_design",
    "shardlab_docs",
]

exclude_patterns = [
    "_build",
    "_ext",
    "_templates",
    "conf.py",
    "**/.ipynb_checkpoints",
    "tutorials/*.ipynb",  # the paired scripts are the sources
    "tutorials/_*",
    "tutorials/images",
]
templates_path = ["_templates"]

# -- notebooks (myst-nb) ----------------------------------------------------------------
nb_custom_formats = {".py": "shardlab_docs.read_tutorial"}
nb_execution_mode = "cache"
nb_execution_cache_path = str(HERE / "_build" / ".jupyter_cache")
nb_execution_timeout = 300  # per cell
nb_execution_raise_on_error = True  # a cell that raises fails the build
nb_execution_show_tb = True
nb_merge_streams = True
# No widget JavaScript from a CDN: an explorer's display also carries a static snapshot of
# its state (text/html: its values, figure and table), shown before the widget view; a
# widget with no snapshot (tqdm's bar) shows nothing.
nb_ipywidgets_js = {}
nb_mime_priority_overrides = [("html", "text/html", 5)]
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# -- API (autodoc / autosummary) ----------------------------------------------------------
autosummary_generate = True  # the list of API pages, set by shardlab_docs at build time
autosummary_imported_members = True
autodoc_default_options = {"members": True, "undoc-members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as fields (autodoc documents the members)
napoleon_custom_sections = ["Communicates"]

# every shardlab reference must resolve; other libraries' names are not linked (no
# inventories are downloaded)
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|matplotlib|ipywidgets|IPython|transformers|natten|wrapt)(\..*)?"),
    (r"py:.*", r"(Tensor|DeviceMesh|Placement|Shard|Replicate|Partial|Figure|Module|nn\..*)"),
    (r"py:.*", r"(collections\.abc|typing|contextlib|pathlib|types|enum|dataclasses)\..*"),
    (r"py:.*", r"(Callable|Iterable|Iterator|Sequence|Mapping|Any|Self|Literal|Optional|Union)"),
    (r"py:class", r"(optional|default.*|callable|array-like|mesh|sizes)"),
    (r"py:.*", r"shardlab\..*\._\w+"),  # private bases (show-inheritance)
]

# -- HTML ------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "shardlab"
html_static_path = ["_static"]
html_css_files = ["shardlab.css"]
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": BRANCH,
    "path_to_docs": "",  # a tutorial page's path is the notebook's path in the repository
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {"binderhub_url": "https://mybinder.org", "notebook_interface": "jupyterlab"},
    "show_toc_level": 2,
}
html_last_updated_fmt = None
