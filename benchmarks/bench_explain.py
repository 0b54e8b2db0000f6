"""What ``shardlab.explain`` costs: a training step's time with it off, on, and on without
the memory column.

Run: ``python benchmarks/bench_explain.py [--ranks 3] [--models resnet,llama] [--reps 5]``.

Models of the zoo (``tests/models/_zoo.py``), float32, input cut along H (vision) or the
sequence (decoders); a step is forward + backward of the model's loss under
``shardlab.patched()``. "off" is the plain step (explain installs nothing until called);
"on" wraps the step in ``shardlab.explain(model)``: module hooks, autograd-node hooks,
the tracer, and (memory) a dispatch mode counting live tensor bytes. Median of ``reps``
steps after a warm-up, slowest rank.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def body(name, reps, big):
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab import distribute, this_rank
    from shardlab.demo._common import gather
    from tests.models import _zoo

    torch.set_num_threads(1)
    mesh = this_rank().mesh
    if name in _zoo.DECODERS:
        model = _zoo.decoder(name)
        seq = 512 if big else 64
        ids = torch.randint(0, _zoo.VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
        sizes = _zoo.uneven(seq, mesh.size())

        def batch():
            s = distribute(ids, mesh, [Shard(1)], sizes)
            return {"input_ids": s, "labels": s}
    else:
        model, kind = _zoo.vision(name)
        image = (2, 3, 128, 128) if big and name in ("resnet", "convnext") else _zoo.IMAGE
        x = torch.randn(image, generator=torch.Generator().manual_seed(0))
        b, _, h, w = image
        labels = torch.ones(b, dtype=torch.long) if kind == "cls" else torch.zeros(b, h, w).long()
        sizes = _zoo.uneven(h, mesh.size())

        def batch():
            return {"pixel_values": distribute(x, mesh, [Shard(2)], sizes), "labels": labels}

    def step():
        model.zero_grad(set_to_none=True)
        with shardlab.patched():
            model(**batch()).loss.backward()

    def explained(memory):
        def run():
            with shardlab.explain(model, memory=memory):
                step()

        return run

    out = {}
    for mode, fn in (("off", step), ("on", explained(True)), ("on, no memory", explained(False))):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[mode] = max(gather(statistics.median(times)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--models", default="resnet,vit,llama")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()

    import shardlab

    print(
        f"{a.ranks} gloo ranks, step = forward + backward of the model's loss, median of "
        f"{a.reps}, slowest rank\n"
    )
    print("| model | input | off ms | explain on ms | overhead | on, no memory ms | overhead |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with shardlab.Ranks(a.ranks) as ranks:
        for name in a.models.split(","):
            for big in (False, True):
                if big and name not in ("resnet", "convnext", "llama", "qwen2"):
                    continue
                r = ranks.run(body, name, a.reps, big)[0]
                off, on, lean = r["off"], r["on"], r["on, no memory"]
                if name in ("llama", "qwen2"):
                    size = "S = 512" if big else "S = 64"
                else:
                    size = "128 x 128" if big else "32 x 32"
                print(
                    f"| {name} | {size} | {1e3 * off:.0f} | {1e3 * on:.0f} | "
                    f"{100 * (on / off - 1):+.0f} % | {1e3 * lean:.0f} | "
                    f"{100 * (lean / off - 1):+.0f} % |",
                    flush=True,
                )

if __name__ == "__main__":
    main()
