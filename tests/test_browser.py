"""The tutorials and the site in a real browser (headless Chromium).

JupyterLab, for the notebooks with explorers and the first one (the others' outputs are
checked on the site, below): open each (Chromium driven by playwright, Debian's
``/usr/bin/chromium``, no browser download), Run All, wait until the kernel is idle, then
assert that every code cell ran (numbered prompt), no cell shows an error, every image is
drawn (natural width > 0), and in the notebooks with an explorer the widget's DOM is there
and changing a control changes its figure. A screenshot of each notebook goes to
``tutorials/images/browser/``.

The site (``docs/_build/html``, built by the ``docs_site`` fixture, served on 127.0.0.1):
every tutorial page shows its figures (drawn, non-zero size) and its Binder button and asks
nothing from another host; every public name has its API page; no internal link is broken.
Screenshots of a tutorial page and an API page go to ``docs/images/``.

Needs ``/usr/bin/chromium`` (``apt-get install chromium``) and ``pip install playwright``
(never ``playwright install``); skipped with the reason otherwise.
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time

import nbformat
import pytest

from tests._notebooks import CHROMIUM, LAB, with_world

pytestmark = pytest.mark.slow  # (runs notebooks in JupyterLab, builds the site)

ROOT = pathlib.Path(__file__).parent.parent
TUTORIALS = sorted(ROOT.joinpath("tutorials").glob("[0-9]*.ipynb"))
SHOTS = ROOT / "tutorials" / "images" / "browser"

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"no browser: {CHROMIUM} is not installed (apt-get install chromium)",
        allow_module_level=True,
    )
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

# notebook -> (a control to change, how) for the explorers
EXPLORERS = {
    "04_uneven_shards": ("text", "5,5,4,4", "9,3,3,3"),
    "06_halo_convolution": ("slider", None, None),
    "13_pipeline_parallel": ("slider", None, None),  # micro-batches: each runs on the ranks
    "14_expert_parallel": ("slider", None, None),
    "15_predict_then_measure": ("slider", None, None),  # the first: InfiniBand's bandwidth
}
# Run All in JupyterLab: the notebooks a learner plays with (the explorers) and the first
# one (%%ranks cells). Every notebook's cells and figures are checked by the docs build
# (tests/test_docs.py executes them all on 4 ranks) and on the site below (every figure
# drawn in Chromium): the same outputs, once instead of twice.
# They run there with 3 ranks (WORLD = 3 in the copy): the docs build runs them with 4, so
# each world size runs once, and tests/test_tutorials.py leaves their 3-rank rerun to this.
LAB_TUTORIALS = [p for p in TUTORIALS if p.stem in LAB]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module (Playwright's sync API runs one at a time)."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium):
    """A JupyterLab server on the tutorials folder (a copy: Run All does not dirty them)."""
    work = tmp_path_factory.mktemp("lab")
    for f in ROOT.joinpath("tutorials").iterdir():
        if f.is_file():
            shutil.copy(f, work / f.name)
    for path in LAB_TUTORIALS:  # their 3-rank run (the docs build runs them with 4)
        nbformat.write(with_world(path, 3), work / path.name)
    port, token = _free_port(), secrets.token_hex(8)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser",
         "--ip", "127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={work}", "--LabApp.news_url=",
         "--ServerApp.disable_check_xsrf=True"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work,
    )  # fmt: skip
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("JupyterLab did not start in 60 s")
    try:
        yield chromium, f"http://127.0.0.1:{port}", token
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# code cells with source whose prompt is not numbered yet (empty cells never run)
PENDING = """cells => cells.filter(c => {
    const src = c.querySelector('.cm-content');
    const prompt = c.querySelector('.jp-InputPrompt');
    return src && src.innerText.trim() && prompt && !/\\[\\d+\\]/.test(prompt.textContent);
}).length"""


def _run_all(page, timeout_s: float) -> None:
    page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
    page.get_by_text("| Idle").first.wait_for(timeout=120_000)  # the kernel is up
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt")
    for _ in range(5):  # a click before the front end is ready can be lost: retry
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator("[data-command='runmenu:run-all']").click()
        started = time.time() + 20
        while time.time() < started:
            if prompts.evaluate_all("els => els.some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))"):
                break
            time.sleep(0.5)
        else:
            continue
        break
    deadline = time.time() + timeout_s
    time.sleep(2)
    while time.time() < deadline:
        busy = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() == 0
        pending = page.locator(".jp-CodeCell").evaluate_all(PENDING)
        if not busy and pending == 0:
            return
        time.sleep(1)
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt").evaluate_all(
        "els => els.map(e => e.textContent)"
    )
    raise AssertionError(f"Run All did not finish in {timeout_s} s: prompts {prompts}")


@pytest.mark.parametrize("path", LAB_TUTORIALS, ids=[p.stem for p in LAB_TUTORIALS])
def test_tutorial_in_the_browser(lab, path):
    browser, url, token = lab
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{url}/lab/tree/{path.name}?token={token}&reset")
        _run_all(page, timeout_s=240)
        errors = page.locator(".jp-OutputArea-output").evaluate_all(
            "els => els.filter(e => /Traceback \\(most recent call last\\)|Error: /"
            ".test(e.innerText) && e.dataset.mimeType === 'application/vnd.jupyter.stderr')"
            ".map(e => e.innerText.slice(0, 400))"
        )
        assert errors == [], errors
        sizes = page.locator(".jp-OutputArea-output img").evaluate_all(
            "els => els.map(e => e.naturalWidth)"
        )
        assert sizes and all(w > 0 for w in sizes), sizes  # every figure is drawn
        if path.stem in EXPLORERS:
            _play(page, *EXPLORERS[path.stem])
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{path.stem}.png"), full_page=False)
    finally:
        page.close()


def _play(page, kind, old, new):
    """The explorer's DOM is there, and changing a control changes its figure."""
    image = page.locator("img.widget-image").last
    image.scroll_into_view_if_needed()
    before = image.get_attribute("src")
    assert before, "the explorer shows no figure"
    if kind == "text":
        boxes = page.locator(".widget-text input").all()
        target = next(b for b in boxes if b.input_value() == old)
        target.fill(new)
        target.press("Enter")
    else:
        handle = page.locator(".widget-slider .noUi-handle, .widget-slider .ui-slider-handle")
        handle.first.scroll_into_view_if_needed()
        handle.first.focus()
        handle.first.press("ArrowRight")
        handle.first.press("ArrowRight")
    deadline = time.time() + 30
    while time.time() < deadline and image.get_attribute("src") == before:
        time.sleep(0.5)
    if image.get_attribute("src") == before:  # what the explorer says (its status line)
        said = page.locator(".widget-html").evaluate_all("els => els.map(e => e.innerText)")
        raise AssertionError(f"the figure did not change; the explorer's texts: {said[-3:]}")


# -- the site (docs/_build/html, built by the docs_site fixture) --------------------------
SITE_SHOTS = ROOT / "docs" / "images"
SITE_TUTORIALS = sorted(ROOT.joinpath("tutorials").glob("[0-9]*.py"))


@pytest.fixture(scope="module")
def site(docs_site, chromium):
    """The built site on a local HTTP server, and a Chromium to look at it."""
    handler = functools.partial(_QuietHandler, directory=str(docs_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield chromium, f"http://127.0.0.1:{server.server_address[1]}", docs_site
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _external_requests(page) -> list[str]:
    seen: list[str] = []
    page.on(
        "request",
        lambda r: seen.append(r.url) if not r.url.startswith(("http://127.0.0.1", "data:")) else 0,
    )
    return seen


@pytest.mark.timeout(1800)
def test_site_tutorial_pages_show_their_figures(site):
    browser, url, _ = site
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    external = _external_requests(page)
    try:
        for script in SITE_TUTORIALS:
            response = page.goto(f"{url}/tutorials/{script.stem}.html")
            assert response.ok, script.stem
            page.wait_for_load_state("load")
            images = page.locator("article img").evaluate_all(
                "els => els.map(e => [e.getAttribute('src').slice(0, 40), e.naturalWidth,"
                " e.getBoundingClientRect().width])"
            )
            assert images, f"{script.stem}: no figure on the page"
            drawn = [[src, w, shown] for src, w, shown in images if w > 0 and shown > 0]
            assert drawn == images, f"{script.stem}: images not drawn: {images}"
            launch = page.locator("a[href*='mybinder.org']")
            assert launch.count() == 1, f"{script.stem}: no Binder button"
            assert f"tutorials/{script.stem}.ipynb" in launch.get_attribute("href")
            if script.stem == "06_halo_convolution":
                page.locator("div.cell_output img").first.scroll_into_view_if_needed()
                SITE_SHOTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SITE_SHOTS / "tutorial_page.png"))
        assert external == [], f"the pages asked for {sorted(set(external))[:5]}"
    finally:
        page.close()


@pytest.mark.timeout(1800)
def test_site_api_pages_exist_for_every_public_name(site):
    browser, url, root = site
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import shardlab_docs
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        for modname, names, modules in shardlab_docs.public_names():
            assert page.goto(f"{url}/api/{modname}.html").ok, modname
            assert page.locator(f"[id='module-{modname}']").count() == 1, modname
            for m in modules:  # a module among the names: a link to its page
                assert page.locator(f"a[href$='{m}.html#module-{m}']").count() >= 1, m
            for i, name in enumerate(names):
                full = f"{modname}.{name}"
                text = (root / "api" / "generated" / f"{full}.html").read_text(encoding="utf-8")
                assert f'id="{full}"' in text, f"no entry for {full}"  # every name: the HTML
                if i and full != "shardlab.ShardTensor":
                    continue  # the browser: the first of each module's names, and ShardTensor
                assert page.goto(f"{url}/api/generated/{full}.html").ok, full
                entry = page.locator(f"dt[id='{full}']")
                assert entry.count() == 1, f"no entry for {full}"
                assert entry.is_visible(), full
                if full == "shardlab.ShardTensor":
                    SITE_SHOTS.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(SITE_SHOTS / "api_page.png"))
    finally:
        page.close()


def test_site_has_no_broken_internal_link(docs_site):
    """Every link of every page of the built site, resolved as a browser resolves it
    (``urljoin`` against the page's URL): the target page exists and holds the fragment's
    id. Read from the HTML sphinx wrote (no browser: loading ~150 pages in Chromium took
    half a minute of CI; the theme's script adds no link of ours)."""
    import html.parser
    import urllib.parse

    class Page(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids, self.hrefs = set(), set()

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if attrs.get("id"):
                self.ids.add(attrs["id"])
            if tag == "a" and attrs.get("href"):
                self.hrefs.add(attrs["href"])

    base = "http://site.invalid/"
    ids: dict[str, set[str]] = {}
    links: set[str] = set()
    for path in sorted(docs_site.rglob("*.html")):
        rel = path.relative_to(docs_site).as_posix()
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        ids[rel] = page.ids
        links |= {urllib.parse.urljoin(base + rel, h) for h in page.hrefs}
    assert len(ids) > 50, len(ids)
    broken = []
    for link in sorted(links):
        if not link.startswith(base):
            continue  # another site (or mailto:, javascript:)
        target, _, fragment = link[len(base) :].partition("#")
        target = urllib.parse.unquote(target.split("?")[0]) or "index.html"
        if target.endswith("/"):
            target += "index.html"
        if target not in ids and not (docs_site / target).exists():
            broken.append(link)
        elif fragment and target in ids and urllib.parse.unquote(fragment) not in ids[target]:
            broken.append(link)
    assert broken == [], broken[:20]
