"""Rank runtime: time to the first collective, call latency and memory per pool size.

Run: ``python benchmarks/bench_runtime.py`` (each row starts a fresh Python
process, so the forkserver start and the torch import are included).
Target (issue 2): 4 ranks to the first collective in <= 2 s on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import shardlab
n, method = int(sys.argv[1]), sys.argv[2]
ranks = shardlab.Ranks(n, start_method=method)
t_up = time.perf_counter()

def first():
    import torch, torch.distributed as dist
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()

assert ranks.run(first) == [float(n)] * n
t_first = time.perf_counter()
lat = []
for _ in range(50):
    t = time.perf_counter(); ranks.run(first); lat.append(time.perf_counter() - t)

def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0

mem = sum(pss(p) for p in ranks.pids)
ranks.close()
print(json.dumps(dict(up=t_up - t0, first=t_first - t0, call=sorted(lat)[len(lat) // 2],
                      mem=mem)))
"""


def measure(n: int, method: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), method], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    print(
        "| start method | ranks | ranks up (s) | to first all_reduce (s) | "
        "call latency (ms) | rank memory, PSS (MB) |"
    )
    print("|---|---|---|---|---|---|")
    for method in ("forkserver", "spawn"):
        for n in (1, 2, 4):
            m = measure(n, method)
            print(
                f"| {method} | {n} | {m['up']:.2f} | {m['first']:.2f} | "
                f"{m['call'] * 1e3:.1f} | {m['mem'] / 2**20:.0f} |"
            )


if __name__ == "__main__":
    main()
