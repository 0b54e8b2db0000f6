"""One model, three programs: on one device, as DTensors, as ShardTensors.

``python benchmarks/bench_dtensor_model.py [--ranks 1,2] [--models llama,qwen2] [--repeats 15]``
prints a step time per (model, ranks): forward + backward of the zoo's ``transformers``
decoder (``tests/models/_zoo.py``, float64, train mode) on its input ids cut along the
sequence (``torch.chunk`` sizes: DTensor's layout, and ``shardlab.distribute``'s default):

* one device: the unchanged model on rank 0 alone;
* DTensor: ``distribute_module`` (every parameter and buffer Replicate), the ids and labels
  ``distribute_tensor(..., [Shard(1)])``, under ``implicit_replication()`` (the plain
  tensors the model makes on the fly, rotary tables, masks, taken as Replicate);
* ShardTensor: the unchanged model under ``shardlab.patched()``, ``shardlab.distribute``.

Both distributed programs run the model's *eager* attention (``attn_implementation=
"eager"``): DTensor has no rule for the CPU flash kernel that SDPA picks. Steps are
alternated (one device, DTensor, ShardTensor, ...) and each column is the median of
``repeats``, on the slowest rank. What it answers: the zoo's decoders are tiny (hidden size
16), so a step is a few hundred small torch calls, and any tensor subclass that decides in
Python per op multiplies it: how much does DTensor itself, on the same model?

On two ranks DTensor refuses the model's loss (its ``nll_loss`` will not take a mean of
``torch.chunk``'s uneven pieces, which it would bias; the row says "fails" and the error is
printed below the table); shardlab's mean is exact (one all-reduce).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import shardlab  # noqa: E402
from benchmarks._common import ranks_on  # noqa: E402
from tests.models import _zoo  # noqa: E402


def body(name: str, repeats: int):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = shardlab.this_rank().mesh
    model = _zoo.decoder(name).to(torch.float64)
    model.config._attn_implementation = "eager"
    model.config.use_cache = False  # (DTensor: the cache's cat of a cut sequence fails)
    dmodel = distribute_module(copy.deepcopy(model), mesh)
    ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
    single = copy.deepcopy(model)

    def one():
        single(input_ids=ids, labels=ids).loss.backward()

    def dtensor():
        with implicit_replication():
            d = distribute_tensor(ids, mesh, [Shard(1)])
            dmodel(input_ids=d, labels=d).loss.backward()

    def sharded():
        with shardlab.patched():
            s = shardlab.distribute(ids, mesh, [Shard(1)])
            model(input_ids=s, labels=s).loss.backward()

    steps = {"one device": one, "DTensor": dtensor, "ShardTensor": sharded}
    times, failed = {k: [] for k in steps}, {}
    for i in range(repeats + 1):
        for kind, step in steps.items():
            for m in (single, model, dmodel):
                m.zero_grad(set_to_none=True)
            dist.barrier()
            if kind == "one device" and dist.get_rank() != 0:
                continue  # rank 0 alone: the others wait at the next barrier
            if kind in failed:
                continue
            t0 = time.perf_counter()
            try:
                step()
            except Exception as exc:  # DTensor's refusals (global: every rank raises)
                failed[kind] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:150]}"
                continue
            if i:  # the first round warms up
                times[kind].append(time.perf_counter() - t0)
    return {**{k: statistics.median(v) * 1e3 for k, v in times.items() if v}, **failed}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--models", default="llama,qwen2")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, gloo, on {os.cpu_count()} CPU cores, float64, "
          "forward + backward of the loss, eager attention, ms per step\n")  # fmt: skip
    print("| model | ranks | one device | DTensor | ShardTensor | DTensor / one device "
          "| ShardTensor / one device | ShardTensor / DTensor |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for world in [int(w) for w in args.ranks.split(",")]:
        with ranks_on(world) as ranks:
            for name in args.models.split(","):
                rows = ranks.run(body, name, args.repeats)
                one = rows[0]["one device"]
                d, s = (_slowest([r[k] for r in rows]) for k in ("DTensor", "ShardTensor"))
                cells = [_ms(one), _ms(d), _ms(s), _ratio(d, one), _ratio(s, one), _ratio(s, d)]
                print(f"| {name} | {world} | {' | '.join(cells)} |", flush=True)
                errors = [r["DTensor"] for r in rows if isinstance(r["DTensor"], str)]
                notes += [f"- DTensor, {name} on {world} ranks: {errors[0]}"] if errors else []
    print("", *notes, sep="\n")


def _slowest(values):
    """The slowest rank's median, or the error a rank met."""
    errors = [v for v in values if isinstance(v, str)]
    return "fails" if errors else max(values)


def _ms(v):
    return v if isinstance(v, str) else f"{v:.1f}"


def _ratio(a, b):
    return "" if isinstance(a, str) or isinstance(b, str) else f"{a / b:.2f}"


if __name__ == "__main__":
    main()
