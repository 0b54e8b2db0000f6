"""Expert-parallel Mixtral (or Qwen2-MoE): what one training step sends, per MoE layer.

``python benchmarks/bench_experts.py [--ranks 2,4] [--family mixtral] [--dtype float64]
[--seqs 3,2] [--seq 7]`` prints one row per rank: the model of ``tests/experts/_moe.py``
(2 layers, both MoE, 4 experts, top-2, hidden 16), each rank its own sequences (the batch
cut unevenly: ``--seqs`` per rank, default 3:2 on 2 ranks and 2:1:1:1 on 4), one step =
forward, backward of a next-token cross entropy, one AdamW step, traced with
``shardlab.trace``:

* per MoE layer, the bytes this rank hands to each all-to-all (counts, dispatch and
  combine forward, their transposes backward), layer 0 then layer 1;
* every other message of the step (kind, label, bytes);
* exact: the largest difference of the logits against the same step on one device;
* step ms: median of 3 steps, slowest rank (all ranks share this machine's cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import shardlab  # noqa: E402
from tests.experts import _moe  # noqa: E402

PARTS = ["counts forward", "dispatch forward", "combine forward", "combine backward",
         "dispatch backward"]  # fmt: skip


def _body(family, sizes, seq, dtype, repeats=3):
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from shardlab import ExpertParallel

    me = shardlab.this_rank()
    ids = torch.randint(
        0, _moe.VOCAB, (sum(sizes), seq), generator=torch.Generator().manual_seed(3)
    )

    def loss_of(logits, ids):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    one = _moe.model(family, dtype)
    want = one(input_ids=ids).logits.detach()
    model = _moe.model(family, dtype)
    parallelize_module(model, me.mesh, {"model.layers.*.mlp": ExpertParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mine = shardlab.distribute(ids, me.mesh, [Shard(0)], [sizes])

    def step():
        with shardlab.patched():
            logits = model(input_ids=mine).logits
            loss_of(logits, mine).backward()
        opt.step()
        opt.zero_grad()
        return logits

    with shardlab.trace() as t:
        logits = step()
    exact = (logits.full_tensor().detach() - want).abs().max().item()
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    layers = {p: [] for p in PARTS}  # bytes of each MoE layer's message, in trace order
    for e in t.events:
        if e.label.startswith("experts."):
            layers[e.label.removeprefix("experts.")].append(e.bytes)
    others = Counter()
    for e in t.events:
        if not e.label.startswith("experts."):
            others[f"{e.kind} {e.label}"] += e.bytes
    n = len(layers["counts forward"])  # MoE layers
    return {
        "tokens": sizes[me.rank] * seq,
        "per layer": [",".join(map(str, layers[p])) for p in PARTS],
        "all_to_all": sum(e.kind == "all_to_all" for e in t.events) // n,
        "others": dict(others),
        "exact": exact,
        "ms": statistics.median(times) * 1e3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--family", default="mixtral", choices=["mixtral", "qwen2_moe"])
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--seqs", default=None, help="sequences per rank, e.g. 3,2")
    ap.add_argument("--seq", type=int, default=7)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{args.family}, {args.dtype}, sequences of {args.seq} tokens, hidden {_moe.HIDDEN}, "
          f"top-{_moe.K} of 4 experts; bytes of layer 0,1: " + " / ".join(PARTS))  # fmt: skip
    print(
        "| ranks | rank | tokens | all-to-alls / layer | bytes / layer | other messages "
        "| exact | step ms |"
    )
    print("|---:|---:|---:|---:|---|---|---:|---:|")
    for world in [int(w) for w in args.ranks.split(",")]:
        default = {2: "3,2", 4: "2,1,1,1"}.get(world, ",".join(["1"] * world))
        sizes = [int(s) for s in (args.seqs or default).split(",")]
        with shardlab.Ranks(world, timeout=300) as ranks:
            results = ranks.run(_body, args.family, sizes, args.seq, dtype)
        slowest = max(r["ms"] for r in results)
        for rank, r in enumerate(results):
            others = ", ".join(f"{k} {v} B" for k, v in sorted(r["others"].items()))
            print(f"| {world} | {rank} | {r['tokens']} | {r['all_to_all']} | "
                  f"{' / '.join(r['per layer'])} | {others} | {r['exact']:.1e} | "
                  f"{slowest:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
