"""``shardlab tour`` end to end (it starts its own ranks, as a user's first command does)."""

import subprocess
import sys


def test_tour_passes_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "shardlab", "tour", "-n", "3", "--out", str(tmp_path / "figs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # auto: CUDA where torch sees a GPU (one per rank: nccl, fewer: shared by gloo ranks)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = ("nccl" if gpus >= 3 else "gloo", "cuda" if gpus else "cpu")
    assert lines[0] == "shardlab tour on 3 {} ranks ({})".format(*where)
    assert any("PASS  ShardTensor" in line for line in lines)
    assert not any("FAIL" in line for line in lines)
    assert lines[-1].startswith("tour: ") and lines[-1].endswith(" 0 failed")
    figures = sorted(p.name for p in (tmp_path / "figs").glob("*.png"))
    assert figures == ["collectives.png", "halos.png", "placements.png"]
    assert any(line.startswith("figures in") and "halos.png" in line for line in lines)


def test_tour_rejects_bad_arguments():
    out = subprocess.run(
        [sys.executable, "-m", "shardlab", "tour", "-n", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "positive int" in out.stderr
