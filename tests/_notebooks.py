"""What the tutorial tests share: which notebooks the browser runs, and a notebook's
world size rewritten (each notebook sets it once, on a line ``WORLD = 4``)."""

from __future__ import annotations

import importlib.util
import os
import re

import nbformat

# run in JupyterLab by tests/test_browser.py: the explorers and the first one (%%ranks)
LAB = (
    "00_ranks",
    "04_uneven_shards",
    "06_halo_convolution",
    "13_pipeline_parallel",
    "14_expert_parallel",
    "15_predict_then_measure",
)
CHROMIUM = "/usr/bin/chromium"


def browser_runs() -> bool:
    """True where tests/test_browser.py runs its notebooks (a Chromium, Playwright)."""
    return os.path.exists(CHROMIUM) and importlib.util.find_spec("playwright") is not None


def with_world(path, world: int) -> nbformat.NotebookNode:
    """The notebook at ``path`` with its one ``WORLD = 4`` line set to ``world``."""
    nb = nbformat.read(path, as_version=4)
    found = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and re.search(r"^WORLD = 4\b", cell.source, re.M):
            cell.source = re.sub(r"^WORLD = 4\b", f"WORLD = {world}", cell.source, flags=re.M)
            found += 1
    assert found == 1, f"{path.name}: expected one line 'WORLD = 4'"
    return nb
