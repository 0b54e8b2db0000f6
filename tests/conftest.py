"""The site (docs/): built once per session by the tests that need it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
SITE = DOCS / "_build" / "html"
# the docs build executes every tutorial (4 ranks each) on a cold cache
DOCS_TIMEOUT = 1800


def python_last_line(code: str, *argv: str, timeout: float = 300) -> str:
    """Run ``code`` in a fresh interpreter (``sys.argv[1:]`` is ``argv``); the last line it
    prints (it must exit 0)."""
    run = [sys.executable, "-c", code, *argv]
    out = subprocess.run(run, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def sphinx_build(*extra: str) -> tuple[float, str]:
    """``python -m sphinx -W`` of docs/ into docs/_build/html: (seconds, output).

    Two documents at a time (``-j 2``): myst-nb executes each tutorial as Sphinx reads it,
    and a kernel starting, a notebook's single-threaded cells and Sphinx's own work leave a
    core idle; on 2 cores the cold build took 229 s against 307 s one at a time."""
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-j", "2", "-b", "html", *extra]
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, str(DOCS), str(SITE)], cwd=ROOT, capture_output=True, text=True,
        timeout=DOCS_TIMEOUT,
    )  # fmt: skip
    took = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        noise = ("IPKernelApp", "alltoall yet")  # a kernel's start, gloo's Shard->Shard
        lines = [line for line in out.splitlines() if not any(n in line for n in noise)]
        pytest.fail(
            f"sphinx-build -W failed (exit {proc.returncode}):\n" + "\n".join(lines[-80:]),
            pytrace=False,
        )
    return took, out


@pytest.fixture(scope="session")
def docs_site() -> pathlib.Path:
    """The built site (tutorials executed, warnings are errors); skipped without Sphinx."""
    for name in ("sphinx", "myst_nb", "sphinx_book_theme", "sphinx_design", "jupytext"):
        pytest.importorskip(name, reason='the docs need pip install -e ".[docs]"')
    took, _ = sphinx_build()
    print(f"docs built in {took:.1f} s")
    return SITE


def pytest_addoption(parser):
    parser.addoption(
        "--every-other",
        choices=("even", "odd"),
        default=None,
        help="of the selected tests, in collection order, keep those at even (0, 2, ...) or "
        "odd positions (a function's cases alternate, and so do functions with one case); "
        "tests marked every_torch run either way. CI runs the suite on torch 2.11 with "
        "'even' and on 2.15 with 'odd': every case on one of them (and all on 2.13)",
    )


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    half = config.getoption("--every-other")
    if half is None:
        return
    split = [i for i in items if i.get_closest_marker("every_torch") is None]
    drop = {id(c) for c in split[(half == "even") :: 2]}
    if drop:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in drop])
        items[:] = [i for i in items if id(i) not in drop]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: compiles whole models, sweeps the op database through the compiler, or "
        "executes the tutorials (the docs build, the 3-rank reruns, the browser): the "
        "README's command leaves them out (-m 'not slow and not more_worlds', under 12 "
        "minutes on 2 cores); CI runs them after it, on torch 2.13; on 2.11 and 2.15 only "
        "those also marked every_torch",
    )
    config.addinivalue_line(
        "markers",
        "every_torch: a slow test CI also runs on torch 2.11 and 2.15 (-m 'not more_worlds "
        "and (not slow or every_torch)'): one whole compiled train step, a compiled decoder "
        "given a new length, the op database compiled (a quarter of the ops), compiled "
        "autograd's refusal; on both versions (--every-other leaves them in). The rest of "
        "the slow tier (the zoo compiled with inductor: minutes on a cold inductor cache) "
        "runs on 2.13 only, to keep CI under 30 minutes",
    )
    config.addinivalue_line(
        "markers",
        "more_worlds: a sweep's extra world sizes and mesh shapes (the README's command "
        "leaves them out; CI runs them after it on torch 2.13, and skips them on 2.11 and "
        "2.15, where each sweep runs at its other sizes, each case on one of the two "
        "versions (--every-other)",
    )
