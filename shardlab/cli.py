"""``shardlab`` command line: ``shardlab tour`` runs the checks on real ranks."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def _check_all_reduce() -> dict:
    """Every rank contributes rank + 1; the all-reduced sum is n (n + 1) / 2."""
    import torch
    import torch.distributed as dist

    from shardlab.runtime import this_rank

    ctx = this_rank()
    x = torch.full((3,), float(ctx.rank + 1))  # (3,) on every rank
    dist.all_reduce(x)  # one all-reduce over the default group
    return {"rank": ctx.rank, "sum": x.tolist(), "mesh": tuple(ctx.mesh.shape)}


def tour(n: int = 4, backend: str = "gloo", out: str = "shardlab-tour") -> int:
    """Start ``n`` ranks, run every capability check, print a report; return 0 if all pass."""
    from shardlab.runtime import Ranks

    rows: list[tuple[str, bool, str]] = []
    t0 = time.perf_counter()
    with Ranks(n, backend=backend) as ranks:
        started = time.perf_counter() - t0
        rows.append(("start ranks", True, f"{n} {backend} ranks up in {started:.2f} s"))
        res = ranks.run(_check_all_reduce)
        want = [float(n * (n + 1) // 2)] * 3
        ok = all(r["sum"] == want and r["mesh"] == (n,) for r in res)
        rows.append(
            ("all_reduce", ok, f"sum of rank+1 = {res[0]['sum'][0]:g} (expected {want[0]:g})")
        )
    width = max(len(r[0]) for r in rows)
    print(f"shardlab tour on {n} {backend} ranks")
    for name, ok, detail in rows:
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<{width}}  {detail}")
    failed = sum(not ok for _, ok, _ in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tour", help="start ranks and check every capability")
    t.add_argument("-n", "--ranks", type=int, default=4, help="number of ranks (default 4)")
    t.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    t.add_argument("--out", default="shardlab-tour", help="folder for the figures")
    args = parser.parse_args(argv)
    if args.command == "tour":
        try:
            return tour(args.ranks, args.backend, args.out)
        except Exception as exc:  # noqa: BLE001 - a report, then a non-zero exit
            print(f"shardlab tour failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return 2
