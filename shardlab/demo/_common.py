"""What the three demos share: timing, bytes, memory, the correctness check, table and plot.

Every helper runs on a rank (``shardlab.this_rank()`` is set). The ones that talk to the
other ranks say so; all ranks must call those together.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardlab.trace.memory import LiveBytes  # noqa: F401  (demos and benchmarks use it here)

# The check: max |sharded - single| / max |single| over every checked tensor (float32).
# The same sums in another order (a weight gradient adds ~10^6 float32 terms) differ by
# ~1e-5 .. 1e-4; a missing halo row or an unsummed gradient is off by 1e-2 or more.
TOL = 1e-3


def sizes_of(args, default: Sequence[int], quick: Sequence[int]) -> list[int]:
    """``--sizes`` if given, else the quick or the default sizes of a demo."""
    return list(args.sizes or (quick if args.quick else default))


def reps_of(args) -> int:
    """Timed repetitions after one warm-up step (median reported)."""
    return args.reps or (2 if args.quick else 3)


def gather(obj, group=None) -> list:
    """``obj`` of every rank of ``group`` (default: all), in rank order, on each of them
    (one all-gather of pickles)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(step: Callable, reps: int, device, together: bool = True, group=None) -> float:
    """Median wall time of ``step()`` over ``reps`` runs (call after a warm-up step).

    ``together=True`` (all ranks of ``group`` call it): every run starts after a barrier
    and lasts until the slowest rank finishes. ``together=False``: this rank alone.
    """
    times = []
    for _ in range(reps):
        if together:
            dist.barrier(group=group)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    if together:  # a run lasts as long as its slowest rank
        times = [max(ts) for ts in zip(*gather(times, group))]
    return statistics.median(times)


def received_bytes(trace) -> float:
    """Bytes this rank received during a ``shardlab.trace()`` block.

    Point-to-point: each ``recv`` exactly. Collectives: what a ring algorithm delivers to
    a rank of a group of g: all-reduce 2 (g-1)/g x payload, all-gather (g-1) x payload.
    """
    total = 0.0
    for e in trace.events:
        g = len(e.group)
        if e.kind == "recv":
            total += e.bytes
        elif e.kind == "all_reduce":
            total += 2 * e.bytes * (g - 1) / g
        elif e.kind == "all_gather":
            total += e.bytes * (g - 1)
    return total


def peak_bytes(step: Callable, device) -> int:
    """Peak growth of tensor memory while ``step()`` runs, in bytes.

    CUDA: ``max_memory_allocated``. CPU: :class:`LiveBytes` (tensors that exist before
    the step, e.g. the inputs and the weights, are not counted).
    """
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes() as live:
        step()
    return live.peak


def rel_error(pairs) -> float:
    """max over (got, want) pairs of max |got - want| / max |want|."""
    worst = 0.0
    for got, want in pairs:
        scale = want.detach().abs().max().item() or 1.0
        worst = max(worst, (got.detach() - want.detach()).abs().max().item() / scale)
    return worst


def check(err: float, what: str) -> None:
    """Every rank raises if the sharded result is not the single-device one."""
    if not err <= TOL:  # also catches NaN
        raise AssertionError(
            f"{what}: sharded result differs from single device: max relative error "
            f"{err:.2e} > {TOL:.0e}"
        )


def print_table(title: str, columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """On rank 0: a markdown table; ``columns`` are (key, header, format spec)."""
    if dist.get_rank() != 0:
        return
    lines = [title, "", "| " + " | ".join(h for _, h, _ in columns) + " |"]
    lines.append("|" + "|".join("---:" for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(format(row[k], f) for k, _, f in columns) + " |")
    print("\n".join(lines), flush=True)


def save_plot(path: str, title: str, xlabel: str, panels: list[tuple[str, dict]]) -> None:
    """On rank 0: one panel per (ylabel, {line label: (xs, ys)}), log-log axes, as PNG.

    matplotlib is imported here, and its Agg canvas used directly (no pyplot state, no
    display needed)."""
    if dist.get_rank() != 0:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5 * len(panels), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (ylabel, lines) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)
