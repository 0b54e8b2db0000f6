"""The parts of the docs build that are shardlab's own (a local Sphinx extension).

* :func:`read_tutorial`: myst-nb's reader for the tutorials' jupytext scripts. It adds a
  hidden first cell holding a hash of the package's code (comments and docstrings left
  out), so the execution cache (keyed on the code cells) misses whenever shardlab's code
  changes, not only when the tutorial does.
* Each tutorial page depends on every source file of the package (Sphinx rereads it when
  one changes); with the hash above the site never shows outputs the code no longer makes.
* ``api/``: one page per public module, listing every name of its ``__all__`` (written
  before reading, rewritten only when it changes); autosummary makes a page per name.
* A public function, class, method or property without a docstring is a warning (an
  error under ``-W``); a short name in a docstring (``:class:`ShardLayout```) links to the
  one documented object of that name.
* The "launch on Binder" button only on tutorial pages.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import pathlib
import types

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardlab"
logger = logging.getLogger("shardlab_docs")

# module -> names documented on its page (its __all__, less what an earlier page has);
# the order is the API index's
PUBLIC_MODULES = [
    "shardlab",
    "shardlab.trace",
    "shardlab.cost",
    "shardlab.explainer.explain",
    "shardlab.viz",
    "shardlab.lm",
    "shardlab.experts",
    "shardlab.layout",
    "shardlab.patch",
    "shardlab.ops.attention",
    "shardlab.ops.conv",
    "shardlab.ops.cross_entropy",
    "shardlab.ops.neighborhood",
    "shardlab.zero",
    "shardlab.pipeline",
]


# -- tutorials -----------------------------------------------------------------
def sources() -> list[pathlib.Path]:
    """What a tutorial's outputs depend on besides its own cells."""
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tutorials").glob("_*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def _code_only(source: bytes) -> bytes:
    """The code of a module without its comments and docstrings: editing those re-executes
    nothing."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def sources_hash() -> str:
    """A hash of the code (not the comments or docstrings) of shardlab and the helpers."""
    digest = hashlib.sha256()
    for f in sources():
        code = _code_only(f.read_bytes())
        digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + code + b"\0")
    return digest.hexdigest()[:16]


def read_tutorial(text: str):
    """A jupytext percent script as a notebook, with the package's hash as a hidden cell."""
    import jupytext
    import nbformat

    nb = jupytext.reads(text, fmt="py:percent")
    cell = nbformat.v4.new_code_cell(
        f"# shardlab sources {sources_hash()}", metadata={"tags": ["remove-cell"]}
    )
    nb.cells.insert(0, cell)
    return nb


def _note_sources(app, docname, source):
    if docname.startswith("tutorials/") or docname == "index":
        for f in sources():
            app.env.note_dependency(str(f))


# -- API pages -------------------------------------------------------------------
def public_names() -> list[tuple[str, list[str], list[str]]]:
    """(module, names given a page here, modules among its names) for each public module."""
    seen: set[int] = set()
    pages = []
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        names, modules = [], []
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                modules.append(obj.__name__)
            elif name.startswith("__") or id(obj) in seen:
                continue
            else:
                seen.add(id(obj))
                names.append(name)
        pages.append((modname, names, modules))
    return pages


def _write_if_changed(path: pathlib.Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def write_api_pages(app, config) -> None:
    api = pathlib.Path(app.srcdir) / "api"
    pages = public_names()
    for modname, names, modules in pages:
        lines = [modname, "=" * len(modname), "", f".. automodule:: {modname}", "   :no-members:"]
        lines += ["", f".. currentmodule:: {modname}", ""]
        if names:
            lines += [".. autosummary::", "   :toctree: generated", "   :nosignatures:", ""]
            lines += [f"   {name}" for name in names] + [""]
        if modules:
            lines += ["Modules: " + ", ".join(f":mod:`{m}`" for m in modules) + ".", ""]
        if modname == "shardlab":
            lines += [".. data:: __version__", "", "   The package's version string.", ""]
        _write_if_changed(api / f"{modname}.rst", "\n".join(lines))
    toc = ["# API reference", "", API_INTRO, "", "```{toctree}", ":maxdepth: 1", ""]
    toc += [m for m, _, _ in pages] + ["```", ""]
    _write_if_changed(api / "index.md", "\n".join(toc))
    # autosummary writes a page per name for the files named here; left at True it reads
    # the list of sources from the environment, which a cold build (no pickled
    # environment yet) has not filled when it runs: no page would be written. Set before
    # the pickled environment's configuration is compared, so a rebuild stays cached.
    config.autosummary_generate = [f"api/{m}.rst" for m, names, _ in pages if names]


API_INTRO = """\
Every public name: the package's `__all__` and the `__all__` of each public module, one
page each, made from the docstrings. Each function says what it does, its arguments, what
it communicates (collectives and bytes) and shows a short example. Names that are not
listed here are internal and may change."""


# -- checks ----------------------------------------------------------------------
def _check_docstring(app, what, name, obj, options, lines):
    if what not in ("function", "class", "method", "property", "exception"):
        return
    if name.rsplit(".", 1)[-1].startswith("_"):
        return
    if not any(line.strip() for line in lines) and not inspect.getdoc(obj):
        logger.warning(f"{name} has no docstring (a public {what})", type="shardlab")


def _skip_inherited(app, what, name, obj, skip, options):
    """Members torch defines (a ShardTensor is a torch.Tensor) are torch's to document."""
    module = getattr(obj, "__module__", None) or ""
    if what == "class" and not skip and module and not module.startswith("shardlab"):
        return True
    return None


# -- short names in docstrings ------------------------------------------------------
def _resolve_short_name(app, env, node, contnode):
    """``:class:`ShardLayout``` in a docstring of another module: the one documented
    object whose name ends with it (ambiguous or missing: left to Sphinx's warning)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    if not target or "." in target and target.split(".")[0] in ("shardlab",):
        return None
    domain = env.get_domain("py")
    found = [  # canonical aliases (autodoc's) left out
        name
        for name, entry in domain.objects.items()
        if name.endswith("." + target) and not entry.aliased
    ]
    if len(found) != 1:
        return None
    obj = domain.objects[found[0]]
    from sphinx.util.nodes import make_refnode

    return make_refnode(app.builder, node["refdoc"], obj.docname, obj.node_id, contnode, found[0])


# -- launch button -----------------------------------------------------------------
def _launch_only_on_tutorials(app, pagename, templatename, context, doctree):
    if pagename.startswith("tutorials/"):
        return
    buttons = context.get("header_buttons")
    if buttons:
        context["header_buttons"] = [b for b in buttons if b.get("label") != "launch-buttons"]


def setup(app):
    app.connect("config-inited", write_api_pages)  # before autosummary, before the env
    app.connect("source-read", _note_sources)
    app.connect("autodoc-process-docstring", _check_docstring)
    app.connect("autodoc-skip-member", _skip_inherited)
    app.connect("missing-reference", _resolve_short_name)
    app.connect("html-page-context", _launch_only_on_tutorials, priority=900)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
