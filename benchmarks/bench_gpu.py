"""On a GPU: ring attention against torch's fused SDPA and ``context_parallel``, and a halo
convolution against ``F.conv2d`` (time and peak memory).

Run (a machine with a CUDA GPU): ``python benchmarks/bench_gpu.py [--seq 16384,65536]
[--ranks 1,2,4] [--multi-seq 16384] [--reps 3]``.

Attention: bf16, causal, forward + backward (``out.sum().backward()``; a rank sums its own
part), B = 1, H = 16, D = 128, q, k, v cut along S in equal blocks. What is timed is the
call and its backward on inputs made before (leaves; ShardTensors for shardlab, as a
model's projections give them), except ``context_parallel``, whose context cuts its
buffers on entry:

* ``sdpa (one device)``: ``F.scaled_dot_product_attention`` on the whole tensors;
* ``torch context_parallel``: torch's public API (``torch.distributed.tensor.experimental``),
  its buffers cut in place, on the same mesh;
* ``ring``: shardlab's ``F.scaled_dot_product_attention`` on ShardTensors (patched), and
  ``ring head-tail``: the same on ``attention.balance``'s load-balanced layout.

One rank: nccl. Several ranks on one GPU: gloo ranks sharing it (nccl refuses two ranks
on one device), messages staged through host memory. Time: median of ``reps`` steps after a
warm-up, kernels waited for, slowest rank. Peak: ``torch.cuda.max_memory_allocated`` over
the timed call less what was allocated before it (the inputs), largest step and rank (each
rank is its own process).

Convolution: a (4, 32, 2048, 2048) bf16 image cut along H on one rank, ``nn.Conv2d``
32 -> 32, 3x3, padding 1, forward + backward, against the same ``F.conv2d`` on the tensor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks._common import ranks_on  # noqa: E402


def _measure(step, reps, dev):
    """(median seconds, largest peak bytes above the start) of ``run()`` on ``dev``, where
    ``step()`` gives ``run`` after making its inputs (not timed, not counted)."""
    import torch
    import torch.distributed as dist

    step()()  # warm-up: kernels chosen, caches filled
    times, peaks = [], []
    for _ in range(reps):
        run = step()
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        dist.barrier()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated(dev) - base)
        del run
    return statistics.median(times), max(peaks)


def attention(seqs, reps):
    """{(method, S): (seconds, peak bytes) or what failed} on this rank."""
    import torch

    rows = {}
    for s in seqs:
        rows.update(_attention_at(s, reps))
        torch.cuda.empty_cache()
    return rows


def _attention_at(s, reps):
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab import distribute, this_rank
    from shardlab.ops import attention as ring

    mesh, dev, n = this_rank().mesh, this_rank().device, this_rank().world_size
    torch.manual_seed(s)  # the same q, k, v on every rank
    full = [torch.randn(1, 16, s, 128, device=dev, dtype=torch.bfloat16) for _ in "qkv"]

    def leaves():
        return [x.detach().clone().requires_grad_() for x in full]

    def sdpa():
        xs = leaves()
        return lambda: F.scaled_dot_product_attention(*xs, is_causal=True).sum().backward()

    def ours(balanced):
        def step():  # the inputs: ShardTensor leaves, as a model's projections give them
            xs = [x.detach() for x in full]
            if balanced:
                with ring.head_tail():
                    parts = [ring.balance(x, mesh, [Shard(2)], dims=(2,)) for x in xs]
            else:
                parts = [distribute(x, mesh, [Shard(2)]) for x in xs]
            parts = [p.requires_grad_() for p in parts]

            def run():
                with shardlab.patched(), ring.head_tail() if balanced else nullcontext():
                    y = F.scaled_dot_product_attention(*parts, is_causal=True)
                    y.to_local().sum().backward()  # this rank's part of the sum: no message

            return run

        return step

    def context_parallel():  # cutting its buffers is part of its context: timed
        from torch.distributed.tensor.experimental import context_parallel as cp

        def run():
            xs = [x.detach().clone() for x in full]  # cut in place: leaves only inside
            with cp(mesh, buffers=xs, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(xs)):
                xs = [x.requires_grad_() for x in xs]
                F.scaled_dot_product_attention(*xs, is_causal=True).sum().backward()

        return run

    methods = {"ring": ours(False)}
    if n > 1:
        methods["ring head-tail"] = ours(True)
    else:
        methods = {"sdpa (one device)": sdpa, "torch context_parallel": context_parallel,
                   **methods}  # fmt: skip
    rows = {}
    for name, step in methods.items():
        try:
            rows[name, s] = _measure(step, reps, dev)
        except Exception as exc:  # noqa: BLE001 (say what failed, measure the rest)
            rows[name, s] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        torch.cuda.empty_cache()
    return rows


def conv(reps):
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab import distribute, this_rank

    mesh, dev = this_rank().mesh, this_rank().device
    torch.manual_seed(0)
    img = torch.randn(4, 32, 2048, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(32, 32, 3, 3, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def plain():
        x = img.detach().requires_grad_()
        return lambda: F.conv2d(x, w, padding=1).sum().backward()

    def ours():
        x = distribute(img, mesh, [Shard(2)]).requires_grad_()

        def run():
            with shardlab.patched():
                F.conv2d(x, w, padding=1).to_local().sum().backward()

        return run

    return {name: _measure(step, reps, dev) for name, step in
            {"F.conv2d (one device)": plain, "halo conv2d (shardlab)": ours}.items()}  # fmt: skip


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="16384,65536", help="sequence lengths on one rank")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--multi-seq", default="16384", help="sequence lengths on several ranks")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-conv", action="store_true")
    a = p.parse_args(argv)
    results = {}
    for world in [int(w) for w in a.ranks.split(",")]:
        seqs = [int(s) for s in (a.seq if world == 1 else a.multi_seq).split(",")]
        with ranks_on(world, "cuda", timeout=600) as ranks:
            backend = ranks.backend
            per_rank = ranks.run(attention, seqs, a.reps)
            if world == 1 and not a.no_conv:
                conv_rows = ranks.run(conv, a.reps)[0]
        for key, v in per_rank[0].items():
            name, s = key
            if isinstance(v, str):
                results[world, backend, name, s] = v
            else:
                vals = [r[key] for r in per_rank]
                results[world, backend, name, s] = (
                    max(t for t, _ in vals), max(m for _, m in vals)
                )  # fmt: skip
    print(f"torch {torch.__version__}, one {torch.cuda.get_device_name(0)}\n")
    print("Attention: bf16, causal, forward + backward, B=1, H=16, D=128\n")
    print("| ranks | backend | method | S | ms | peak MiB / rank |")
    print("|---:|---|---|---:|---:|---:|")
    for (world, backend, name, s), v in results.items():
        if isinstance(v, str):
            print(f"| {world} | {backend} | {name} | {s} | {v} | |")
        else:
            print(f"| {world} | {backend} | {name} | {s} | {v[0] * 1e3:.1f} | {v[1] / 2**20:.0f} |")
    if "1" in a.ranks.split(",") and not a.no_conv:
        print("\nConvolution: (4, 32, 2048, 2048) bf16, 3x3, 32 -> 32, fwd + bwd, 1 rank\n")
        print("| method | ms | peak MiB |")
        print("|---|---:|---:|")
        for name, (t, m) in conv_rows.items():
            print(f"| {name} | {t * 1e3:.1f} | {m / 2**20:.0f} |")


if __name__ == "__main__":
    main()
