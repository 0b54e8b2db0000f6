"""The model zoo, run sharded and unchanged: exact or not, what it sends, how long a step takes.

``python benchmarks/bench_zoo.py [--ranks 4] [--models resnet,vit,...] [--inference]
[--device cuda] [--dtype float32]`` prints
one row per model: ``transformers`` models from small configs (``tests/models/_zoo.py``),
float64, vision models on pixel values cut along H with uneven sizes, decoders on input ids
and labels cut along the sequence. A step is forward + backward of the model's own loss;
with ``--inference``, the forward alone in eval mode under ``torch.no_grad()``.

* exact: largest difference of logits and of the input gradient (vision) against the same
  step on one device;
* collectives / messages: counted on rank 0 by ``shardlab.trace`` over one step;
* MiB recv: what the busiest rank receives in one step (a ring all-reduce delivers
  2 (n-1)/n of its payload);
* time: median of ``--repeats`` steps (3) after a warm-up, slowest rank; one device: the
  same step on rank 0 alone. All ranks share this machine's cores, so times are
  indicative only (a few steps vary by a third from run to run: use ``--repeats 15``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import shardlab  # noqa: E402
from benchmarks._common import ranks_on, received_bytes, synchronize, where  # noqa: E402
from tests.models import _zoo  # noqa: E402


def _step(model, kind, inputs, labels, inference=False):
    if inference:
        with torch.no_grad():
            return model(**inputs, labels=labels)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    return out


def cpu(t):
    """Results go back to the parent on the CPU (no CUDA there before the ranks fork)."""
    return None if t is None else t.detach().cpu()


def body(name: str, repeats: int = 3, inference: bool = False, dtype: str = "float64"):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from shardlab import distribute, this_rank

    mesh, dev = this_rank().mesh, this_rank().device
    n, dt = mesh.size(), getattr(torch, dtype)
    if name in _zoo.DECODERS:
        model, kind = _zoo.decoder(name).to(dev, dt), "lm"
        ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
        ids = ids.to(dev)
        full, labels, dim = {"input_ids": ids}, ids, 1
    else:
        model, kind = _zoo.vision(name)
        model = model.to(dev, dt)
        g = torch.randn(_zoo.IMAGE, dtype=dt, generator=torch.Generator().manual_seed(1)).to(dev)
        b, _, h, w = _zoo.IMAGE
        labels = torch.randint(0, 3, (b, h, w)) if kind == "seg" else torch.tensor([1] * b)
        labels = labels.to(dev)
        full, dim = {"pixel_values": g}, 2
    if inference:
        model.eval()
    # one device (rank 0 alone, on its own copy: the ranks' buffers must stay alike)
    one = None
    if dist.get_rank() == 0:
        import copy

        single, times = copy.deepcopy(model), []
        for _ in range(repeats + 1):
            single.zero_grad(set_to_none=True)
            xs = {
                k: (v.clone().requires_grad_() if v.is_floating_point() else v)
                for k, v in full.items()
            }
            synchronize(dev)
            t0 = time.perf_counter()
            ref = _step(single, kind, xs, labels, inference)
            synchronize(dev)
            times.append(time.perf_counter() - t0)
        one = (
            statistics.median(times[1:]),
            ref.logits.detach(),
            next((v.grad for v in xs.values() if v.is_floating_point()), None),
        )
    dist.barrier()
    # sharded
    sizes = _zoo.uneven(next(iter(full.values())).shape[dim], n)
    times = []
    with shardlab.patched():
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            xs = {
                k: (v.clone().requires_grad_() if v.is_floating_point() else v)
                for k, v in full.items()
            }
            st = {k: distribute(v, mesh, [Shard(dim)], sizes) for k, v in xs.items()}
            lab = distribute(labels, mesh, [Shard(1)], sizes) if kind == "lm" else labels
            synchronize(dev)
            dist.barrier()
            if i == 1:
                with shardlab.trace() as t:
                    out = _step(model, kind, st, lab, inference)
                events = t.events
            else:
                t0 = time.perf_counter()
                out = _step(model, kind, st, lab, inference)
                synchronize(dev)
                times.append(time.perf_counter() - t0)
    logits = out.logits.detach().full_tensor()
    grad = next((v.grad for v in xs.values() if v.is_floating_point()), None)
    step = max(statistics.median(times), 0)
    return {
        "one": None if one is None else one[0],
        "one_logits": None if one is None else cpu(one[1]),
        "one_grad": None if one is None else cpu(one[2]),
        "logits": cpu(logits),
        "grad": cpu(grad),
        "step": step,
        "events": [e for e in events],
        "recv": received_bytes(events, dist.get_rank()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--models", default=",".join(_zoo.VISION + _zoo.DECODERS))
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (median)")
    parser.add_argument(
        "--inference", action="store_true", help="the forward alone, eval mode, no grad"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    args = parser.parse_args(argv)
    ranks = ranks_on(args.ranks, args.device)
    rows = []
    exact = 1e-9 if args.dtype == "float64" else 1e-4  # float32: the sum order of the cut
    try:
        for name in args.models.split(","):
            res = ranks.run(body, name, args.repeats, args.inference, args.dtype)
            r0 = res[0]
            err = (r0["logits"] - r0["one_logits"]).abs().max().item()
            if r0["grad"] is not None and r0["one_grad"] is not None:
                err = max(err, (r0["grad"] - r0["one_grad"]).abs().max().item())
            ev = [e for e in r0["events"] if e.rank == 0]
            coll = sum(e.kind not in ("send", "recv") for e in ev)
            msgs = sum(e.kind in ("send", "recv") for e in ev)
            fallback = sum("whole-tensor" in e.label for e in ev)
            step = max(r["step"] for r in res)
            rows.append(
                (
                    name,
                    args.ranks,
                    "yes" if err < exact else f"no ({err:.1e})",
                    coll,
                    msgs,
                    max(r["recv"] for r in res) / 2**20,
                    fallback,
                    step * 1e3,
                    r0["one"] * 1e3,
                )
            )
    finally:
        ranks.close()
    step = "forward, eval mode, no grad" if args.inference else "forward + backward of the loss"
    print(
        f"torch {torch.__version__}, {args.ranks} {ranks.backend} ranks, "
        f"{where(args.device)}, {args.dtype}, {step}\n"
    )
    print(
        f"| model | ranks | exact ({args.dtype}) | collectives / step | messages / step "
        "| MiB recv / rank | whole-tensor fallbacks | step ms | 1 device ms |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.3f} | {r[6]} "
            f"| {r[7]:.1f} | {r[8]:.1f} |"
        )


if __name__ == "__main__":
    main()
