"""The site (docs/): ``sphinx-build -W`` passes, and what it built is complete.

The build executes every tutorial from its jupytext script on the 4 ranks it starts, and a
cell that raises fails it: this is the 4-rank run of the notebooks (nbval with
``--nbval-lax`` checked the same: no cell raises, the in-cell asserts hold);
``tests/test_tutorials.py`` runs them with 3 ranks. Warnings are errors: a broken
cross-reference, a public function without a docstring.
"""

from __future__ import annotations

import html
import html.parser
import importlib
import pathlib
import re
import sys

import pytest

from tests.conftest import DOCS, DOCS_TIMEOUT, ROOT, sphinx_build

TUTORIALS = sorted(ROOT.joinpath("tutorials").glob("[0-9]*.py"))
pytestmark = [pytest.mark.timeout(DOCS_TIMEOUT), pytest.mark.slow]  # (executes every tutorial)


def public_names():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import shardlab_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return shardlab_docs


class _Page(html.parser.HTMLParser):
    """The ids, links and images of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])


def parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_every_tutorial_is_a_page_with_its_figures_and_a_binder_button(docs_site):
    assert len(TUTORIALS) >= 13
    for script in TUTORIALS:
        page = docs_site / "tutorials" / f"{script.stem}.html"
        assert page.exists(), f"no page for {script.name}"
        text = page.read_text(encoding="utf-8")
        images = parse(page).images
        figures = [s for s in images if "_images/" in s or s.startswith("data:image/png")]
        assert figures, f"{page.name}: no figure"
        for src in figures:
            if not src.startswith("data:"):
                assert (page.parent / src).resolve().exists(), f"{page.name}: {src} missing"
        assert f"urlpath=lab/tree/tutorials/{script.stem}.ipynb" in text, page.name
        assert "mybinder.org/v2/" in text
        assert "Traceback (most recent call last)" not in text, page.name


def test_the_explorers_show_their_initial_state(docs_site):
    for stem in ("04_uneven_shards", "06_halo_convolution", "13_pipeline_parallel"):
        text = (docs_site / "tutorials" / f"{stem}.html").read_text(encoding="utf-8")
        assert "shardlab-explorer" in text and "data:image/png;base64," in text, stem
        assert "application/vnd.jupyter.widget-view+json" not in text, stem  # the snapshot


def test_the_landing_page_shows_the_tour(docs_site):
    text = (docs_site / "index.html").read_text(encoding="utf-8")
    words = html.unescape(re.sub(r"<[^>]+>", "", text))  # highlighted code: one span a word
    assert "tour: 6 checks passed, 0 failed" in words
    assert "pip install torch==2.13.0 && pip install . && shardlab tour" in words
    assert len([s for s in parse(docs_site / "index.html").images if "_images/" in s]) == 3


def test_an_api_page_for_every_public_name(docs_site):
    docs = public_names()
    ids = set()
    for page in (docs_site / "api").rglob("*.html"):
        ids |= parse(page).ids
    missing = []
    for modname, names, modules in docs.public_names():
        module = importlib.import_module(modname)
        if f"module-{modname}" not in ids:
            missing.append(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            if name in names:
                target = f"{modname}.{name}"
            elif name in [m.rsplit(".", 1)[-1] for m in modules]:
                target = f"module-{obj.__name__}"
            elif name == "__version__":
                target = "shardlab.__version__"
            else:  # documented on an earlier module's page
                continue
            if target not in ids:
                missing.append(target)
    assert not missing, f"no API entry for {missing}"


def test_no_broken_internal_link(docs_site):
    pages = {p: parse(p) for p in docs_site.rglob("*.html")}
    assert len(pages) > 60
    broken = []
    for path, page in pages.items():
        for href in page.links:
            if re.match(r"^[a-z]+:", href) or href.startswith("//"):
                continue  # http(s), mailto, javascript: not ours
            target, _, fragment = href.partition("#")
            target = target.split("?")[0]
            dest = (path.parent / target).resolve() if target else path
            if dest.is_dir():
                dest = dest / "index.html"
            if not dest.exists():
                broken.append(f"{path.relative_to(docs_site)}: {href}")
            elif fragment and dest.suffix == ".html" and fragment not in pages[dest].ids:
                broken.append(f"{path.relative_to(docs_site)}: {href} (no #{fragment})")
    assert not broken, "\n".join(broken[:30])


def test_a_rebuild_with_nothing_changed_executes_nothing(docs_site):
    took, out = sphinx_build()  # not quiet: myst-nb says when it executes
    assert "Executing notebook" not in out, out[-2000:]
    assert took < 120, f"a cached rebuild took {took:.0f} s"
