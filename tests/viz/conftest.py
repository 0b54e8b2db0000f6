"""Fixtures for the viz tests: the Agg backend, matplotlib's default style (no user rc file),
and ``--update-snapshots`` to rewrite the reference PNGs in ``tests/viz/snapshots``."""

import matplotlib
import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--update-snapshots",
        action="store_true",
        default=False,
        help="rewrite tests/viz/snapshots/*.png from the current figures",
    )


@pytest.fixture(autouse=True)
def _agg_default_style():
    matplotlib.use("Agg")
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        yield


@pytest.fixture
def update_snapshots(request):
    # getoption's default covers a run from the repository root, where this conftest is not
    # an initial one and the option is registered too late to be parsed
    return request.config.getoption("--update-snapshots", default=False)
