"""The decision cache (``shardlab/engine/decisions.py``): a replayed decision gives what
the full path gives (values, layouts, strides, messages), every part of the signature
is in the key, and the table is bounded."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

OPS = [
    lambda a, b: a + b,
    lambda a, b: a * b - 1.5,
    lambda a, b: torch.where(a > 0, a, b),
    lambda a, b: torch.nn.functional.gelu(a) / (b.abs() + 1),
    lambda a, b: a.clamp(-0.5, 0.5) + b.exp(),
    lambda a, b: (a + 2).to(torch.float64) * b.double(),
    lambda a, b: a.sigmoid() * b[..., :1],  # broadcasting a plain-shaped slice
    lambda a, b: a.transpose(0, 2).permute(2, 1, 0) + b.transpose(0, 1).transpose(0, 1),
    lambda a, b: a @ b.transpose(-1, -2),  # bmm: its operands move first
    lambda a, b: (a.flatten(0, 1) @ b[0].T.contiguous()).t(),  # mm
    lambda a, b: a.sum(-1) + b.sum(2, keepdim=True)[..., 0],  # reductions: uncut dims
    lambda a, b: a.sum(1) * 2 + b.sum(),  # a cut dim: a Partial sum, then reduced
    lambda a, b: a.sum((0, 2), keepdim=True, dtype=torch.float64),
    lambda a, b: a.mean(-1) - b.mean(2) + a.mean(1).sum(),  # over a cut dim: sum / count
    lambda a, b: a.softmax(-1) * b.log_softmax(2),
    lambda a, b: a.softmax(1) + b.softmax(0),  # cut: torch's decomposition
    lambda a, b: torch.flip(a, [2]) + a.cumsum(-1) - b.cumsum(1),
    lambda a, b: (
        F.layer_norm(a, a.shape[-1:], b.sum((0, 1)), b[:1].sum((0, 1)))
        + F.layer_norm(b, b.shape[1:])
    ),
    lambda a, b: (  # named tuples (torch.return_types): kept like tuples
        torch.sort(a, -1).values + torch.topk(b, 1, 0).values + torch.var_mean(a, -1)[1][..., None]
    ),
    lambda a, b: (  # views: each block viewed as it is (a cut dim merged too)
        a.reshape(a.shape[0], a.shape[1] * a.shape[2]).sum(-1)
        + b.unsqueeze(0).squeeze(0).sum((1, 2))
        + a.view(a.shape[0], a.shape[1], a.shape[2], 1).sum((1, 2, 3))
    ),
    lambda a, b: (  # cat: along an uncut dim (blocks as they are), along the cut one
        torch.cat([a, a * 2, b], -1)[..., :1] + torch.cat([b, a], 1)[:, : a.shape[1]]
    ),
    lambda a, b: (  # slices of the cut dim and of the others, expand: kept per rank
        a[:, 1:6:2, :2].sum(1, keepdim=True).expand(-1, 3, -1)
        + b[:, :, -2:].sum(1, keepdim=True) * a[..., -1:].sum(1, keepdim=True)
    ),
    lambda a, b: (  # torch decomposes addmm, matmul and reshape-as-copy: kept as such
        torch.addmm(a.sum(1)[:, :1].expand(-1, 3), b.sum(1), torch.ones(a.shape[2], 3))
        + a.transpose(1, 2).reshape(a.shape[0], -1).sum(-1, keepdim=True)
    ),
    # dot decomposes into ops with decisions of their own: none of them is dot's
    lambda a, b: torch.dot(a.flatten(), b.flatten()) + a.transpose(0, 1).sum(),
    # in place: the first argument written and returned (a Partial one reduced first)
    lambda a, b: a.clone().add_(b).mul_(2).sub_(b[..., :1], alpha=0.5).clamp_(-1, 1),
    lambda a, b: _written_through_views(a.clone()),
]


def _written_through_views(c):
    """In-place ops on views of ``c`` (one that merges the cut dim: a copy written back)."""
    c.transpose(0, 2).mul_(2)
    c.view(c.shape[0], -1).add_(1)
    c[:, :, :1].neg_()
    return c


def _body(seed):
    def body():
        from torch.distributed.tensor import Partial, Replicate, Shard

        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.engine import decisions
        from tests.tensor._cases import random_sizes

        mesh = this_rank().mesh
        rng = random.Random(seed)
        bad = []
        for i, op in enumerate(OPS):
            shape = (rng.randint(1, 5), rng.randint(0, 7), rng.randint(1, 4))
            g = torch.Generator().manual_seed(seed * 100 + i)
            x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            want = op(x, y)
            places = rng.choice([[Shard(1)], [Shard(0)], [Replicate()], [Partial()]])
            dx = places[0].dim if isinstance(places[0], Shard) else None
            sx = None if dx is None else [random_sizes(rng, shape[dx], mesh.size())]
            a = distribute(x, mesh, places, sx)
            b = distribute(y, mesh, [Shard(1)], [random_sizes(rng, shape[1], mesh.size())])
            if rng.random() < 0.5:
                b = y  # a plain tensor next to a ShardTensor
            results = []
            for _ in range(3):  # a miss, then hits
                with shardlab.trace() as t:
                    out = op(a, b)
                results.append((out, t.counts(), t.bytes(kind="send")))
            for out, counts, sent in results:
                full = out.full_tensor()
                if not (torch.allclose(full, want, atol=1e-6) and full.dtype == want.dtype):
                    bad.append((i, "values"))
                if out.stride() != results[0][0].stride() or out.sharding != results[0][0].sharding:
                    bad.append((i, "layout"))
                if (counts, sent) != results[0][1:]:
                    bad.append((i, "messages", counts, results[0][1]))
        return bad, len(decisions._TABLE) > 0

    return body


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_replayed_decisions_equal_the_full_path_and_torch(ranks_for, world, seed):
    for bad, cached in ranks_for(world).run(_body(world * 10 + seed)):
        assert bad == [] and cached


def test_every_part_of_the_signature_is_in_the_key(ranks_for):
    """Changing one part of a call (a size, a dtype, a placement, strides, a scalar's
    type, requires_grad, the mesh, a list of dims) misses; repeating it hits and adds
    nothing."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank
        from shardlab.engine import decisions, dispatch
        from tests.tensor._cases import key_variants

        mesh = this_rank().mesh
        other = this_rank().mesh_for((2,), names=("other",))
        g = torch.randn(2, 6, 4)
        base = distribute(g, mesh, [Shard(1)], [[4, 2]])
        variants = {
            **key_variants(g, mesh, distribute),
            "requires_grad": distribute(g, mesh, [Shard(1)], [[4, 2]]).requires_grad_(),
            "mesh": distribute(g, other, [Shard(1)], [[4, 2]]),
        }
        decisions.clear()
        torch.ops.aten.mul.Tensor(base, 2)
        n0 = len(decisions._TABLE)
        torch.ops.aten.mul.Tensor(base, 2)
        seen = {"repeat adds nothing": len(decisions._TABLE) == n0 == 1}
        for name, v in variants.items():
            before = len(decisions._TABLE)
            out = torch.ops.aten.mul.Tensor(v, 2)
            seen[name] = len(decisions._TABLE) == before + 1 and torch.equal(
                out.full_tensor(), v.full_tensor() * 2
            )
        before = len(decisions._TABLE)
        out = torch.ops.aten.mul.Tensor(base, 2.0)  # a float scalar: float result rules
        seen["scalar type"] = len(decisions._TABLE) == before + 1
        out = torch.ops.aten.mul.Tensor(base, True)
        seen["bool scalar"] = len(decisions._TABLE) == before + 2 and out.dtype == torch.float32
        before = len(decisions._TABLE)  # a list of ints (dims, sizes): by its values
        for dims in ([0], [0], [2], [0, 2]):
            out = torch.ops.aten.sum.dim_IntList(base, dims)
        seen["int list"] = len(decisions._TABLE) == before + 3 and torch.allclose(
            out.full_tensor(), g.sum([0, 2])
        )
        before = len(decisions._TABLE)  # a list of tensors (cat's): each one's signature
        torch.ops.aten.cat.default([base, base], 2)
        torch.ops.aten.cat.default([base, base], 2)
        seen["tensor list repeat"] = len(decisions._TABLE) == before + 1
        cat = torch.ops.aten.cat.default
        key = dispatch.signature(cat, ([base, base], 2), {})
        for name in ("sizes", "dtype", "placement", "strides", "requires_grad"):
            other = dispatch.signature(cat, ([base, variants[name]], 2), {})
            out = cat([base, variants[name]], 2)
            seen[f"tensor list {name}"] = other != key and torch.equal(
                out.full_tensor(), torch.cat([g, variants[name].full_tensor()], 2)
            )
        return seen

    for seen in ranks_for(2).run(body):
        assert all(seen.values()), seen


def test_the_table_is_bounded_and_does_not_grow_in_a_loop(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank
        from shardlab.engine import decisions

        mesh = this_rank().mesh
        decisions.clear()
        a = distribute(torch.randn(3, 8), mesh, [Shard(1)], [[5, 3]])
        for _ in range(200):  # a training loop: the same signatures again and again
            a = (a * 0.5 + 1).relu()
        steady = len(decisions._TABLE)
        old, decisions.SIZE = decisions.SIZE, 16
        try:
            for n in range(40):  # new shapes every time: the oldest go
                torch.ops.aten.add.Tensor(distribute(torch.randn(n + 1), mesh, [Shard(0)]), 1)
            bounded = len(decisions._TABLE) <= 16
        finally:
            decisions.SIZE = old
        return steady, bounded

    for steady, bounded in ranks_for(2).run(body):
        assert steady <= 6 and bounded


def test_a_kept_view_of_blocks_that_cannot_be_viewed_decides_in_full(ranks_for):
    """Same signature (the global strides are contiguous both times), but the second
    tensor's blocks are transposed in memory: the kept view raises, the full path copies,
    and the result still equals torch."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import ShardTensor, this_rank
        from shardlab.engine import decisions, dispatch

        mesh = this_rank().mesh
        me = mesh.get_local_rank()
        g = torch.arange(5.0 * 6).reshape(5, 6)
        block = g[:3] if me == 0 else g[3:]  # 3 and 2 rows
        flat = ShardTensor.from_local(block.clone(), mesh, [Shard(0)])
        first = flat.view(-1).full_tensor()
        odd = ShardTensor.from_local(block.t().contiguous().t(), mesh, [Shard(0)])
        assert odd.to_local().stride() != flat.to_local().stride()
        key = dispatch.signature(torch.ops.aten.view.default, (odd, [-1]), {})
        kept = decisions.lookup(key) is not None  # the first view's decision applies
        second = odd.view(-1).full_tensor()
        return kept, torch.equal(first, g.view(-1)), torch.equal(second, g.view(-1))

    for ok in ranks_for(2).run(body):
        assert all(ok), ok


def test_a_kept_view_of_a_fake_block_that_cannot_be_viewed_decides_in_full():
    """The same rule on fake blocks, without a process group: torch's meta for ``view``
    raises ``ValueError`` there (``RuntimeError`` on real blocks), and either means the
    full path. BLOOM failed to compile with inductor on 2 ranks: inductor runs the
    graph again on fake blocks, where the kept view of its transposed keys raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlab.engine import plans

    view = plans.LocalView((4, 9, 8))
    with FakeTensorMode():
        fake = torch.empty(2, 9, 2, 8).transpose(1, 2)  # (2, 2, 9, 8), strides (144, 8, 16, 1)
        with pytest.raises(plans.Stale):
            view([fake], {})
        assert view([torch.empty(2, 2, 9, 8)], {}).shape == (4, 9, 8)
    with pytest.raises(plans.Stale):
        view([torch.empty(2, 9, 2, 8).transpose(1, 2)], {})


def test_a_kept_decision_follows_the_default_dtype(ranks_for):
    """``int * 0.5`` takes its dtype from torch's default dtype, which is not in the key:
    after the default changes, the kept decision does not apply and the op decides anew."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank
        from shardlab.engine import decisions

        mesh = this_rank().mesh
        ints = distribute(torch.arange(10).reshape(2, 5), mesh, [Shard(1)], [[3, 2]])
        half = torch.ops.aten.mul.Tensor
        decisions.clear()
        first = half(ints, 0.5)
        half(ints, 0.5)
        kept = len(decisions._TABLE) == 1  # decided once, then replayed
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            second = half(ints, 0.5)
            want = torch.arange(10).reshape(2, 5) * 0.5
        finally:
            torch.set_default_dtype(old)
        return (
            kept,
            first.dtype == torch.float32,
            second.dtype == second.to_local().dtype == want.dtype == torch.float64,
            second._spec.tensor_meta.dtype == torch.float64,  # what DTensor's code reads
            torch.equal(second.full_tensor(), want),
        )

    for ok in ranks_for(2).run(body):
        assert all(ok), ok


def _training_body(seed):
    """Forward and backward through the ops whose rules keep their own decisions with
    moves or per-rank work: embedding and its dense backward, cat with a cache's empty
    tensor, a slice's gradient, fused attention on cut batches, backward's ones_like."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.engine import decisions
        from tests.tensor._cases import random_sizes

        aten = torch.ops.aten
        mesh = this_rank().mesh
        rng = random.Random(seed)
        n = mesh.size()
        b, s, d, vocab = rng.randint(1, 3), rng.randint(1, 7), 4, 11
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (b, s), generator=g)
        w0 = torch.randn(vocab, d, dtype=torch.float64, generator=g)
        q0 = torch.randn(b, 2, 5, d, dtype=torch.float64, generator=g)
        mask = torch.randn(b, 1, 5, 5, dtype=torch.float64, generator=g)

        def step(ids, w, q):
            e = F.embedding(ids, w)  # (B, S, D)
            h = torch.cat([e.new_empty(0), e * 2], 2)  # a cache's first step
            y = h[:, 1:, :3].sum() + h[:, :, -1:].pow(2).sum()  # slice_backward twice
            att = F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=mask)  # fused
            # (on whole rows; the plain mask is cut like the batch: each rank's slice)
            return y + att.pow(2).sum()

        w, q = w0.clone().requires_grad_(), q0.clone().requires_grad_()
        step(ids, w, q).backward()
        want = (step(ids, w0, q0).detach(), w.grad, q.grad)
        sid = random_sizes(rng, s, n)
        sq = random_sizes(rng, b, n)
        bad, events = [], []
        decisions.clear()
        for i in range(3):  # a miss, then hits
            w, qg = w0.clone().requires_grad_(), q0.clone().requires_grad_()
            st_ids = distribute(ids, mesh, [Shard(1)], [sid])
            q = distribute(qg, mesh, [Shard(0)], [sq])
            with shardlab.trace() as t:
                loss = step(st_ids, w, q)
                loss.backward()
            events.append((t.counts(), t.bytes(kind="send")))
            got = (loss.full_tensor().detach(), w.grad, qg.grad)
            for name, x, y in zip(("loss", "weight grad", "q grad"), got, want):
                if not torch.allclose(x, y, atol=1e-12):
                    bad.append((i, name))
            if events[-1] != events[0]:
                bad.append((i, "messages", events[-1], events[0]))
        kept = {k[0] for k in decisions._TABLE}
        ops = [aten.embedding.default, aten.embedding_dense_backward.default, aten.cat.default,
               aten.slice_backward.default, aten.ones_like.default]  # fmt: skip
        if q.to_local().numel():  # a rank with no rows runs no kernel: it decides every time
            ops += [
                aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            ]
        missing = [str(op) for op in ops if id(op) not in kept]
        return bad, missing

    return body


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_kept_decisions_in_a_training_step_equal_torch(ranks_for, world, seed):
    for bad, missing in ranks_for(world).run(_training_body(world * 10 + seed)):
        assert bad == [] and missing == [], (bad, missing)


@pytest.mark.parametrize("world", [1, 2])
def test_whole_blocks_keep_decisions_without_moves(ranks_for, world):
    """Every rank holding the whole tensor (one rank; Shard only on a mesh dim of one rank,
    Replicate on the other): each decision is kept as torch's call on the blocks as they
    are (no move, also for a plain tensor aligned to the layout, a select of the cut dim,
    a cat of Replicate and Shard), and replays equal torch."""

    def body():
        from torch.distributed.tensor import Replicate, Shard

        from shardlab import distribute, this_rank
        from shardlab.engine import decisions, plans

        n = this_rank().world_size
        mesh = this_rank().mesh if n == 1 else this_rank().mesh_for((n, 1))
        places = [Shard(1)] if n == 1 else [Replicate(), Shard(1)]
        g = torch.Generator().manual_seed(4)
        x0 = torch.randn(2, 6, 4, generator=g)
        cos = torch.randn(1, 6, 4, generator=g)
        x = distribute(x0, mesh, places)
        r = distribute(x0[:, :1], mesh, [Replicate()] * mesh.ndim)

        def ops(x, r):
            return [
                x * cos + cos,
                torch.cat([r, x], 1),
                x[:, 0] + x.select(1, 5),
                x.view(2, 24).sum(-1),
                x.cumsum(1) + x.max(1, keepdim=True).values,
            ]

        want = ops(x0, x0[:, :1])
        decisions.clear()
        got = [ops(x, r) for _ in range(3)]
        kept = [d for d in decisions._TABLE.values() if isinstance(d, plans.LocalCall)]
        equal = all(
            torch.allclose(a.full_tensor(), b, atol=1e-6) for run in got for a, b in zip(run, want)
        )
        return equal, len(kept) > 0, [d.moves for d in kept if not (d.still or d.lists)]

    for equal, kept, moved in ranks_for(world).run(body):
        assert equal and kept and moved == [], moved


def test_every_id_in_a_kept_key_names_an_object_its_decision_holds(ranks_for):
    """Keys name the op, specs and layouts by ``id``: each kept decision (aten's table and
    the no-grad table) holds every object its key names, so no id in a kept key can be
    reused by another object while the key is there."""

    def body():
        import gc

        from torch.distributed.tensor import Replicate, Shard

        from shardlab import ShardTensor, distribute, this_rank
        from shardlab.engine import decisions, nograd

        mesh = this_rank().mesh
        decisions.clear()
        for _ in range(3):  # tensors made and dropped: their specs and layouts too
            a = distribute(torch.randn(3, 7, 2), mesh, [Shard(1)], [[5, 2]])
            r = distribute(torch.randn(2), mesh, [Replicate()])
            with torch.no_grad():
                for _ in range(3):
                    torch.cat([a * 2, a], -1).sum(-1).softmax(-1).transpose(0, 1) + r[0]
            (a.requires_grad_() * r).sum().backward()
            del a, r
            gc.collect()
        missing = []
        for key, kept in decisions._TABLE.items():
            held = {id(o) for o in kept.anchors}
            for part in key[1:]:
                for item in part if type(part) is tuple and part[:1] == (list,) else (part,):
                    if type(item) is tuple and item[:1] == (ShardTensor,):
                        missing += [i for i in item[1:3] if i not in held]
        for key, kept in nograd.TABLE.items():
            if type(kept) is nograd._Replay:
                held = {id(o) for o in kept.anchors}
                ids = [key[i + 1] for i, k in enumerate(key) if k is ShardTensor]
                ids += [key[i + 2] for i, k in enumerate(key) if k is ShardTensor]
                missing += [i for i in ids if i not in held]
        return missing, len(decisions._TABLE), len(nograd.TABLE)

    for missing, n, m in ranks_for(2).run(body):
        assert missing == [] and n > 0 and m > 0, (missing, n, m)
