"""The package's layers (pyproject.toml, ``[tool.importlinter]``): each imports only the
ones below it, function-local imports included, and the layers below ``ops/`` hold their
imports at the top of their modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardlab"
# below ops/: what a learner reads to see how a sharded op runs
BELOW_OPS = (
    *("_compat.py", "_tree.py", "_layers.py", "layout", "runtime"),
    *("trace", "comm", "tensor", "engine"),
)
# imports kept inside functions on purpose: what needs torch stays out of the torch-free
# pool (shardlab.runtime, imported by the kernel before torch)
MOST_LOCAL_IMPORTS = 5


def test_the_layers_import_only_downward():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (the test extra installs it)")
    run = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 kept, 0 broken" in run.stdout, run.stdout[-2000:]
    config = (ROOT / "pyproject.toml").read_text()
    assert "ignore_imports" not in config  # no exception listed


def _local_imports(path: Path) -> list[str]:
    """``path:line`` of each shardlab import inside a function of ``path``."""
    tree, out = ast.parse(path.read_text()), []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").startswith("shardlab")
                ):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                elif isinstance(node, ast.Import) and any(
                    a.name.startswith("shardlab") for a in node.names
                ):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return sorted(set(out))


def test_the_layers_below_ops_import_at_the_top():
    found = []
    for name in BELOW_OPS:
        where = PACKAGE / name
        for path in [where] if where.is_file() else sorted(where.rglob("*.py")):
            found += _local_imports(path)
    assert len(found) <= MOST_LOCAL_IMPORTS, found
