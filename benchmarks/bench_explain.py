"""What ``shardlab.explain`` costs: a training step's time with it off, on, and on with
the CPU memory column.

Run: ``python benchmarks/bench_explain.py [--ranks 3] [--models resnet,llama] [--reps 9]``.

Models of the zoo (``tests/models/_zoo.py``, hidden sizes 8-16) and two wider ones
(``resnet-wide``: hidden 32/64 on 128 x 128; ``llama-wide``: hidden 128, 2 layers,
S = 1024), float32, input cut along H (vision) or the sequence (decoders); a step is
forward + backward of the model's loss under ``shardlab.patched()``. "off" is the plain
step (explain installs nothing until called); "on" wraps the step in
``shardlab.explain(model)``, the default: module hooks, autograd-node hooks, the tracer's
kernels on the communication ops, one all-gather of the rows at the end (on CPU no memory
column); "on, memory=True" adds the CPU memory column, a dispatch mode that counts live
tensor bytes op by op. The three modes run interleaved, ``reps`` rounds after a warm-up;
a step is timed from a barrier to a barrier, i.e. until the slowest rank is done
(explain's closing gather waits for it, so the plain step must be timed the same way);
median per mode. "CPU overhead": the CPU time the ranks spend in a step (process time,
summed over the ranks), on against off: explain's own work, which the wall time shows
only through the noise of more ranks than cores.
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
    if name == "llama-wide":  # hidden 128, 2 layers: each op does some work
        model = _zoo.decoder(
            "llama",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            max_position_embeddings=2048,
        )
        seq = 1024
        ids = torch.randint(0, _zoo.VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
        sizes = _zoo.uneven(seq, mesh.size())

        def batch():
            s = distribute(ids, mesh, [Shard(1)], sizes)
            return {"input_ids": s, "labels": s}
    elif name == "resnet-wide":  # hidden sizes 32, 64 on a 128 x 128 image
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], layer_type="basic"
        )
        model = _zoo._no_randomness(tf.ResNetForImageClassification(cfg))
        x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(0))
        labels = torch.ones(2, dtype=torch.long)
        sizes = _zoo.uneven(128, mesh.size())

        def batch():
            return {"pixel_values": distribute(x, mesh, [Shard(2)], sizes), "labels": labels}
    elif name in _zoo.DECODERS:
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

    modes = {"off": step, "on": explained(None), "on, memory=True": explained(True)}
    times: dict = {mode: [] for mode in modes}
    cpu: dict = {mode: [] for mode in modes}
    for fn in modes.values():
        fn()  # warm-up
    for _ in range(reps):  # interleaved: a slow moment of the machine hits every mode
        for mode, fn in modes.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            c1 = time.process_time()
            dist.barrier()  # until the slowest rank is done
            times[mode].append(time.perf_counter() - t0)
            cpu[mode].append(c1 - c0)
    out = {mode: max(gather(statistics.median(t))) for mode, t in times.items()}
    out.update({f"cpu {m}": sum(gather(statistics.median(t))) for m, t in cpu.items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--models", default="resnet,vit,llama,resnet-wide,llama-wide")
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()

    import shardlab

    print(
        f"{a.ranks} gloo ranks, step = forward + backward of the model's loss, median of "
        f"{a.reps}, barrier to barrier (the slowest rank)\n"
    )
    print(
        "| model | input | off ms | explain on ms | overhead | CPU overhead | "
        "on, memory=True ms | overhead |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with shardlab.Ranks(a.ranks) as ranks:
        for name in a.models.split(","):
            for big in (False, True):
                if big and name not in ("resnet", "convnext", "llama", "qwen2"):
                    continue
                size = {"resnet-wide": "128 x 128", "llama-wide": "S = 1024"}.get(name)
                r = ranks.run(body, name, a.reps, big)[0]
                off, on, mem = r["off"], r["on"], r["on, memory=True"]
                if size is None and name in ("llama", "qwen2"):
                    size = "S = 512" if big else "S = 64"
                elif size is None:
                    size = "128 x 128" if big else "32 x 32"
                cpu = r["cpu on"] / r["cpu off"] - 1
                print(
                    f"| {name} | {size} | {1e3 * off:.0f} | {1e3 * on:.0f} | "
                    f"{100 * (on / off - 1):+.0f} % | {100 * cpu:+.0f} % | {1e3 * mem:.0f} | "
                    f"{100 * (mem / off - 1):+.0f} % |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
