"""Sharded cross-entropy against single-device torch (float64): forward, input gradient,
collective counts and bytes, the cases torch's ``loss_parallel`` gets wrong, bad input."""

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import shardlab
from shardlab import ShardTensor, distribute, this_rank
from shardlab.layout import ShardLayout, moves
from tests.tensor._cases import block, sizes_for

F64 = torch.float64


def _mesh(mesh_shape):
    from shardlab import this_rank

    return this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)


def _target_layout(layout, probs):
    """How a sharded target must be laid out: like the input, minus the class dim."""
    if probs:
        return layout
    cd = 1 if len(layout.global_shape) > 1 else 0
    places = [
        Shard(p.dim - (p.dim > cd)) if isinstance(p, Shard) and p.dim != cd else Replicate()
        for p in layout.placements
    ]
    shape = layout.global_shape[:cd] + layout.global_shape[cd + 1 :]
    sizes = [s if isinstance(q, Shard) else None for q, s in zip(places, layout.sizes)]
    return ShardLayout(shape, layout.mesh_shape, tuple(places), tuple(sizes))


def _build(sizes):
    return [
        None if e is None else list(e[0]) if len(e) == 1 else [list(s) for s in e] for e in sizes
    ]


def _cols(sizes, me):
    return slice(sum(sizes[:me]), sum(sizes[: me + 1]))


def _random_case(rng, mesh_shape):
    ndim = rng.choice([1, 2, 2, 3, 4, 4])
    shape = [rng.randint(1, 3), rng.randint(1, 7), rng.randint(1, 4), rng.randint(1, 4)][:ndim]
    if ndim == 1:
        shape = [rng.randint(1, 7)]
    cd = 1 if ndim > 1 else 0
    rows = [d for d in range(ndim) if d != cd]
    if len(mesh_shape) == 1:
        dims = [cd] if not rows or rng.random() < 0.6 else [rng.choice(rows)]
    else:
        pick = rng.choice(
            ["class-row", "row-class", "row-row", "class-rep", "row-rep", "class-class"]
        )
        if not rows:
            pick = "class-rep"
        a, b = rng.choice(rows or [None]), rng.choice(rows + [None])
        dims = {
            "class-row": [cd, a],
            "row-class": [a, cd],
            "row-row": [a, b],
            "class-rep": [cd, None],
            "row-rep": [a, None],
            "class-class": [cd, cd],  # gathered along the second mesh dim first
        }[pick]
        if rng.random() < 0.5:
            dims = dims[::-1]
    placements = [Shard(d) if d is not None else Replicate() for d in dims]
    probs = rng.random() < 0.25
    return dict(
        shape=shape,
        placements=placements,
        sizes=sizes_for(rng, shape, mesh_shape, placements),
        probs=probs,
        weight=rng.random() < 0.5,
        ignore=-100 if probs or rng.random() < 0.4 else rng.randrange(shape[cd]),
        reduction=rng.choice(["mean", "mean", "sum", "none"]),
        eps=rng.choice([0.0, 0.0, 0.1, 0.35]),
        target_as=rng.choice(["plain", "sharded", "replicated"]),
    )


def _run_case(cfg, mesh, gen):
    """Forward and backward against torch; returns the forward and backward traces."""
    shape, cd = cfg["shape"], 1 if len(cfg["shape"]) > 1 else 0
    coord = tuple(mesh.get_coordinate())
    g = torch.randn(shape, generator=gen, dtype=F64)
    tshape = shape if cfg["probs"] else shape[:cd] + shape[cd + 1 :]
    if cfg["probs"]:
        t = torch.rand(shape, generator=gen, dtype=F64).softmax(cd)
    else:
        t = torch.randint(0, shape[cd], tshape, generator=gen)
        t.view(-1)[torch.rand(t.numel(), generator=gen) < 0.3] = cfg["ignore"]
    w = torch.rand(shape[cd], generator=gen, dtype=F64) + 0.1 if cfg["weight"] else None
    kw = dict(
        weight=w, ignore_index=cfg["ignore"], reduction=cfg["reduction"], label_smoothing=cfg["eps"]
    )
    xr = g.clone().requires_grad_()
    ref = F.cross_entropy(xr, t, **kw)
    w_out = torch.randn(ref.shape, generator=gen, dtype=F64)
    (ref * w_out).sum().backward()

    layout = ShardLayout.build(shape, tuple(mesh.shape), cfg["placements"], cfg["sizes"])
    local = block(g, layout, coord).clone().requires_grad_()
    st = ShardTensor.from_local(local, mesh, cfg["placements"], cfg["sizes"], shape=shape)
    tl = _target_layout(layout, cfg["probs"])
    if cfg["target_as"] == "sharded":
        t = ShardTensor.from_local(
            block(t, tl, coord), mesh, tl.placements, _build(tl.sizes), shape=tshape
        )
    elif cfg["target_as"] == "replicated":
        t = ShardTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, [None] * mesh.ndim)
    with shardlab.patched(), shardlab.trace(mesh=mesh) as fwd:
        out = F.cross_entropy(st, t, **kw)
    assert isinstance(out, ShardTensor), type(out)
    if cfg["reduction"] == "none":  # sharded like the non-class dims, Replicate for classes
        assert out.sharding == _target_layout(layout, probs=False), (cfg, out.sharding)
    else:
        assert out.ndim == 0 and all(isinstance(p, Replicate) for p in out.placements)
    mine = out.to_local()
    want = ref if cfg["reduction"] != "none" else block(ref, out.sharding, coord)
    assert torch.allclose(mine, want, atol=1e-12, equal_nan=True), (cfg, mine, want)
    with shardlab.trace(mesh=mesh) as bwd:
        dy = w_out if cfg["reduction"] != "none" else block(w_out, out.sharding, coord)
        (mine * dy).sum().backward()
    assert torch.allclose(local.grad, block(xr.grad, layout, coord), atol=1e-12), cfg
    return layout, out, fwd, bwd


def _expected(cfg, layout, coord):
    """Bytes of each all_reduce the module docstring promises on this rank (float64):
    vocab-parallel: (max, fused sums) of 1 and k numbers per local row; sharded rows and
    'sum'/'mean': 3 scalars. A mesh dim of one rank shards nothing (no collective)."""
    cd = 1 if len(cfg["shape"]) > 1 else 0
    cuts = [
        p.dim
        for p, n in zip(layout.placements, layout.mesh_shape)
        if isinstance(p, Shard) and n > 1
    ]
    class_sharded = cd in cuts
    rows_sharded = any(d != cd for d in cuts)
    rows = math.prod(n for d, n in enumerate(layout.local_shape(coord)) if d != cd)
    sizes = []
    if class_sharded and rows:  # a rank without rows skips them, like its class group
        k = 3 if cfg["probs"] or cfg["eps"] else 2
        sizes += [rows * 8, k * rows * 8]
    if rows_sharded and cfg["reduction"] != "none":
        sizes.append(3 * 8)
    return sizes


def _sweep(mesh_shape, cases, seed):
    def body():
        mesh, rng = _mesh(mesh_shape), random.Random(seed)
        coord = tuple(mesh.get_coordinate())
        kinds = set()
        for i in range(cases):
            cfg = _random_case(rng, mesh_shape)
            layout, _, fwd, bwd = _run_case(cfg, mesh, torch.Generator().manual_seed(i))
            nested = (
                len([p for p in cfg["placements"] if p == Shard(1 if len(cfg["shape"]) > 1 else 0)])
                > 1
            )
            if nested:  # the classes gathered along the second mesh dim first, then as cut
                layout = moves.replicated(layout, [1])  # by the first one alone
                fwd = fwd.filter(label="cross_entropy forward")
            sizes, got = _expected(cfg, layout, coord), [e.bytes for e in fwd.events]
            assert set(fwd.counts()) <= {"all_reduce"} and got == sizes, (cfg, got, sizes)
            assert all(e.label == "cross_entropy forward" for e in fwd.events), cfg
            assert len(bwd) == 0, (cfg, bwd.counts())
            kinds.add((len(cfg["shape"]), str(cfg["placements"]), cfg["reduction"]))
        return len(kinds)

    return body


@pytest.mark.parametrize("world,cases", [(1, 30), (2, 30), (3, 30), (4, 30)])
def test_sweep_1d_mesh(ranks_for, world, cases):
    assert min(ranks_for(world).run(_sweep((world,), cases, seed=world))) >= cases // 3


def test_sweep_2d_mesh(ranks_for):
    assert min(ranks_for(4).run(_sweep((2, 2), 50, seed=7))) >= 20


# what torch 2.13's loss_parallel gets wrong (or refuses), exact counts and bytes
NAMED = [
    ("4-D input, H and W > 1", (2, 9, 3, 4), [Shard(1)], [[3, 0, 4, 2]], {}),
    ("weight with ignore_index", (6, 9), [Shard(1)], [[1, 5, 3, 0]], {"weight": True, "ignore": 2}),
    ("label_smoothing", (6, 9), [Shard(1)], [[4, 4, 0, 1]], {"eps": 0.2, "weight": True}),
    ("mean on a 2-D mesh", (5, 9, 3), [Shard(0), Shard(1)], [[3, 2], [7, 2]], {"ignore": 1}),
    (
        "sum, 2-D mesh, rows on mesh dim 1",
        (5, 9, 3),
        [Shard(1), Shard(2)],
        [[2, 7], [1, 2]],
        {"reduction": "sum", "eps": 0.1},
    ),
    (
        "segmentation H x W, uneven",
        (2, 3, 5, 6),
        [Shard(2), Shard(3)],
        [[5, 0], [2, 4]],
        {"weight": True, "ignore": 0},
    ),
]


@pytest.mark.parametrize("case", NAMED, ids=[c[0] for c in NAMED])
def test_named_cases_exact_counts_and_bytes(ranks_for, case):
    _, shape, placements, sizes, extra = case

    def body():
        mesh = _mesh((4,) if len(placements) == 1 else (2, 2))
        coord = tuple(mesh.get_coordinate())
        cfg = dict(
            shape=list(shape),
            placements=placements,
            sizes=sizes,
            probs=False,
            weight=False,
            ignore=-100,
            reduction="mean",
            eps=0.0,
            target_as="plain",
        )
        cfg.update(extra)
        layout, _, fwd, bwd = _run_case(cfg, mesh, torch.Generator().manual_seed(3))
        want = _expected(cfg, layout, coord)
        return fwd.counts(), [e.bytes for e in fwd.events], want, len(bwd)

    for counts, got, want, n_bwd in ranks_for(4).run(body):
        assert got == want and n_bwd == 0, (counts, got, want)
        assert counts.get("all_reduce", 0) == len(want) <= 3


def test_module_backward_float_and_target_grad(ranks_for):
    """nn.CrossEntropyLoss unchanged; loss.backward() on every rank; float(loss); a plain
    probability target that requires grad gets torch's target gradient."""

    def body():
        mesh = this_rank().mesh
        torch.manual_seed(0)
        g, w = torch.randn(4, 10, 3, dtype=F64), torch.rand(10, dtype=F64)
        t = torch.randint(0, 10, (4, 3))
        crit = nn.CrossEntropyLoss(weight=w, ignore_index=3, label_smoothing=0.1)
        xr = g.clone().requires_grad_()
        ref = crit(xr, t)
        ref.backward()
        x = g.clone().requires_grad_()  # x.grad: the full gradient (distribute's backward)
        with shardlab.patched():
            loss = crit(distribute(x, mesh, [Shard(1)], sizes=[4, 1, 0, 5]), t)
        loss.backward()
        ok = [abs(float(loss) - ref.item()) < 1e-12, torch.allclose(loss.full_tensor(), ref)]
        ok.append(torch.allclose(x.grad, xr.grad, atol=1e-12))
        sizes, me = [4, 1, 0, 5], this_rank().rank  # a local leaf: backward sends nothing
        local = g[:, _cols(sizes, me)].clone().requires_grad_()
        with shardlab.patched():
            loss = crit(ShardTensor.from_local(local, mesh, [Shard(1)], sizes), t)
        with shardlab.trace() as bwd:
            loss.backward()
        ok.append(len(bwd) == 0 and torch.allclose(local.grad, xr.grad[:, _cols(sizes, me)]))
        p = torch.rand(4, 10, 3, dtype=F64).softmax(1)
        pr, ps = p.clone().requires_grad_(), p.clone().requires_grad_()
        F.cross_entropy(g, pr, weight=w, label_smoothing=0.3).backward()
        with shardlab.patched():
            st = distribute(g, mesh, [Shard(1)], sizes=[4, 1, 0, 5])
            F.cross_entropy(st, ps, weight=w, label_smoothing=0.3).backward()
        ok.append(torch.allclose(ps.grad, pr.grad, atol=1e-12))
        return ok

    assert ranks_for(4).run(body) == [[True] * 5] * 4


@pytest.mark.parametrize("sizes", [[3, 3, 3], [5, 0, 4]], ids=["even", "uneven"])
def test_log_softmax_then_anything_has_exact_gradients(ranks_for, sizes):
    """log_softmax on class shards through the generic dispatch (gathers, but exact)."""

    def body():
        mesh = this_rank().mesh
        torch.manual_seed(1)
        g, k = torch.randn(4, 9, 2, dtype=F64), torch.randn(4, 9, 2, dtype=F64)
        xr = g.clone().requires_grad_()
        ((F.log_softmax(xr, 1) * k).sum() + F.log_softmax(xr, 1).exp().square().sum()).backward()
        x = g.clone().requires_grad_()
        lp = F.log_softmax(distribute(x, mesh, [Shard(1)], sizes=sizes), 1)
        (
            (lp * distribute(k, mesh, [Shard(1)], sizes=sizes)).sum() + lp.exp().square().sum()
        ).full_tensor().backward()
        return torch.allclose(x.grad, xr.grad, atol=1e-12)

    assert ranks_for(3).run(body) == [True] * 3


BAD = [  # (name, input shape, target maker, kwargs): errors must be torch's own
    ("target batch", (4, 6), lambda: torch.randint(0, 6, (3,)), {}),
    ("target float", (4, 6), lambda: torch.rand(4), {}),
    ("target int32", (4, 6), lambda: torch.randint(0, 6, (4,), dtype=torch.int32), {}),
    ("target spatial", (2, 6, 3, 3), lambda: torch.randint(0, 6, (2, 3, 4)), {}),
    ("probs with ignore_index", (4, 6), lambda: torch.rand(4, 6), {"ignore_index": 1}),
    ("probs as ints", (4, 6), lambda: torch.randint(0, 6, (4, 6)), {}),
    ("weight shape", (4, 6), lambda: torch.randint(0, 6, (4,)), {"weight": torch.rand(5)}),
    ("label_smoothing", (4, 6), lambda: torch.randint(0, 6, (4,)), {"label_smoothing": 1.5}),
    (
        "weight dtype",
        (4, 6),
        lambda: torch.randint(0, 6, (4,)),
        {"weight": torch.rand(6, dtype=F64)},
    ),
    ("reduction", (4, 6), lambda: torch.randint(0, 6, (4,)), {"reduction": "avg"}),
    ("out of bounds", (4, 6), lambda: torch.tensor([0, 1, 6, 2]), {}),
]


def test_bad_input_raises_torchs_own_errors_on_every_rank(ranks_for):
    def body():
        mesh, got = this_rank().mesh, []
        for name, shape, make, kw in BAD:
            x, t = torch.randn(shape), make()
            try:
                F.cross_entropy(x, t, **kw)
                want = None
            except Exception as exc:  # noqa: BLE001
                want = f"{type(exc).__name__}: {exc}"
            try:
                with shardlab.patched():
                    F.cross_entropy(distribute(x, mesh, [Shard(1)], sizes=[1, 5, 0]), t, **kw)
                have = None
            except Exception as exc:  # noqa: BLE001
                have = f"{type(exc).__name__}: {exc}"
            got.append((name, want, have))
        return got

    for got in ranks_for(3).run(body):
        for name, want, have in got:
            assert want is not None and want == have, (name, want, have)


def test_unsupported_layouts_are_clear_errors_on_every_rank(ranks_for):
    def body():
        from shardlab import this_rank

        mesh, errors = this_rank().mesh, []
        x, t = torch.randn(4, 6), torch.randint(0, 6, (4,))
        p = torch.rand(4, 6).softmax(1)
        with shardlab.patched():
            # a Partial input is summed first (as DTensor would): the loss of the sum
            summed = F.cross_entropy(distribute(x, mesh, [Partial()]), t).full_tensor()
            errors.append(torch.allclose(summed, F.cross_entropy(x, t)))
            # targets laid out unlike the logits move to them (only what changes owner)
            for logits, target, ref in (
                (
                    distribute(x, mesh, [Shard(1)], sizes=[2, 2, 2, 0]),
                    distribute(p, mesh, [Shard(1)], sizes=[3, 1, 2, 0]),
                    F.cross_entropy(x, p),
                ),
                (
                    distribute(x, mesh, [Shard(0)], sizes=[1, 1, 1, 1]),
                    distribute(t, mesh, [Shard(0)], sizes=[2, 0, 1, 1]),
                    F.cross_entropy(x, t),
                ),
            ):
                got = F.cross_entropy(logits, target).full_tensor()
                errors.append(torch.allclose(got, ref))
            # the classes cut by both mesh dims: gathered along the second one first
            nested = distribute(x, this_rank().mesh_for((2, 2)), [Shard(1), Shard(1)])
            errors.append(
                torch.allclose(F.cross_entropy(nested, t).full_tensor(), F.cross_entropy(x, t))
            )
            attempts = [
                lambda: F.cross_entropy(
                    distribute(x, mesh, [Shard(1)]),
                    t,
                    weight=distribute(torch.rand(6), mesh, [Shard(0)]),
                ),
            ]
            for attempt in attempts:
                try:
                    attempt()
                    errors.append(None)
                except (NotImplementedError, ValueError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
            # a bad target on rank 2 only, rows sharded, 'mean': every rank raises, none hangs
            bad = torch.tensor([0, 1, 9, 2])
            try:
                F.cross_entropy(distribute(x, mesh, [Shard(0)], sizes=[1, 1, 1, 1]), bad)
                errors.append(None)
            except IndexError as exc:
                errors.append(f"IndexError: {exc}")
        return errors

    for errors in ranks_for(4).run(body):
        assert errors[:4] == [True] * 4 and None not in errors, errors
        assert "weight" in errors[4]
        assert errors[5].startswith("IndexError")
    assert ranks_for(4).run(lambda: 1) == [1] * 4  # the pool is healthy afterwards
