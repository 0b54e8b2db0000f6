"""A decoder's training step, sequence-sharded: memory, bytes, loss-parallel collectives,
causal load balance.

Run: ``python benchmarks/bench_lm.py [--ranks 4] [--seq 8192] [--dim 64] [--heads 4]``.

The GPT of ``shardlab.demo.gpt`` (plain torch, float32, vocab 256, 2 layers, batch 1),
one forward + backward of the causal-LM loss:

1. peak memory per rank, sharded over N ranks (``shardlab.lm.shard_batch``, contiguous)
   vs one device (rank 0 alone): the peak of live tensor storage allocated during the
   step (``shardlab.demo._common.LiveBytes``; weights and inputs made before are not
   counted, scratch inside torch's fused CPU attention is not seen);
2. bytes each rank receives: the ring's K/V messages against the lower bound (every
   other rank's K and V once per layer forward; twice backward: K/V again plus the
   dK/dV coming home), and everything else (the label shift, the loss);
3. loss parallel: the cross-entropy collectives with the sequence cut (1-D mesh) and with
   the vocabulary also cut over ``mesh["tp"]`` (2-D mesh (N/2, 2), torch's
   ``parallelize_module``);
4. causal load balance: attention pairs (query, key) each rank computes, and its measured
   time of the step, contiguous blocks vs head-tail (``shard_batch(head_tail=True)``).
"""

from __future__ import annotations

import argparse


def body(seq, dim, heads):
    import copy
    import time

    import torch
    import torch.distributed as dist

    import shardlab
    from shardlab.demo._common import gather, peak_bytes
    from shardlab.demo.gpt import TinyGPT, tp_plan
    from shardlab.lm import shard_batch
    from shardlab.ops.attention import head_tail_order, head_tail_sizes

    torch.set_num_threads(1)
    ctx = shardlab.this_rank()
    mesh, me, n = ctx.mesh, dist.get_rank(), dist.get_world_size()
    vocab, layers = 256, 2
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = TinyGPT(vocab, dim, heads, layers, max_len=seq)

    def step(model, make):
        def run():
            model.zero_grad(set_to_none=True)
            with shardlab.patched():
                model(**make())[1].backward()

        return run

    out = {}
    # 1. memory: one device on rank 0 alone, then the sharded step
    if me == 0:
        single = copy.deepcopy(base)
        out["single_peak"] = peak_bytes(
            step(single, lambda: {"input_ids": ids, "labels": ids}), torch.device("cpu")
        )
    dist.barrier()
    model = copy.deepcopy(base)
    contiguous = lambda: shard_batch(mesh, ids, labels=ids, causal=True)  # noqa: E731
    run = step(model, contiguous)
    run()  # warm-up
    out["peak"] = peak_bytes(run, torch.device("cpu"))

    # 2. bytes
    with shardlab.trace() as t:
        run()
    ring = [e for e in t.events if e.kind == "recv" and "sdpa" in e.label]
    out["kv_fwd"] = sum(e.bytes for e in ring if "forward" in e.label)
    out["kv_bwd"] = sum(e.bytes for e in ring if "backward" in e.label)
    mine = seq // n + (me < seq % n)
    out["kv_bound"] = 2 * layers * (seq - mine) * dim * 4  # K and V of the others, f32
    out["other_recv"] = sum(e.bytes for e in t.events if e.kind == "recv" and e not in ring)
    out["ce_1d"] = [(e.kind, e.bytes) for e in t.events if "cross_entropy" in e.label]

    # 3. loss parallel on the 2-D mesh
    if n >= 4 and n % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh2 = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("seq", "tp"))
        tp = parallelize_module(copy.deepcopy(base), mesh2["tp"], tp_plan(base))
        with shardlab.trace(mesh2) as t2:
            step(tp, lambda: shard_batch(mesh2, ids, labels=ids, causal=True))()
        out["ce_2d"] = [
            (e.kind, e.bytes, mesh2.mesh_dim_names[e.mesh_dim])
            for e in t2.events
            if "cross_entropy" in e.label
        ]

    # 4. causal balance: pairs computed (fused blocks: all pairs of a visible block,
    #    causal pairs on the diagonal) and the measured step time, per rank
    for name, ht in (("contiguous", False), ("head-tail", True)):
        order = head_tail_order(seq, n) if ht else torch.arange(seq)
        sizes = head_tail_sizes(seq, n) if ht else None
        start = sum((sizes or [seq // n + (r < seq % n) for r in range(n)])[:me])
        rows = order[start : start + (sizes[me] if ht else mine)]
        out[f"pairs_{name}"] = int((order[None, :] <= rows[:, None]).sum())
        run = step(
            copy.deepcopy(base),
            lambda ht=ht: shard_batch(mesh, ids, labels=ids, head_tail=ht, causal=True),
        )
        run()
        dist.barrier()
        t0 = time.perf_counter()
        run()
        out[f"time_{name}"] = time.perf_counter() - t0
    return gather(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    a = p.parse_args()

    import shardlab

    with shardlab.Ranks(a.ranks) as ranks:
        rows = ranks.run(body, a.seq, a.dim, a.heads)[0]
    single = rows[0]["single_peak"]
    print(
        f"TinyGPT (vocab 256, dim {a.dim}, {a.heads} heads, 2 layers), S = {a.seq}, "
        f"{a.ranks} gloo ranks, float32, one training step (forward + backward)\n"
    )
    print(
        "| rank | peak MiB | / 1 device | K/V recv fwd MiB | bound | K/V recv bwd MiB | "
        "2 x bound | other recv B |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r, x in enumerate(rows):
        print(
            f"| {r} | {x['peak'] / 2**20:.1f} | {x['peak'] / single:.3f} | "
            f"{x['kv_fwd'] / 2**20:.2f} | {x['kv_bound'] / 2**20:.2f} | "
            f"{x['kv_bwd'] / 2**20:.2f} | {2 * x['kv_bound'] / 2**20:.2f} | "
            f"{x['other_recv']} |"
        )
    print(f"\none device: peak {single / 2**20:.1f} MiB\n")
    print("cross-entropy collectives (kind, bytes[, mesh axis]) on rank 0:")
    print(f"  sequence only (1-D): {rows[0]['ce_1d']}")
    if "ce_2d" in rows[0]:
        print(f"  sequence x tensor (2-D, vocab-parallel): {rows[0]['ce_2d']}")
    print("\ncausal load balance: attention pairs and step seconds per rank")
    print("| layout | pairs per rank | max / min pairs | seconds per rank | max / min time |")
    print("|---|---|---:|---|---:|")
    for name in ("contiguous", "head-tail"):
        pairs = [x[f"pairs_{name}"] for x in rows]
        times = [x[f"time_{name}"] for x in rows]
        print(
            f"| {name} | {pairs} | {max(pairs) / min(pairs):.2f} | "
            f"{[round(t, 2) for t in times]} | {max(times) / min(times):.2f} |"
        )


if __name__ == "__main__":
    main()
