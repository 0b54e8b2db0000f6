"""The cost model of messages against measured communication: tutorial 09's U-Net and
tutorial 10's decoder, one training step, on 2 and 4 gloo ranks.

Run: ``python benchmarks/bench_cost.py [--ranks 2 4] [--steps 10] [--repeats 9]``.

For each world size, in one pool:

1. ``shardlab.cost.calibrate(ranks)``: 6 kinds x 5 sizes (16 B .. 1 MiB), ``--repeats``
   each, ``α`` and ``β`` fitted per kind;
2. each model: two warm-up steps, then ``--steps`` steps, each under ``shardlab.trace()``;
3. ``shardlab.cost.predict(trace, model)`` on each step: the step's communication time,
   predicted and measured (its slowest rank; a message timed from its last participant's
   post to its completion, no waiting for late ranks: ``shardlab/cost/pairing.py``), and
   the bytes (the trace's, and the prediction's: the same events, paired into messages).

Printed, for each model calibrated twice (in a tight loop, and with the step's median
compute gap between messages before each timed one: ``calibrate(between=)``): the step's
measured communication time (each message's median over the steps, summed on the slowest
rank; beside it the smallest and largest of the single steps, each a sum of single
messages), the predicted, their ratio, the time the slowest rank spent inside communication
calls (waiting for late ranks included), the bytes, and per kind the same sums.

The U-Net: tutorial 09's (width 8, float64, 4 images of 32 x 32, rows cut over the ranks,
scattered from rank 0, Adam). The decoder: tutorial 10's tiny Llama (transformers, 1
layer, hidden 16, float64), 2 sequences of 11 tokens cut unevenly, ``shard_batch(causal=
True)``, forward and backward.
"""

from __future__ import annotations

import argparse

from _common import tutorial_unet_source


def _unet_step(source):
    """Tutorial 09's model and one training step (a closure over this rank's state)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.layout import chunk_sizes

    namespace = {"nn": nn, "F": F, "torch": torch}
    exec(source, namespace)  # tutorial 09's block and UNet
    UNet = namespace["UNet"]  # noqa: N806

    me = shardlab.this_rank()
    torch.manual_seed(0)
    model = UNet().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    size = 32
    rows = [4 * k for k in chunk_sizes(size // 4, me.world_size)]
    gen = torch.Generator().manual_seed(me.rank)
    images = torch.randn(4, 1, size, size, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, 3, (4, size, size), generator=gen)

    def step():
        with shardlab.patched():
            x = shardlab.scatter_tensor(images if me.rank == 0 else None, 0, me.mesh,
                                        [Shard(2)], sizes=[rows])  # fmt: skip
            y = shardlab.scatter_tensor(labels if me.rank == 0 else None, 0, me.mesh,
                                        [Shard(1)], sizes=[rows])  # fmt: skip
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    return step


def _decoder_step():
    """Tutorial 10's tiny Llama and one forward + backward of the sharded batch."""
    import torch
    import transformers

    import shardlab
    from shardlab.lm import shard_batch

    me = shardlab.this_rank()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).double()
    s, n = 11, me.world_size
    ids = torch.randint(0, 64, (2, s), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    sizes = [s // n + (1 if r < s % n else 0) for r in range(n)]

    def step():
        model.zero_grad()
        with shardlab.patched():
            out = model(**shard_batch(me.mesh, ids, mask, labels, sizes=sizes, causal=True))
            out.loss.backward()

    return step


def _setup(which, source):
    import shardlab

    step = _unet_step(source) if which == "unet" else _decoder_step()
    shardlab.this_rank().ns["step"] = step


def _one_step():
    import shardlab

    shardlab.this_rank().ns["step"]()


def measure(ranks, which, steps):
    """``steps`` traces of one step each, after two warm-up steps."""
    import shardlab

    ranks.run(_setup, which, tutorial_unet_source())
    for _ in range(2):
        ranks.run(_one_step)
    traces = []
    for _ in range(steps):
        with shardlab.trace() as t:
            ranks.run(_one_step)
        traces.append(t)
    return traces


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()

    import os
    import statistics

    import shardlab
    from shardlab.cost import calibrate, gaps, predict

    print(f"gloo ranks on {os.cpu_count()} CPU cores, load average before: "
          f"{os.getloadavg()[0]:.1f}; {a.steps} traced steps each\n")  # fmt: skip
    results = []
    for world in a.ranks:
        with shardlab.Ranks(world) as ranks:
            tight = calibrate(ranks, repeats=a.repeats)
            print(tight, "\n")
            for which in ("unet", "decoder"):
                traces = measure(ranks, which, a.steps)
                gap = statistics.median(gaps(traces[0].events))
                paced = calibrate(ranks, repeats=a.repeats, between=gap)
                print(f"{which}: {paced}\n")
                for name, model in (("tight loop", tight), (f"{gap * 1e3:.1f} ms between", paced)):
                    each = [predict(t, model).measured for t in traces]
                    results.append((which, world, name, traces, predict(traces, model), each))
    print(
        "| model | ranks | calibrated | messages | measured ms (one step: min .. max) | "
        "predicted ms | predicted / measured | in calls ms | bytes traced | bytes predicted |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for which, world, name, traces, q, each in results:
        calls = max(r["in_calls"] for r in q.ranks.values())
        print(f"| {which} | {world} | {name} | {len(q.rows)} | {q.measured * 1e3:.2f} "
              f"({min(each) * 1e3:.2f} .. {max(each) * 1e3:.2f}) | {q.predicted * 1e3:.2f} | "
              f"{q.ratio:.2f} | {calls * 1e3:.2f} | {traces[0].bytes()} | {q.bytes} |")  # fmt: skip
    for which, world, name, _, q, _ in results:
        print(f"\n{which} on {world} ranks, calibrated {name}, per kind (each message's median "
              "over the steps):")  # fmt: skip
        print("| kind | messages | bytes | wire bytes | predicted ms | measured ms | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind, d in sorted(q.by("kind").items()):
            print(f"| {kind} | {d['messages']} | {d['bytes']} | {d['wire_bytes']:.0f} | "
                  f"{d['predicted'] * 1e3:.2f} | {d['measured'] * 1e3:.2f} | "
                  f"{d['predicted'] / d['measured']:.2f} |")  # fmt: skip
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
