"""``torch.compile`` on sharded models: eager vs compiled step time, graphs and graph breaks.

``python benchmarks/bench_compile.py [--ranks 1,2,4] [--models resnet,llama]
[--backend inductor] [--repeats 15] [--device cuda]`` prints one row per (model, ranks): the zoo's
``transformers`` models (``tests/models/_zoo.py``, float32, train mode), vision models on
pixel values cut along H, decoders on input ids and labels cut along the sequence, with
uneven sizes; a step is forward + backward of the model's own loss, unchanged, under
``shardlab.patched()``.

* eager / compiled ms: median of ``repeats`` steps each, after a warm-up, alternated
  (eager, compiled, eager, ...), slowest rank;
* compile s: the first compiled step (dynamo + the backend) less an eager step;
* graphs / graph breaks / ops in graphs: dynamo's counters over the first compiled step
  (``unique_graphs``, the graph breaks, ``calls_captured``); collectives: what the tracer
  counts on rank 0 (collective and point-to-point calls) in one forward, and in one step
  (forward + backward), eager and compiled;
* exact: largest difference of the compiled step's logits and gradients against eager.

shardlab's design (``shardlab/comm/traced.py``): on a mesh of one rank the whole step is
traced (one graph); cut over several ranks each ShardTensor op runs eagerly between graphs
(a graph break) and the plain-tensor code around it is compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import shardlab  # noqa: E402
from benchmarks._common import ranks_on, synchronize, where  # noqa: E402
from tests.models import _zoo  # noqa: E402


def body(name: str, backend: str, repeats: int, nested: bool = False, whole: bool = False):
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import Shard

    from shardlab import distribute, this_rank

    torch._dynamo.reset()
    mesh, dev = this_rank().mesh, this_rank().device
    n = mesh.size()
    if name in _zoo.DECODERS:
        model = _zoo.decoder(name).to(dev)
        ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
        ids = ids.to(dev)
        full, labels, dim = {"input_ids": ids}, ids, 1
    else:
        model, _ = _zoo.vision(name)
        model = model.to(dev)
        g = torch.randn(_zoo.IMAGE, generator=torch.Generator().manual_seed(1)).to(dev)
        labels = torch.tensor([1] * _zoo.IMAGE[0], device=dev)
        full, dim = {"pixel_values": g}, 2
    model.train()
    sizes = _zoo.uneven(next(iter(full.values())).shape[dim], n)

    def inputs():
        st = {k: distribute(v, mesh, [Shard(dim)], sizes) for k, v in full.items()}
        lab = distribute(labels, mesh, [Shard(1)], sizes) if name in _zoo.DECODERS else labels
        return st, lab

    def step(m):
        st, lab = inputs()
        synchronize(dev)
        dist.barrier()
        t0 = time.perf_counter()
        out = m(**st, labels=lab)
        out.loss.backward()
        synchronize(dev)
        took = time.perf_counter() - t0
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return took, out.logits.detach().full_tensor(), grads

    whole_graphs = shardlab.messages_in_graphs() if whole else contextlib.nullcontext()
    with shardlab.patched(), torch._dynamo.config.patch(nested_graph_breaks=nested), whole_graphs:
        _, logits_e, grads_e = step(model)  # warm-up (and the decision caches)
        warm = [step(model)[0] for _ in range(3)]
        compiled_model = torch.compile(model, backend=backend)
        counters.clear()
        first, logits_c, grads_c = step(compiled_model)
        graphs = counters["stats"]["unique_graphs"]
        ops = counters["stats"]["calls_captured"]
        breaks = sum(counters["graph_break"].values())
        step(compiled_model)
        eager, compiled = [], []
        for _ in range(repeats):  # alternated: both see the same state of the machine
            eager.append(step(model)[0])
            compiled.append(step(compiled_model)[0])
        st, lab = inputs()
        with shardlab.trace() as t:
            out = model(**st, labels=lab)
            forward = len(t.events)
            out.loss.backward()
        model.zero_grad(set_to_none=True)
        with shardlab.trace() as t_step:  # the compiled step: the same messages
            st, lab = inputs()
            compiled_model(**st, labels=lab).loss.backward()
        model.zero_grad(set_to_none=True)
    rank = dist.get_rank()
    mine = [e for e in t.events[:forward] if e.rank == rank]
    step_events = [e for e in t.events if e.rank == rank]
    compiled_events = [e for e in t_step.events if e.rank == rank]
    err = (logits_c - logits_e).abs().max().item()
    err = max([err] + [(a - b).abs().max().item() for a, b in zip(grads_c, grads_e)])
    return {
        "eager": statistics.median(eager),
        "compiled": statistics.median(compiled),
        "compile": first - statistics.median(warm),
        "graphs": graphs,
        "breaks": breaks,
        "ops": ops,
        "collectives": len(mine),
        "step collectives": len(step_events),
        "compiled collectives": len(compiled_events),
        "err": err,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--models", default="resnet,llama")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--nested-graph-breaks",
        action="store_true",
        help="dynamo resumes a nested frame after a graph break inside it "
        "(torch._dynamo.config.nested_graph_breaks) instead of breaking every frame above",
    )
    parser.add_argument(
        "--messages-in-graphs",
        action="store_true",
        help="compile inside shardlab.messages_in_graphs(): collectives and halos are ops "
        "of the compiled graphs instead of graph breaks",
    )
    args = parser.parse_args(argv)
    rows, backends = [], []
    for world in [int(w) for w in args.ranks.split(",")]:
        with ranks_on(world, args.device, timeout=600) as ranks:
            backends.append(f"{world}: {ranks.backend}")
            for name in args.models.split(","):
                res = ranks.run(
                    body,
                    name,
                    args.backend,
                    args.repeats,
                    args.nested_graph_breaks,
                    args.messages_in_graphs,
                )
                r0 = res[0]
                rows.append(
                    (
                        name,
                        world,
                        max(r["eager"] for r in res) * 1e3,
                        max(r["compiled"] for r in res) * 1e3,
                        max(r["compile"] for r in res),
                        r0["graphs"],
                        r0["breaks"],
                        r0["ops"],
                        r0["collectives"],
                        max(r["err"] for r in res),
                        r0["step collectives"],
                        r0["compiled collectives"],
                    )
                )
    print(
        f"torch {torch.__version__}, backend {args.backend}, ranks ({', '.join(backends)}) "
        f"{where(args.device)}, float32, forward + backward of the model's loss"
        + (", inside shardlab.messages_in_graphs()" if args.messages_in_graphs else "")
        + (", nested graph breaks" if args.nested_graph_breaks else "")
        + "\n"
    )
    print(
        "| model | ranks | eager ms | compiled ms | compiled / eager | compile s | graphs "
        "| graph breaks | ops in graphs | collectives + messages (fwd) "
        "| collectives + messages (step: eager / compiled) | max diff vs eager |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[3] / r[2]:.2f} | {r[4]:.1f} "
            f"| {r[5]} | {r[6]} | {r[7]} | {r[8]} | {r[10]} / {r[11]} | {r[9]:.1e} |"
        )


if __name__ == "__main__":
    main()
