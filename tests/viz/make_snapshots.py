"""Rewrite the reference PNGs: ``python -m tests.viz.make_snapshots`` (from the repo root)."""

import matplotlib

matplotlib.use("Agg")

from tests.viz.snapshot_cases import CASES, write  # noqa: E402


def main() -> None:
    for name in CASES:
        print(write(name))


if __name__ == "__main__":
    main()
