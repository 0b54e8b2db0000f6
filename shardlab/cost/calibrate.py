"""Calibrate a cost model on the ranks at hand: time a few sizes of each kind of message,
fit ``α`` and ``β`` per kind."""

from __future__ import annotations

import os

from shardlab.cost.formulas import ALGORITHMS
from shardlab.cost.model import CostModel, fit_model
from shardlab.cost.pairing import messages

__all__ = ["DEFAULT_KINDS", "DEFAULT_SIZES", "calibrate", "calibration_samples"]

DEFAULT_KINDS = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DEFAULT_SIZES = (16, 256, 4096, 65536, 1 << 20)  # bytes of Event.bytes: 16 B .. 1 MiB
_LABEL = "cost.calibrate"


def _one_message(kind: str, nbytes: int):
    """A function sending one message of ``kind`` whose ``Event.bytes`` is about
    ``nbytes`` (float32; a multiple of the group size where the kind cuts it in p)."""
    import torch
    import torch.distributed as dist

    p, me = dist.get_world_size(), dist.get_rank()
    numel = max(nbytes // 4, 1)
    if kind in ("reduce_scatter", "all_to_all"):
        numel = -(-numel // p) * p
    x = torch.ones(numel)
    if kind == "p2p":  # a halo exchange on a line: both ways with each neighbour at once
        peers = [q for q in (me - 1, me + 1) if 0 <= q < p]
        bufs = [torch.empty(numel) for _ in peers]

        def exchange():
            ops = [dist.P2POp(dist.isend, x, q) for q in peers]
            ops += [dist.P2POp(dist.irecv, b, q) for q, b in zip(peers, bufs)]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

        return exchange
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if kind == "all_gather":
        out = torch.empty(numel * p)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, x)
    if kind == "reduce_scatter":
        out = torch.empty(numel // p)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, x)
    if kind == "all_to_all":
        out = torch.empty(numel)
        return lambda: dist.all_to_all_single(out, x)
    raise ValueError(f"kinds: {kind!r} cannot be calibrated (known: {', '.join(DEFAULT_KINDS)})")


def _compute(seconds: float) -> None:
    """Work for ``seconds``: small matrix products (one thread's worth), as a step does."""
    import time

    import torch

    a = torch.ones(64, 64)
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        torch.mm(a, a)


def _calibration_events(kinds, sizes, repeats, between=0.0) -> list:
    """On every rank: the traced messages of the calibration (this rank's events)."""
    import torch.distributed as dist

    from shardlab.trace import label, trace

    with trace() as t:
        for kind in kinds:
            for nbytes in sizes:
                send = _one_message(kind, nbytes)
                with label(_LABEL, "warm-up"):
                    send()
                for _ in range(repeats):
                    dist.barrier()  # everyone posts at about the same time
                    if between:
                        _compute(between)
                    with label(_LABEL, kind):
                        send()
    return [e for e in t.events if e.label.startswith(f"{_LABEL} ") and "warm-up" not in e.label]


def calibration_samples(events) -> dict[str, list]:
    """family -> ``[(Event.bytes, group size, measured seconds), ...]``, one per message of
    the calibration's ``events`` (every rank's), timed as
    :meth:`~shardlab.cost.Message.measured` times a trace's messages."""
    samples: dict[str, list] = {}
    for m in messages(events)[0]:
        t = m.measured()
        if t is not None and t > 0:
            samples.setdefault(m.kind, []).append((m.nbytes, m.p, t))
    return samples


def calibrate(
    ranks=None,
    *,
    kinds=DEFAULT_KINDS,
    sizes=DEFAULT_SIZES,
    repeats: int = 5,
    algorithms: dict | None = None,
    between: float = 0.0,
) -> CostModel:
    """Measure the ranks at hand and fit a :class:`~shardlab.cost.CostModel` to them.

    Args:
        ranks: a :class:`shardlab.Ranks` pool (called from the kernel that owns it), or
            None on the ranks themselves (every rank calls it; each gets the same model).
        kinds: what to time: ``"p2p"`` (a halo exchange: every rank sends to and receives
            from its neighbours on a line, at once), ``"all_reduce"``, ``"all_gather"``,
            ``"reduce_scatter"``, ``"all_to_all"``, ``"broadcast"``. ``"p2p"`` is always
            timed: a kind not timed is costed with its link.
        sizes: payloads in bytes (``Event.bytes``: one rank's shard for an all-gather).
        repeats: timed repeats of each size (the median counts), after one warm-up.
        algorithms: family -> algorithm whose formula the times are fitted to
            (``{"all_reduce": "tree"}``); default the ring.
        between: seconds every rank computes (small matrix products) before each timed
            message, as a training step computes between its messages. 0 (default): a tight
            loop, the links' best case. Ranks that share CPU cores with each other and with
            gloo's threads pay for compute before a message: the threads that carry it must
            be scheduled again (on 2 cores, a 4 KiB exchange took 0.15 ms in a tight loop
            and 1.1 ms after 3 ms of compute). ``between`` set to a step's typical gap
            between its messages (:func:`~shardlab.cost.gaps`) calibrates for that.

    Steps:

    1. on every rank, under :func:`shardlab.trace`: for each kind and size, one warm-up,
       then ``repeats`` times a barrier, ``between`` seconds of compute, and the message;
    2. the ranks' events paired into messages, each timed from its last participant's post
       to its completion (``shardlab/cost/pairing.py``: as :func:`predict` times a step);
    3. per kind, the median of the repeats of each size, and ``α``, ``β`` fitted to them
       (:func:`~shardlab.cost.fit_link`: least squares, relative, ``α, β >= 0``).

    With the default 6 kinds and 5 sizes: 180 timed messages, a few seconds on 2 to 4 gloo
    ranks.

    Communicates:
        Every message it times; on the ranks (``ranks=None``), an ``all_gather_object``
        of the events at the end.
    """
    import torch.distributed as dist

    kinds = tuple(dict.fromkeys(("p2p", *kinds)))
    for kind in kinds:
        if kind not in DEFAULT_KINDS:
            raise ValueError(f"kinds: {kind!r} cannot be calibrated "
                             f"(known: {', '.join(DEFAULT_KINDS)})")  # fmt: skip
    sizes = tuple(int(s) for s in sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes: payloads of at least 1 byte, got {sizes}")
    if repeats < 1:
        raise ValueError(f"repeats: at least 1, got {repeats}")
    if not between >= 0:
        raise ValueError(f"between: seconds >= 0, got {between}")
    algorithms = dict(algorithms or {})
    for fam, algorithm in algorithms.items():
        if algorithm not in ALGORITHMS.get(fam, ()):
            raise ValueError(f"algorithms: {fam!r}: {algorithm!r} is not one of "
                             f"{ALGORITHMS.get(fam, ())}")  # fmt: skip
    if ranks is not None:
        world, backend = ranks.world_size, ranks.backend
        if world < 2:
            raise ValueError("ranks: calibrating messages needs 2 ranks or more")
        every = ranks.run(_calibration_events, kinds, sizes, repeats, between)
        events = [e for evs in every for e in evs]
    elif dist.is_available() and dist.is_initialized():
        world, backend = dist.get_world_size(), dist.get_backend()
        if world < 2:
            raise ValueError("calibrate: messages need 2 ranks or more")
        mine = _calibration_events(kinds, sizes, repeats, between)
        every = [None] * world
        dist.all_gather_object(every, mine)
        events = [e for evs in every for e in evs]
    else:
        raise ValueError("ranks: pass a shardlab.Ranks pool, or call calibrate() on every rank")
    where = f"{world} {backend} ranks on {os.cpu_count()} CPU cores"
    where += f", {between * 1e3:g} ms of compute before each message" if between else ""
    return fit_model(calibration_samples(events), algorithms, where)
