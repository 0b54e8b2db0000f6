"""Ring attention: per-rank peak memory, bytes and time against all-gathering K/V, and
torch's ``context_parallel`` where it runs.

Run: ``python benchmarks/bench_attention.py [--ranks 4] [--seq 2048] [--heads 4] [--dim 32]``.

Every method computes causal attention of (B, H, S, D) float32 q, k, v sharded along S
in equal blocks, forward and backward (q, k, v gradients), on gloo ranks:

* ``ring``: shardlab's ``F.scaled_dot_product_attention`` (contiguous blocks, and the
  head-tail layout of ``attention.balance``);
* ``all-gather + sdpa``: all-gather K and V, torch's fused SDPA on the local queries
  against all keys (causal mask from global positions), all-reduce dK/dV in backward;
* ``all-gather + math``: the same with explicit ``softmax(q k^T) v`` (scores S/N x S);
* torch ``context_parallel`` (its public API), timed if it runs.

Memory: the peak of live tensor storage bytes allocated inside forward + backward, per
rank (max over ranks), recorded by a ``TorchDispatchMode`` that sees every tensor an op
creates and a ``weakref.finalize`` that sees it freed. Inputs made before are not
counted; scratch memory inside a fused kernel (torch's CPU flash attention) is not seen.
Bytes: what the busiest rank receives, from the shardlab tracer: a ``recv`` counts its
size, collectives what a ring algorithm delivers (all_gather: (n-1) x input,
all_reduce: 2 (n-1)/n x input). Time: seconds per forward + backward, one intra-op
thread per rank; the 4 ranks share the machine's cores, so times are indicative.
"""

from __future__ import annotations

import argparse
import time


def body(b, h, s, d, reps):

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab import ShardTensor
    from shardlab.demo._common import LiveBytes  # peak bytes of tensors made in a block
    from shardlab.ops import attention

    torch.set_num_threads(1)
    mesh = shardlab.this_rank().mesh
    me, n = dist.get_rank(), dist.get_world_size()
    sl = s // n
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, s, d, generator=gen) for _ in range(3)]
    dout = torch.randn(b, h, s, d, generator=gen)
    rows = slice(me * sl, (me + 1) * sl)
    q_pos = torch.arange(me * sl, (me + 1) * sl)
    causal = torch.arange(s)[None, :] <= q_pos[:, None]  # (S/N, S) for the baselines

    class GatherKV(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # (B, H, S/N, D) -> (B, H, S, D)
            out = x.new_empty(n * x.numel())
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, x.contiguous().view(-1))
            return out.view(n, *x.shape).permute(1, 2, 0, 3, 4).reshape(b, h, s, d)

        @staticmethod
        def backward(ctx, g):  # every rank's partial dK: sum, keep my rows
            g = g.contiguous()
            dist.all_reduce(g)
            return g[:, :, rows]

    # each method: forward now, return the backward as a function
    def ring(balanced):
        if balanced:
            ins = [attention.balance(x, mesh, [Shard(2)]).to_local() for x in full]
            g = attention.balance(dout, mesh, [Shard(2)]).to_local()
        else:
            ins, g = [x[:, :, rows].clone() for x in full], dout[:, :, rows]

        def forward():
            loc = [x.detach().requires_grad_() for x in ins]
            st = [ShardTensor.from_local(x, mesh, [Shard(2)], [x.shape[2]] * n) for x in loc]
            with shardlab.patched():
                if balanced:
                    with attention.head_tail():
                        y = F.scaled_dot_product_attention(*st, is_causal=True)
                else:
                    y = F.scaled_dot_product_attention(*st, is_causal=True)
            return lambda: y.to_local().backward(g)

        return forward

    def gathered(math):
        ins, g = [x[:, :, rows].clone() for x in full], dout[:, :, rows]

        def forward():
            q, k, v = (x.detach().requires_grad_() for x in ins)
            kf, vf = GatherKV.apply(k), GatherKV.apply(v)  # (B, H, S, D)
            if math:
                sc = (q @ kf.transpose(-2, -1)) / d**0.5  # (B, H, S/N, S)
                y = sc.masked_fill(~causal, float("-inf")).softmax(-1) @ vf
            else:
                y = F.scaled_dot_product_attention(q, kf, vf, attn_mask=causal)
            return lambda: y.backward(g)

        return forward

    def context_parallel():
        from torch.distributed.tensor.experimental import context_parallel as cp

        q, k, v = (x.clone() for x in full)
        with cp(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return lambda: y.backward(torch.ones_like(y))

    methods = {
        "ring (shardlab, contiguous)": ring(False),
        "ring (shardlab, head-tail)": ring(True),
        "all-gather K/V + torch sdpa": gathered(False),
        "all-gather K/V + math": gathered(True),
        "torch context_parallel": context_parallel,
    }
    results = {}
    for name, forward in methods.items():
        try:
            with shardlab.trace() as t_f:
                backward = forward()
            with shardlab.trace() as t_b:
                backward()
        except Exception as exc:  # noqa: BLE001  (reported in the table)
            results[name] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            dist.barrier()
            continue
        mode = LiveBytes()
        with mode:
            forward()()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            forward()()
        dist.barrier()
        count = lambda t: sum(  # noqa: E731  (from_local's check of the sizes left out)
            e.kind in ("recv", "all_gather", "all_reduce") and not e.label.startswith("from_local")
            for e in t.events
        )
        from _common import received_bytes

        results[name] = dict(
            peak=mode.peak,
            fwd=received_bytes(t_f.events, me),
            bwd=received_bytes(t_b.events, me),
            messages=f"{count(t_f)} + {count(t_b)}",
            seconds=(time.perf_counter() - start) / reps,
        )
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args(argv)
    import shardlab

    with shardlab.Ranks(a.ranks) as ranks:
        per_rank = ranks.run(body, a.batch, a.heads, a.seq, a.dim, a.reps)
    n, mib = a.ranks, 2**20
    block = a.batch * a.heads * (a.seq // n) * a.dim * 4  # one K (or V) block, bytes
    print(f"causal attention, (B, H, S, D) = ({a.batch}, {a.heads}, {a.seq}, {a.dim}) float32, "
          f"{n} gloo ranks, S/N = {a.seq // n}; forward + backward")  # fmt: skip
    print()
    print("| method | peak MiB / rank | recv MiB fwd | recv MiB bwd | messages fwd + bwd "
          "| s / iter |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name in per_rank[0]:
        rs = [r[name] for r in per_rank]
        if "error" in rs[0]:
            print(f"| {name} | fails: {rs[0]['error']} | | | | |")
            continue
        busiest = max(rs, key=lambda r: r["fwd"] + r["bwd"])
        print(
            f"| {name} | {max(r['peak'] for r in rs) / mib:.1f} | {busiest['fwd'] / mib:.2f} "
            f"| {busiest['bwd'] / mib:.2f} | {busiest['messages']} "
            f"| {max(r['seconds'] for r in rs):.3f} |"
        )
    print(f"| forward lower bound: K, V of the other ranks | | {2 * (n - 1) * block / mib:.2f} "
          "| | | |")  # fmt: skip
    print()
    print(
        "Ring messages per rank: forward N-1 K/V blocks received (K and V in one message); "
        "backward the same K/V again plus N-1 dK/dV accumulators (the last hop brings a "
        "rank's own home)."
    )


if __name__ == "__main__":
    main()
