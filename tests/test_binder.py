"""``binder/`` installs what the package needs: CPU torch, every dependency, the package."""

import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_binder_requirements_cover_the_package_dependencies():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [
        line.strip()
        for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    names = {_name(line) for line in lines if not line.startswith("-")}
    assert {_name(d) for d in deps} <= names
    assert "torch==2.13.0" in lines  # the version the README's test command installs
    assert any("download.pytorch.org/whl/cpu" in line for line in lines)  # the small CPU build


def test_binder_installs_the_package_itself():
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert re.search(r"^pip install .*-e \.", post_build, re.M)
    assert (ROOT / "binder" / "runtime.txt").read_text().strip().startswith("python-3.")
