"""Ops on uneven ShardTensors equal single-device torch, forward and backward."""

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from shardlab import ShardTensor, distribute, this_rank
from tests.tensor._cases import random_sizes

# (name, fn(x) -> tensor, dims of x that fn must not see sharded)
OPS = [
    ("add_mul", lambda x: x * 2 + 1 - x.exp() / 3, ()),
    ("broadcast", lambda x: x * torch.arange(x.shape[-1], dtype=x.dtype), ()),
    ("sum_all", lambda x: x.sum(), ()),
    ("sum_dim0", lambda x: x.sum(0), ()),
    ("sum_last", lambda x: x.sum(-1, keepdim=True), ()),
    ("mean_all", lambda x: x.mean(), ()),
    ("mean_dim0", lambda x: x.mean(0), ()),
    ("mean_last", lambda x: x.mean(-1), ()),
    ("max_all", lambda x: x.amax(), ()),
    ("min_dim0", lambda x: x.amin(0), ()),
    ("max_last", lambda x: x.amax(-1), ()),
    ("softmax_last", lambda x: x.softmax(-1), (-1,)),
    ("log_softmax_last", lambda x: F.log_softmax(x, -1), (-1,)),
    ("view_last", lambda x: x.view(*x.shape[:-1], 2, x.shape[-1] // 2), (-1,)),
    ("reshape_last", lambda x: x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), (-1,)),
    ("slice_last", lambda x: x[..., 1:3], (-1,)),
    ("transpose_flatten", lambda x: x.transpose(1, 2).flatten(-2) + 1, (-1, -2)),
    ("unflatten_flatten", lambda x: x.unflatten(-1, (2, 2)).flatten(-2) * 2, (-1,)),
    ("select_last", lambda x: x[..., 1], (-1,)),
    ("matmul_replicated", None, (-1,)),  # x @ W with W replicated
    ("linear", None, (-1,)),
    ("layer_norm", None, (-1,)),
]


def _apply(name, fn, x, params):
    if name == "matmul_replicated":
        return x @ params["w"]
    if name == "linear":
        return F.linear(x, params["w"].t(), params["b"])
    if name == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), params["g"], params["b"])
    return fn(x)


def _body(world, cases, seed):
    def body():
        mesh = this_rank().mesh
        rng = random.Random(seed)
        done = []
        for i in range(cases):
            name, fn, protected = OPS[i % len(OPS)]
            shape = [rng.randint(1, 5), rng.randint(1, 6), 4]  # empty *shards* come from sizes
            if name in ("max_all", "min_dim0"):
                shape[1] = max(shape[1], 1)  # a max over nothing is an error in torch too
            dims = [d for d in range(3) if d - 3 not in protected]
            d = rng.choice(dims)
            sizes = random_sizes(rng, shape[d], world)
            gen = torch.Generator().manual_seed(i)
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            params = {
                "w": torch.randn(4, 4, generator=gen, dtype=torch.float64, requires_grad=True),
                "b": torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True),
                "g": torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True),
            }
            ref_x = g.clone().requires_grad_()
            ref = _apply(name, fn, ref_x, params)
            w_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            (ref * w_out).sum().backward()
            ref_grads = {k: v.grad.clone() for k, v in params.items() if v.grad is not None}
            for v in params.values():
                v.grad = None
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, [Shard(d)], sizes=sizes)
            sp = {k: distribute(v, mesh, [Replicate()]) for k, v in params.items()}
            out = _apply(name, fn, st, sp)
            assert isinstance(out, ShardTensor), (name, type(out))
            full = out.full_tensor()
            assert torch.allclose(full, ref, atol=1e-12), (name, d, sizes)
            this_rank().ns["last"] = (name, d, sizes, shape)
            (full * w_out).sum().backward()
            assert torch.allclose(x.grad, ref_x.grad, atol=1e-12), (name, d, sizes)
            for k, v in ref_grads.items():
                got = sp[k].grad
                got = got.full_tensor() if isinstance(got, ShardTensor) else params[k].grad
                assert torch.allclose(got, v, atol=1e-12), (name, k, d, sizes)
            done.append(name)
        return sorted(set(done))

    return body


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ops_match_single_device(ranks_for, world):
    got = ranks_for(world).run(_body(world, 3 * len(OPS), seed=world))
    assert got[0] == sorted(name for name, _, _ in OPS)


def test_ops_needing_a_gather_redistribute_exactly(ranks_for):
    """softmax over the sharded dim: the input is gathered with its true sizes first."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        st = distribute(g, mesh, [Shard(0)], sizes=[4, 2, 1])
        return torch.allclose(st.softmax(0).full_tensor(), g.softmax(0))

    assert ranks_for(3).run(body) == [True] * 3


def test_views_merging_uneven_sharded_dims_move_nothing(ranks_for):
    """(7, 4) cut [4, 2, 1] on dim 0: view(28) is a block layout (sizes x 4), view(4, 7)
    after a transpose is strided; neither moves a byte, and both come back exactly."""

    def body():
        import shardlab

        mesh = this_rank().mesh
        g = torch.randn(7, 4, dtype=torch.float64)
        st = distribute(g, mesh, [Shard(0)], sizes=[4, 2, 1])
        with shardlab.trace() as t:
            flat = st.view(28)
            strided = st.t().reshape(28)
        return (
            t.counts(),
            flat.sharding.sizes_along(0),
            torch.equal(flat.full_tensor(), g.view(28)),
            torch.equal(strided.full_tensor(), g.t().reshape(28)),
        )

    for counts, sizes, a, b in ranks_for(3).run(body):
        assert counts == {} and sizes == (16, 8, 4) and a and b


def test_cat_of_uneven_shards(ranks_for):
    """torch.cat of ShardTensors: along another dim it runs on the blocks; along the
    uneven sharded dim each input moves only the rows that change owner."""

    def body():
        import shardlab

        mesh = this_rank().mesh
        g = torch.randn(7, 4, dtype=torch.float64)
        st = distribute(g, mesh, [Shard(0)], sizes=[4, 2, 1])
        with shardlab.trace() as t:
            side = torch.cat([st, 2 * st], 1)
        ok = torch.equal(side.full_tensor(), torch.cat([g, 2 * g], 1)) and t.counts() == {}
        down = torch.cat([st, 3 * st], 0)
        return (
            ok,
            down.sharding.sizes_along(0),
            torch.equal(down.full_tensor(), torch.cat([g, 3 * g])),
        )

    for ok, sizes, same in ranks_for(3).run(body):
        assert ok and same and sizes == (8, 4, 2)


def test_even_layouts_use_dtensor_and_stay_shardtensors(ranks_for):
    def body():
        mesh = this_rank().mesh
        x = torch.randn(8, 4, dtype=torch.float64)
        st = distribute(x, mesh, [Shard(0)])
        y = (st @ distribute(torch.eye(4, dtype=torch.float64), mesh, [Replicate()])).softmax(0)
        return isinstance(y, ShardTensor), torch.allclose(y.full_tensor(), x.softmax(0))

    assert ranks_for(4).run(body) == [(True, True)] * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_nn_modules_unchanged_on_uneven_sequence_shards(ranks_for, world):
    """Linear -> GELU -> Linear -> LayerNorm on (B, T, C) sharded on T with uneven sizes:
    outputs, input gradient and every parameter gradient (plain tensors) as on one device."""

    def body():
        mesh = this_rank().mesh
        rng = random.Random(world)
        ok = []
        for case in range(4):
            torch.manual_seed(case)
            model = torch.nn.Sequential(
                torch.nn.Linear(6, 8),
                torch.nn.GELU(),
                torch.nn.Linear(8, 6),
                torch.nn.LayerNorm(6),
            ).double()
            t = rng.randint(1, 9)
            g = torch.randn(2, t, 6, dtype=torch.float64)
            x_ref = g.clone().requires_grad_()
            (model(x_ref).square().sum()).backward()
            ref = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, [Shard(1)], sizes=random_sizes(rng, t, world))
            out = model(st)
            assert isinstance(out, ShardTensor)
            if t >= world:  # (DTensor replicates dims shorter than the mesh; still exact)
                assert out.sharding.sizes == st.sharding.sizes
            out.square().sum().full_tensor().backward()
            assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
            for p, r in zip(model.parameters(), ref):
                assert type(p.grad) is torch.Tensor and torch.allclose(p.grad, r, atol=1e-12)
            ok.append(True)
        return len(ok)

    assert ranks_for(world).run(body) == [4] * world


def test_full_tensor_with_partial_gradients(ranks_for):
    """Each rank uses the full tensor differently: grad_placements=[Partial()] sums them."""

    def body():
        from torch.distributed.tensor import Partial

        mesh = this_rank().mesh
        me, n = this_rank().rank, this_rank().world_size
        g = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x = g.clone().requires_grad_()
        st = distribute(x, mesh, [Shard(0)], sizes=random_sizes(random.Random(n), 5, n))
        full = st.full_tensor(grad_placements=[Partial()])
        (full * (me + 1)).sum().backward()  # rank r's loss weighs the tensor by r + 1
        return torch.allclose(x.grad, torch.full_like(g, n * (n + 1) / 2))

    assert ranks_for(3).run(body) == [True] * 3


def test_inputs_with_different_uneven_sizes_are_aligned(ranks_for):
    """cat and + of tensors sharded alike but with different sizes (a U-Net skip)."""

    def body():
        mesh = this_rank().mesh
        torch.manual_seed(0)
        a = torch.randn(2, 3, 9, 4, dtype=torch.float64, requires_grad=True)
        b = torch.randn(2, 5, 9, 4, dtype=torch.float64, requires_grad=True)
        sa = distribute(a, mesh, [Shard(2)], [[4, 0, 5]])
        sb = distribute(b, mesh, [Shard(2)], [[3, 3, 3]])
        c, d = torch.cat([sa, sb], 1), sa + sb[:, :3]
        assert c.sharding.sizes == sb.sharding.sizes  # the smaller input moves
        (c.sum() + d.square().sum()).full_tensor().backward()
        ra, rb = (t.detach().clone().requires_grad_() for t in (a, b))
        cr, dr = torch.cat([ra, rb], 1), ra + rb[:, :3]
        (cr.sum() + dr.square().sum()).backward()
        return (
            torch.allclose(c.full_tensor(), cr)
            and torch.allclose(d.full_tensor(), dr)
            and torch.allclose(a.grad, ra.grad)
            and torch.allclose(b.grad, rb.grad)
        )

    assert ranks_for(3).run(body) == [True] * 3


def test_integer_indexing_and_its_gradient_stay_local(ranks_for):
    """``x[:, :, idx]`` (Falcon's query/key/value split) and its gradient, ``index_put``
    into zeros, with the sequence cut unevenly: exact, and no message at all (the zeros
    are cut like the values, for free); ``index_put`` itself on a cut x and on a whole x
    with cut values. Indices in front, adjacent or not."""

    def body():
        from shardlab.trace import trace

        mesh, n = this_rank().mesh, this_rank().world_size
        rng = random.Random(5)
        res = []
        for case in range(8):
            shape = (2, 9, 6, 4)
            sizes = random_sizes(rng, shape[1], n)
            gen = torch.Generator().manual_seed(case)
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            idx = torch.randint(0, 6, (rng.randint(1, 3),), generator=gen)
            pick = [
                lambda t, idx=idx: t[:, :, idx],
                lambda t, idx=idx: t[:, :, idx, 1:3],
                lambda t, idx=idx: t[idx % 2, :, idx],  # not adjacent: index dims in front
                lambda t, idx=idx: t[..., idx % 4],
            ][case % 4]
            ref_x = g.clone().requires_grad_()
            ref = pick(ref_x)
            w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            (ref * w).sum().backward()
            st = distribute(g, mesh, [Shard(1)], sizes=[sizes]).requires_grad_()
            with trace() as t:
                y = pick(st)
                grad = torch.autograd.grad((y.full_tensor() * w).sum(), st)[0]
            fallbacks = [e.label for e in t.events if "fallback" in e.label]
            res.append(
                (
                    torch.allclose(y.full_tensor(), ref, atol=1e-12),
                    torch.allclose(grad.full_tensor(), ref_x.grad, atol=1e-12),
                    fallbacks,
                )
            )
        # index_put directly: x cut like the values, and x whole
        vals = torch.randn(2, 9, 2, 4, dtype=torch.float64)
        idx = torch.tensor([4, 1])
        sizes = random_sizes(rng, 9, n)
        for whole in (False, True):
            base = torch.randn(2, 9, 6, 4, dtype=torch.float64)
            put = torch.ops.aten.index_put.default  # torch.Tensor.index_put takes no None
            ref = put(base, [None, None, idx], vals, True)
            xs = distribute(base, mesh, [Replicate()] if whole else [Shard(1)],
                            None if whole else [sizes])  # fmt: skip
            vs = distribute(vals, mesh, [Shard(1)], [sizes])
            with trace() as t:
                out = put(xs, [None, None, idx], vs, True)
            res.append(
                (
                    torch.allclose(out.full_tensor(), ref, atol=1e-12),
                    out.sharding.placements == (Shard(1),),
                    [e.label for e in t.events],
                )
            )
        return res

    for world in (1, 3, 4):
        for ok_fwd, ok_bwd, extra in ranks_for(world).run(body)[0]:
            assert ok_fwd and ok_bwd and extra == [], extra


@pytest.mark.parametrize("world", [1, 3])
def test_fused_attention_with_grouped_heads_on_cut_batches(ranks_for, world):
    """torch's own F.scaled_dot_product_attention (not patched) on q, k, v cut along the
    batch (uneven, an empty block on 3 ranks) or replicated, with fewer K/V heads than
    query heads: each rank runs the fused kernel on its block (no message, no fallback),
    forward and backward equal one device."""

    def body():
        from shardlab.trace import trace

        mesh, n = this_rank().mesh, this_rank().world_size
        gen = torch.Generator().manual_seed(7)
        q0 = torch.randn(4, 4, 5, 3, generator=gen, dtype=torch.float64)
        k0, v0 = (torch.randn(4, 2, 5, 3, generator=gen, dtype=torch.float64) for _ in "kv")
        res = []
        for places, sizes in (
            ([Shard(0)], [[2, 0, 2][:n] if n == 3 else [4]]),
            ([Replicate()], None),
        ):
            ref = [t.clone().requires_grad_() for t in (q0, k0, v0)]
            want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
            w = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            (want * w).sum().backward()
            st = [distribute(t, mesh, places, sizes).requires_grad_() for t in (q0, k0, v0)]
            with trace() as t:
                got = F.scaled_dot_product_attention(*st, is_causal=True, enable_gqa=True)
                (got * distribute(w, mesh, places, sizes)).sum().backward()
            res.append(
                (
                    torch.allclose(got.full_tensor(), want, atol=1e-12),
                    all(
                        torch.allclose(s.grad.full_tensor(), r.grad, atol=1e-12)
                        for s, r in zip(st, ref)
                    ),
                    [e.label for e in t.events if "scaled_dot" in e.label or "fallback" in e.label],
                )
            )
        return res

    for res in ranks_for(world).run(body):
        for ok_out, ok_grad, labels in res:
            assert ok_out and ok_grad and labels == [], (ok_out, ok_grad, labels)


@pytest.mark.parametrize("world", [1, 2])
def test_fused_attention_on_a_sequence_cut_by_one_rank(ranks_for, world):
    """A sequence cut only by a mesh dim of one rank is whole on every rank: torch's fused
    kernel runs on the blocks (kept per signature), patched or not, no ring, no message,
    no fallback; forward and backward equal one device (patched on one rank: torch's
    own F call on the whole blocks, before any aten op). World 1: Shard(2) on the one
    rank; world 2: the batch cut on mesh dim 0 (2 ranks), the sequence on dim 1 (1)."""

    def body():
        import shardlab
        from shardlab import this_rank
        from shardlab.engine import decisions
        from shardlab.trace import trace

        n = this_rank().world_size
        mesh = this_rank().mesh if n == 1 else this_rank().mesh_for((n, 1))
        places = [Shard(2)] if n == 1 else [Shard(0), Shard(2)]
        sizes = None if n == 1 else [[3, 1], None]
        gen = torch.Generator().manual_seed(11)
        q0, k0, v0 = (torch.randn(4, 2, 6, 3, generator=gen, dtype=torch.float64) for _ in "qkv")
        mask = torch.randn(6, 6, generator=gen, dtype=torch.float64)
        res = []
        for patched in (False, True):
            for kw in ({"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
                ref = [t.clone().requires_grad_() for t in (q0, k0, v0)]
                want = F.scaled_dot_product_attention(*ref, **kw)
                w = torch.randn(want.shape, generator=gen, dtype=torch.float64)
                (want * w).sum().backward()
                st = [distribute(t, mesh, places, sizes).requires_grad_() for t in (q0, k0, v0)]
                decisions.clear()
                with shardlab.patched() if patched else contextlib.nullcontext(), trace() as t:
                    got = F.scaled_dot_product_attention(*st, **kw)
                    (got * distribute(w, mesh, places, sizes)).sum().backward()
                fused = {id(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)}
                kept = fused <= {k[0] for k in decisions._TABLE}
                if patched and n == 1:  # whole on its rank: F's own call before any aten op
                    kept = not kept  # (engine/whole.py, F level), no aten decision at all
                res.append(
                    (
                        torch.allclose(got.full_tensor(), want, atol=1e-12),
                        all(
                            torch.allclose(s.grad.full_tensor(), r.grad, atol=1e-12)
                            for s, r in zip(st, ref)
                        ),
                        kept,
                        [(e.label, e.kind) for e in t.events],
                    )
                )
        return res

    for res in ranks_for(world).run(body):
        for ok_out, ok_grad, kept, events in res:
            assert ok_out and ok_grad and kept and events == [], (ok_out, ok_grad, kept, events)


@pytest.mark.parametrize("world", [2, 3])
def test_new_empty_strided_of_the_same_shape_keeps_the_layout(ranks_for, world):
    """``x.new_empty_strided(x.shape, ...)`` (autograd's copy of a gradient into its
    parameter's strides) is laid out like ``x``, with torch's dtype and stride; another
    shape, a Partial ``x``, or the other ``new_*`` give a whole tensor (torch's values).
    A leaf used three times (q = k = v) gets its gradient on its own blocks: no message."""

    def body():
        from torch.distributed.tensor import Partial

        from shardlab.trace import trace

        mesh, n = this_rank().mesh, this_rank().world_size
        sizes = [[3, 0, 3]] if n > 2 else [[4, 2]]
        x0 = torch.randn(2, 6, 3, dtype=torch.float64)
        bad = []
        for places, szs in (([Shard(1)], sizes), ([Partial()], None), ([Replicate()], None)):
            x = distribute(x0, mesh, places, szs)
            for name, make in (
                ("new_zeros", lambda t, s: t.new_zeros(s)),
                ("new_ones", lambda t, s: t.new_ones(s, dtype=torch.float32)),
                ("new_full", lambda t, s: t.new_full(s, 2.5)),
                ("new_empty", lambda t, s: t.new_empty(s)),
                ("new_empty_strided", lambda t, s: t.new_empty_strided(s, (1, 2, 12)[: len(s)])),
            ):
                for shape in (tuple(x0.shape), (4, 5)):
                    want, got = make(x0, shape), make(x, shape)
                    same = isinstance(places[0], Shard) and shape == tuple(x0.shape)
                    same = same and name == "new_empty_strided"
                    ok = (
                        got.shape == want.shape
                        and got.dtype == want.dtype
                        and got.stride() == want.stride()
                        and got.placements == (places[0] if same else Replicate(),)
                        and (name.startswith("new_empty") or torch.equal(got.full_tensor(), want))
                    )
                    if not ok:
                        bad.append((name, str(places), shape, got.placements, got.stride()))
        leaf = torch.randn(6, 2, 4, 3, dtype=torch.float64)
        leaf = distribute(leaf, mesh, [Shard(0)], sizes)
        leaf.requires_grad_()
        with trace() as t:
            F.scaled_dot_product_attention(leaf, leaf, leaf).sum().backward()
        if leaf.grad.placements != (Shard(0),) or t.events:
            bad.append(("leaf grad", leaf.grad.placements, [e.label for e in t.events]))
        return bad

    assert ranks_for(world).run(body) == [[]] * world


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layer_norm_backward_on_whole_rows(ranks_for, world):
    """torch's own layer norm (not patched) on rows cut along the batch or the sequence
    (uneven, empty blocks): its backward runs on each rank's rows (the weight's and
    bias's gradients summed once, together, at the end of the backward), kept per
    signature, equal to one device."""

    def body():
        from shardlab.engine import decisions
        from shardlab.trace import trace

        mesh, n = this_rank().mesh, this_rank().world_size
        rng = random.Random(world)
        gen = torch.Generator().manual_seed(world)
        ok = []
        for d in (0, 1, 1):
            x0 = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
            w0, b0 = (torch.randn(4, generator=gen, dtype=torch.float64) for _ in "wb")
            ref = [t.clone().requires_grad_() for t in (x0, w0, b0)]
            want = F.layer_norm(ref[0], (4,), ref[1], ref[2], 1e-3)
            g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            want.backward(g)
            sizes = [random_sizes(rng, x0.shape[d], n)]
            ours = [t.clone().requires_grad_() for t in (x0, w0, b0)]
            decisions.clear()
            x = distribute(ours[0], mesh, [Shard(d)], sizes)
            with trace() as t:
                y = F.layer_norm(x, (4,), ours[1], ours[2], 1e-3)
                y.backward(distribute(g, mesh, [Shard(d)], sizes))
            reduces = [e.label for e in t.events if e.kind == "all_reduce"]
            kept = id(torch.ops.aten.native_layer_norm_backward.default) in {
                k[0] for k in decisions._TABLE
            }
            ok.append(
                (
                    torch.allclose(y.full_tensor(), want, atol=1e-12),
                    all(torch.allclose(o.grad, r.grad, atol=1e-12) for o, r in zip(ours, ref)),
                    reduces == (["params backward"] if n > 1 else []),  # weight and bias
                    kept,
                )
            )
        return ok

    for res in ranks_for(world).run(body):
        assert all(all(r) for r in res), res


@pytest.mark.parametrize("world", [1, 2])
def test_fused_attention_with_features_cut_by_one_rank(ranks_for, world):
    """The feature dim (or the sequence) cut only by a mesh dim of one rank is whole: the
    fused kernel runs on the blocks, forward and backward equal one device, no message
    (the logsumexp's layout once failed on a Shard of the feature dim)."""

    def body():
        from shardlab import this_rank
        from shardlab.trace import trace

        n = this_rank().world_size
        mesh = this_rank().mesh if n == 1 else this_rank().mesh_for((n, 1))
        gen = torch.Generator().manual_seed(12)
        res = []
        for places in ([Shard(3)], [Shard(2)]) if n == 1 else ([Shard(0), Shard(3)],):
            sizes = None if n == 1 else [[3, 1], None]
            q0, k0, v0 = (
                torch.randn(4, 2, 6, 3, generator=gen, dtype=torch.float64) for _ in "qkv"
            )
            ref = [t.clone().requires_grad_() for t in (q0, k0, v0)]
            want = F.scaled_dot_product_attention(*ref, is_causal=True)
            w = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            (want * w).sum().backward()
            st = [distribute(t, mesh, places, sizes).requires_grad_() for t in (q0, k0, v0)]
            with trace() as t:
                got = F.scaled_dot_product_attention(*st, is_causal=True)
                (got * distribute(w, mesh, places, sizes)).sum().backward()
            res.append(
                torch.allclose(got.full_tensor(), want, atol=1e-12)
                and all(
                    torch.allclose(s.grad.full_tensor(), r.grad, atol=1e-12)
                    for s, r in zip(st, ref)
                )
                and t.events == []
            )
        return res

    for res in ranks_for(world).run(body):
        assert all(res), res


def test_aliases_and_copies_keep_torch_strides(ranks_for):
    """``detach`` and ``alias`` of a transposed ShardTensor keep its strides, ``clone``
    keeps them too (torch's ``preserve_format``), as on one device (an alias used to come
    back contiguous, which ``torch.compile`` then rebuilt with the wrong strides)."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        x = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(5))
        st = shardlab.distribute(x, mesh, [Shard(1)], [[4, 2]] if mesh.size() == 2 else None)
        y, want = st.transpose(1, 2), x.transpose(1, 2)
        got = [
            y.detach(),
            torch.ops.aten.alias(y),
            y.clone(),
            y.clone(memory_format=torch.contiguous_format),
        ]
        ref = [want.detach(), torch.ops.aten.alias(want), want.clone(), want.contiguous()]
        return [
            (a.stride() == b.stride(), torch.equal(a.full_tensor(), b)) for a, b in zip(got, ref)
        ]

    for world in (1, 2):
        assert ranks_for(world).run(body) == [[(True, True)] * 4] * world


def test_elementwise_out_argument_is_written_in_its_own_layout(ranks_for):
    """``torch.maximum(a, b, out=o)`` (single-tensor Adamax) with a, b and o cut unlike
    each other: o holds the result and keeps its layout (the inputs move to it). It was
    written in a moved copy of o and left as it was, silently."""

    def body():
        from torch.distributed.tensor import Replicate, Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        g = torch.randn(3, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        ok = []
        for fn in (torch.maximum, torch.add, torch.mul):
            a = distribute(g[0], mesh, [Replicate()])
            b = distribute(g[1], mesh, [Shard(0)], [[3, 4]])
            o = distribute(g[2].clone(), mesh, [Shard(0)], [[5, 2]])
            before = o._layout
            got = fn(a, b, out=o)
            same = torch.equal(o.full_tensor(), fn(g[0], g[1]))
            ok.append(got is o and o._layout == before and same)
        b = distribute(g[1], mesh, [Shard(0)], [[5, 2]])
        o = distribute(g[2].clone(), mesh, [Shard(0)], [[5, 2]])
        with shardlab.trace() as t:  # laid out alike: the op on the blocks, no message
            torch.maximum(b, b * 2, out=o)
        ok.append(len(t) == 0 and torch.equal(o.full_tensor(), torch.maximum(g[1], g[1] * 2)))
        return ok

    assert ranks_for(2).run(body) == [[True] * 4] * 2
