"""The package surface: lazy imports, the public names, the explorers' text parsing."""

import subprocess
import sys

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import shardlab.viz
from shardlab.viz._parse import parse_ints, parse_padding, parse_placements, parse_sizes


def test_import_does_not_import_matplotlib_or_ipywidgets():
    code = (
        "import sys, shardlab.viz\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
        "assert 'ipywidgets' not in sys.modules, 'ipywidgets imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_public_api():
    assert set(shardlab.viz.__all__) >= {
        "plot_placements", "plot_halos", "plot_collectives", "halo_explorer",
        "placement_explorer",
    }  # fmt: skip
    for name in shardlab.viz.__all__:
        assert getattr(shardlab.viz, name).__doc__


@pytest.mark.parametrize(
    "text, want",
    [("5,5,4,4", [5, 5, 4, 4]), (" 5 5 4 4 ", [5, 5, 4, 4]), ("[1, 0, 2]", [1, 0, 2]),
     ("2x2", [2, 2]), ("3", [3]), ([2, 1], [2, 1]), ("", None)],
)  # fmt: skip
def test_parse_ints(text, want):
    assert parse_ints(text, "sizes", allow_empty=True) == want


@pytest.mark.parametrize("text", ["5,x", "1.5", "5,,-1", "x2"])
def test_parse_ints_rejects(text):
    with pytest.raises(ValueError, match="sizes"):
        parse_ints(text, "sizes")


def test_parse_padding_placements_sizes():
    got = [parse_padding(t) for t in ("same", "VALID", "2", "1, 3")]
    assert got == ["same", "valid", 2, (1, 3)]
    assert parse_placements("Shard(0), Replicate()") == [Shard(0), Replicate()]
    assert parse_placements("S(-1) P(avg)") == [Shard(-1), Partial("avg")]
    assert parse_placements("[R, Partial()]") == [Replicate(), Partial()]
    assert parse_sizes("  ") is None
    assert parse_sizes("[3, 2], [[2, 1], [1, 1]]") == [[3, 2], [[2, 1], [1, 1]]]
    assert parse_sizes("None, [1, 7]") == [None, [1, 7]]
    for bad in ("Shard(x)", "Q", "S(0) ; ?"):
        with pytest.raises(ValueError, match="placements"):
            parse_placements(bad)
    for bad in ("[1.5]", "import os", "'a'"):
        with pytest.raises(ValueError, match="sizes"):
            parse_sizes(bad)
