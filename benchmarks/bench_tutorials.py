"""Time and memory of each tutorial notebook, as Binder (2 GB of RAM) would run it.

    python benchmarks/bench_tutorials.py [--world 4] [notebook stems ...]

Each notebook runs in a fresh kernel (nbclient, as nbval does). While it runs, every 0.1 s
the script sums the proportional set size (PSS, from /proc/<pid>/smaps_rollup: shared pages
split between the processes that share them) of every process below this one: the kernel,
its forkserver and the ranks. The peak of that sum is what the notebook costs in RAM; a
Jupyter server adds about 100 MB. Linux only.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import threading
import time

import nbformat
from nbclient import NotebookClient

TUTORIALS = pathlib.Path(__file__).resolve().parent.parent / "tutorials"


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants_pss(root: int) -> int:
    """Sum of PSS bytes of every process below ``root``."""
    tree, total, todo = _children(), 0, list(_children().get(root, []))
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += 1024 * int(re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M).group(1))
        except (OSError, AttributeError):
            pass
    return total


def measure(path: pathlib.Path, world: int) -> tuple[float, int]:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = re.sub(r"^WORLD = 4\b", f"WORLD = {world}", cell.source, flags=re.M)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], descendants_pss(os.getpid()))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        client = NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(TUTORIALS)}})
        client.execute()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    return seconds, peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("stems", nargs="*", help="notebooks (default: all)")
    args = parser.parse_args()
    paths = sorted(TUTORIALS.glob("[0-9]*.ipynb"))
    if args.stems:
        paths = [p for p in paths if p.stem in args.stems]
    print(f"| notebook ({args.world} ranks) | seconds | peak RAM, kernel + ranks (PSS) |")
    print("|---|---:|---:|")
    for path in paths:
        seconds, peak = measure(path, args.world)
        print(f"| {path.stem} | {seconds:.1f} | {peak / 2**20:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
