"""Language model: a small decoder trained with its sequence sharded (context parallel).

The GPT of :mod:`shardlab.demo.gpt`, unchanged, trains for a few steps on a sequence cut
over N ranks (``shardlab.lm.shard_batch``): the K/V blocks go round the ring in every
attention layer, the label shift crosses the shard boundaries, the loss is the global
mean. With N >= 4 (even), the same model also trains on a 2-D mesh (sequence x tensor):
torch's ``parallelize_module`` on ``mesh["tp"]`` (q, k, v, up column-wise; o, down
row-wise; the head column-wise with the vocab-parallel loss) and the sequence cut over
``mesh["seq"]``::

    mesh (N/2, 2) = ("seq", "tp")       seq 0: tokens 0..S/2-1    seq 1: tokens S/2..S-1
                                        tp 0: heads 0..H/2-1      tp 1: heads H/2..H-1

Every run starts from the same weights as one device (rank 0 alone) and is checked
step by step against its loss curve. Rows: one device, the ring, the all-gather-K/V
baseline (every rank gathers the whole K and V), the 2-D mesh; columns: tokens per
second, bytes received per rank per step, peak memory per rank.
"""

from __future__ import annotations

import copy
import time

import torch

import shardlab
import shardlab.lm
from shardlab.demo import _common as common
from shardlab.demo.gpt import TinyGPT, tp_plan

SIZES = (1024,)  # sequence lengths
QUICK = (16,)
VOCAB, DIM, HEADS, LAYERS, STEPS, LR = 64, 32, 4, 2, 4, 0.5


def _data(seq: int, device) -> torch.Tensor:
    """(1, S) tokens that follow a rule (t+1 = 5 t + 3 mod V): the loss can fall."""
    x = torch.empty(1, seq, dtype=torch.long, device=device)
    x[0, 0] = 1
    for i in range(1, seq):
        x[0, i] = (5 * x[0, i - 1] + 3) % VOCAB
    return x


def _train(model, make_batch, steps, device, progress=False):
    """SGD steps; returns (losses, seconds per step)."""
    from tqdm.auto import tqdm

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, times = [], []
    for _ in tqdm(range(steps), disable=not progress, desc="steps", leave=False):

        def step():
            opt.zero_grad(set_to_none=True)
            with shardlab.patched():
                _, loss = model(**make_batch())
                loss.backward()
            opt.step()
            return loss

        common._sync(device)
        start = time.perf_counter()
        loss = step()
        common._sync(device)
        times.append(time.perf_counter() - start)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return losses, sorted(times)[len(times) // 2]


def _measure(name, model, make_batch, seq, args, trace_mesh=None):
    """Train, then trace one more step and measure its peak memory; same row everywhere."""
    ctx = shardlab.this_rank()
    losses, seconds = _train(model, make_batch, _steps(args), ctx.device, progress=ctx.rank == 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def one():
        opt.zero_grad(set_to_none=True)
        with shardlab.patched():
            model(**make_batch())[1].backward()

    with shardlab.trace(trace_mesh) as t:
        one()
    rows = common.gather(
        {
            "recv": common.received_bytes(t),
            "peak": common.peak_bytes(one, ctx.device),
            "seconds": seconds,
        }
    )
    return {
        "config": name,
        "seq": seq,
        "tokens_s": seq / max(r["seconds"] for r in rows),  # a step lasts as the slowest rank
        "recv_mib": max(r["recv"] for r in rows) / 2**20,
        "peak_mib": max(r["peak"] for r in rows) / 2**20,
        "losses": losses,
    }


def one_size(seq: int, args) -> list[dict]:
    ctx = shardlab.this_rank()
    n, dev, mesh = ctx.world_size, ctx.device, ctx.mesh
    ids = _data(seq, dev)
    torch.manual_seed(0)
    base = TinyGPT(VOCAB, DIM, HEADS, LAYERS, max_len=seq).to(dev)
    mine = None
    if ctx.rank == 0:  # one device: rank 0 alone, the others wait in the gather below
        mine = _measure_single(copy.deepcopy(base), ids, seq, args)
    single, rows = common.gather(mine)[0], []

    def batch(m=mesh, dim=0):
        return lambda: shardlab.lm.shard_batch(m, ids, labels=ids, mesh_dim=dim, causal=True)

    runs = [
        (f"ring, {n} ranks", copy.deepcopy(base), batch(), None),
        (f"all-gather K/V, {n} ranks", _with_mode(base, "allgather"), batch(), None),
    ]
    if n >= 4 and n % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh2 = init_device_mesh(dev.type, (n // 2, 2), mesh_dim_names=("seq", "tp"))
        tp = parallelize_module(copy.deepcopy(base), mesh2["tp"], tp_plan(base))
        runs.append((f"ring x TP, mesh ({n // 2}, 2)", tp, batch(mesh2, 0), mesh2))
    for name, model, make, tmesh in runs:
        row = _measure(name, model, make, seq, args, tmesh)
        row["loss_err"] = max(abs(a - b) for a, b in zip(row["losses"], single["losses"]))
        common.check(row["loss_err"] / max(single["losses"]), f"lm {name}, S={seq}")
        rows.append(row)
    rows.insert(0, single)
    for r in rows:
        r.update(ranks=1 if r is single else n, final_loss=r["losses"][-1], ok=True)
        r["max_rel_err"] = r.get("loss_err", 0.0)
    return rows


def _with_mode(model, mode):
    m = copy.deepcopy(model)
    for mod in m.modules():
        if hasattr(mod, "mode"):
            mod.mode = mode
    return m


def _measure_single(model, ids, seq, args):
    batch = {"input_ids": ids, "labels": ids}
    losses, seconds = _train(model, lambda: batch, _steps(args), ids.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def one():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids)[1].backward()

    return {
        "config": "1 device",
        "seq": seq,
        "tokens_s": seq / seconds,
        "recv_mib": 0.0,
        "peak_mib": common.peak_bytes(one, ids.device) / 2**20,
        "losses": losses,
    }


def _steps(args) -> int:
    return STEPS if not args.quick else 2


COLUMNS = [
    ("config", "run", ""),
    ("seq", "S", "d"),
    ("tokens_s", "tokens/s", ".0f"),
    ("recv_mib", "MiB recv/rank/step", ".3f"),
    ("peak_mib", "peak MiB/rank", ".2f"),
    ("final_loss", "loss after training", ".4f"),
    ("max_rel_err", "max |loss - 1 device|", ".1e"),
]


def run(args) -> list[dict]:
    """Every sequence length; rank 0 prints the table and saves the loss curves."""
    import os

    ctx = shardlab.this_rank()
    rows = [r for s in common.sizes_of(args, SIZES, QUICK) for r in one_size(s, args)]
    common.print_table(
        f"lm: TinyGPT (vocab {VOCAB}, dim {DIM}, {HEADS} heads, {LAYERS} layers), "
        f"{_steps(args)} SGD steps on one sequence, {ctx.world_size} {ctx.backend} ranks on "
        f"{ctx.device.type}; "
        "loss curves checked against 1 device",
        COLUMNS,
        rows,
    )
    last = [r for r in rows if r["seq"] == rows[-1]["seq"]]
    steps = list(range(1, len(last[0]["losses"]) + 1))
    common.save_plot(
        os.path.join(args.out, "lm.png"),
        f"TinyGPT, S = {last[0]['seq']}, {ctx.world_size} ranks",
        "training step",
        [("loss", {r["config"]: (steps, r["losses"]) for r in last})],
    )
    return rows
