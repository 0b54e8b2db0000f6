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
    x = torch.full((3,), float(ctx.rank + 1), device=ctx.device)  # (3,) on every rank
    dist.all_reduce(x)  # one all-reduce over the default group
    return {"rank": ctx.rank, "sum": x.tolist(), "mesh": tuple(ctx.mesh.shape)}


def _check_shard_tensor() -> dict:
    """Uneven sizes [n+1, n, ..., 1, 0]: full_tensor and mean exact; DTensor's are not."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from shardlab import ShardTensor
    from shardlab.runtime import this_rank

    ctx = this_rank()
    n = ctx.world_size
    sizes = [n + 1 - r for r in range(n - 1)] + [0] if n > 1 else [3]
    total = sum(sizes)
    g = torch.arange(total * 2, dtype=torch.float64, device=ctx.device).reshape(total, 2)
    start = sum(sizes[: ctx.rank])
    local = g[start : start + sizes[ctx.rank]]
    st = ShardTensor.from_local(local, ctx.mesh, [Shard(0)])
    ok = torch.equal(st.full_tensor(), g) and torch.allclose(st.mean().full_tensor(), g.mean())
    # DTensor alone would assume torch.chunk sizes for this global shape
    from shardlab.layout import chunk_sizes

    assumed = list(chunk_sizes(total, n))
    dist.barrier()
    return {"ok": ok, "sizes": sizes, "assumed": assumed}


def _tour_all_reduce(ranks, out):
    n = ranks.world_size
    res = _quiet(ranks, _check_all_reduce)
    want = [float(n * (n + 1) // 2)] * 3
    ok = all(r["sum"] == want and r["mesh"] == (n,) for r in res)
    return ok, f"sum of rank+1 = {res[0]['sum'][0]:g} (expected {want[0]:g})"


def _tour_shard_tensor(ranks, out):
    res = _quiet(ranks, _check_shard_tensor)
    return all(r["ok"] for r in res), (
        f"Shard(0) sizes {res[0]['sizes']}: full_tensor and mean exact "
        f"(DTensor alone assumes {res[0]['assumed']})"
    )


def _check_conv() -> dict:
    """nn.Conv2d, unchanged, on an image sharded over H with uneven sizes."""
    import torch
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.layout import conv_plan
    from shardlab.runtime import this_rank

    ctx = this_rank()
    n = ctx.world_size
    sizes = [3 + (r % 2) for r in range(n)]  # e.g. [3, 4, 3, 4]
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).double().to(ctx.device)
    img = torch.randn(1, 3, sum(sizes), 6, dtype=torch.float64).to(ctx.device)
    with shardlab.patched():
        x = shardlab.distribute(img, ctx.mesh, [Shard(2)], sizes=[sizes])
        with shardlab.trace() as t:
            y = conv(x)
    ok = torch.allclose(y.full_tensor(), conv(img))
    plan = conv_plan(sizes, 3, 1, 1, (1, 1))
    row = 1 * 3 * 6 * 8
    exact = t.bytes(kind="recv") == plan.rows_received(ctx.rank) * row
    return {
        "ok": bool(ok and exact),
        "sizes": sizes,
        "events": t.events,
        "received": t.bytes(kind="recv"),
    }


def _tour_conv(ranks, out):
    from shardlab.trace import Trace

    res = _quiet(ranks, _check_conv)
    sizes = res[0]["sizes"]
    trace = Trace([e for r in res for e in r["events"]])
    try:
        from shardlab import viz

        viz.plot_placements(
            mesh_shape=(len(sizes),),
            placements=[_shard(2)],
            global_shape=(1, 3, sum(sizes), 6),
            sizes=[sizes],
            dims=(2, 3),
        ).savefig(f"{out}/placements.png")
        viz.plot_halos(sizes, 3, padding=1, bytes_per_row=3 * 6 * 8).savefig(f"{out}/halos.png")
        viz.plot_collectives(trace).savefig(f"{out}/collectives.png")
    except ImportError:
        pass  # matplotlib missing: the check still counts
    return all(r["ok"] for r in res), (
        f"nn.Conv2d on H sizes {sizes}: exact; "
        f"{len(trace.filter(kind='recv'))} halo messages, bytes = lower bound"
    )


def _check_cross_entropy() -> dict:
    """Vocab-parallel F.cross_entropy on uneven class shards: 2 all-reduces forward, 0 back."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.runtime import this_rank

    ctx = this_rank()
    n = ctx.world_size
    sizes = [5 + 2 * r for r in range(n)]
    torch.manual_seed(0)
    logits = torch.randn(6, sum(sizes), dtype=torch.float64).to(ctx.device)
    target = torch.randint(0, sum(sizes), (6,)).to(ctx.device)
    ref = F.cross_entropy(logits, target, label_smoothing=0.1)
    start = sum(sizes[: ctx.rank])
    block = logits[:, start : start + sizes[ctx.rank]].clone().requires_grad_()  # (6, C_local)
    with shardlab.patched():
        st = shardlab.ShardTensor.from_local(block, ctx.mesh, [Shard(1)], [sizes])
        with shardlab.trace() as fwd:
            loss = F.cross_entropy(st, target, label_smoothing=0.1)
    with shardlab.trace() as bwd:
        loss.backward()
    ok = abs(float(loss.detach()) - float(ref)) < 1e-12
    return {"ok": ok and fwd.counts() == {"all_reduce": 2} and len(bwd) == 0, "sizes": sizes}


def _tour_cross_entropy(ranks, out):
    res = _quiet(ranks, _check_cross_entropy)
    return all(r["ok"] for r in res), (
        f"vocab-parallel, class sizes {res[0]['sizes']}, label_smoothing: exact; "
        "2 all-reduces forward, none backward"
    )


def _check_attention() -> dict:
    """Causal ring attention on uneven sequence shards: each rank receives every other
    rank's K/V block once in forward."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.runtime import this_rank

    ctx = this_rank()
    n = ctx.world_size
    sizes = [2 + r for r in range(n)]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, sum(sizes), 4, dtype=torch.float64).to(ctx.device) for _ in "qkv")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with shardlab.patched():
        qs, ks, vs = (
            shardlab.distribute(t, ctx.mesh, [Shard(2)], sizes=[sizes]) for t in (q, k, v)
        )
        with shardlab.trace() as t:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    ok = torch.allclose(out.full_tensor(), ref)
    received = len(t.filter(kind="recv"))
    return {"ok": ok and received == n - 1, "sizes": sizes}  # K and V in one message


def _tour_attention(ranks, out):
    res = _quiet(ranks, _check_attention)
    return all(r["ok"] for r in res), (
        f"causal ring attention on sequence sizes {res[0]['sizes']}: exact; "
        "K/V of every other rank received once"
    )


def _shard(d):
    from torch.distributed.tensor import Shard

    return Shard(d)


# (name, check(ranks, out_dir) -> (ok, detail)); later capabilities add theirs here
CHECKS = [
    ("all_reduce", _tour_all_reduce),
    ("ShardTensor", _tour_shard_tensor),
    ("halo conv2d", _tour_conv),
    ("cross_entropy", _tour_cross_entropy),
    ("ring attention", _tour_attention),
]


def _quiet(ranks, fn):
    """Run a check on every rank; what the ranks print (warnings) stays out of the report."""
    return ranks._call(fn, (), {})[0]


def tour(
    n: int = 4, backend: str = "auto", out: str = "shardlab-tour", device: str = "auto"
) -> int:
    """Start ``n`` ranks, run every capability check, print a report; return 0 if all pass.
    ``auto``: on CUDA where torch sees a GPU (nccl with one per rank, else gloo ranks
    sharing them), else gloo on the CPU."""
    import os

    from shardlab.demo.__main__ import resolve_backend
    from shardlab.runtime import Ranks

    os.makedirs(out, exist_ok=True)
    rows: list[tuple[str, bool, str]] = []
    t0 = time.perf_counter()
    backend, device = resolve_backend(backend, device, n)
    with Ranks(n, backend=backend, device=device) as ranks:
        took = time.perf_counter() - t0
        rows.append(("start ranks", True, f"{n} {backend} ranks on {device} up in {took:.2f} s"))
        for name, check in CHECKS:
            try:
                ok, detail = check(ranks, out)
            except Exception as exc:  # noqa: BLE001 - a failed check is a FAIL row
                ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            rows.append((name, ok, detail))
    width = max(len(r[0]) for r in rows)
    print(f"shardlab tour on {n} {backend} ranks ({device})")
    for name, ok, detail in rows:
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<{width}}  {detail}")
    figures = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    if figures:
        print(f"figures in {out}/: " + ", ".join(figures))
    failed = sum(not ok for _, ok, _ in rows)
    print(f"tour: {len(rows) - failed} checks passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tour", help="start ranks and check every capability")
    t.add_argument("-n", "--ranks", type=int, default=4, help="number of ranks (default 4)")
    t.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    t.add_argument("--out", default="shardlab-tour", help="folder for the figures")
    args = parser.parse_args(argv)
    if args.command == "tour":
        try:
            return tour(args.ranks, args.backend, args.out, args.device)
        except Exception as exc:  # noqa: BLE001 - a report, then a non-zero exit
            print(f"shardlab tour failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return 2
