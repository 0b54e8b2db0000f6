"""On a CUDA device (every test here is marked ``gpu``: skipped where torch sees none):
ring attention through the fused CUDA kernels, halo convolution, uneven redistribution
and ``explain``'s memory column, on nccl ranks (one GPU each) or gloo ranks sharing the
GPUs, each against one device."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _attention_case(dtype, causal, balanced, seq, heads, dim):
    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard
        from torch.nn.attention import SDPBackend, sdpa_kernel

        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.ops import _ring_kernels, attention
        from shardlab.trace import trace

        ctx = this_rank()
        mesh, n, dev = ctx.mesh, ctx.world_size, ctx.device
        gen = torch.Generator().manual_seed(seq)
        full = [torch.randn(2, heads, seq, dim, generator=gen).to(dev) for _ in "qkv"]
        w = torch.randn(2, heads, seq, dim, generator=gen).to(dev)

        def leaves(dt):
            return [x.to(dt).requires_grad_() for x in full]

        def grads(out, xs):
            return [out.detach(), *torch.autograd.grad((out * w.to(out.dtype)).sum(), xs)]

        with sdpa_kernel(SDPBackend.MATH):  # the truth: float64, explicit
            xs = leaves(torch.float64)
            truth = grads(F.scaled_dot_product_attention(*xs, is_causal=causal), xs)
        xs = leaves(dtype)  # torch's own fused kernel on one device, same dtype
        fused = grads(F.scaled_dot_product_attention(*xs, is_causal=causal), xs)
        xs = leaves(dtype)
        with shardlab.patched(), trace() as t:
            if balanced:
                with attention.head_tail():
                    parts = [attention.balance(x, mesh, [Shard(2)], dims=(2,)) for x in xs]
                    y = F.scaled_dot_product_attention(*parts, is_causal=causal)
                y = attention.unbalance(y.full_tensor(), n, dims=(2,))
            else:
                parts = [distribute(x, mesh, [Shard(2)]) for x in xs]
                y = F.scaled_dot_product_attention(*parts, is_causal=causal).full_tensor()
            ours = grads(y, xs)
        err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
        kind = _ring_kernels.choose_for(xs[0], xs[2])
        labels = {e.label for e in t.events if e.label.startswith("sdpa.ring ")}
        return (
            kind,
            labels,
            [err(o, r) for o, r in zip(ours, truth)],
            [err(f, r) for f, r in zip(fused, truth)],
        )

    return body


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal, balanced", [(False, False), (True, False), (True, True)])
def test_ring_attention_on_cuda(cuda_ranks_for, world, dtype, causal, balanced):
    """Output and q/k/v gradients as close to float64 truth as torch's own fused SDPA
    on one device (twice its error at most); the blocks run in a fused kernel (flash
    for half precision on sm80+, else memory-efficient), named in the labels."""
    body = _attention_case(dtype, causal, balanced, seq=64 * world + 24, heads=4, dim=64)
    for kind, labels, ours, fused in cuda_ranks_for(world).run(body):
        assert kind in ("flash", "efficient"), kind
        if world > 1:
            assert any(f"[{kind}]" in lab for lab in labels), labels
        for o, f in zip(ours, fused):
            assert o <= 2 * f + 1e-5, (ours, fused)


def test_ring_memory_is_linear_in_the_sequence(cuda_ranks_for):
    """One rank, bf16, causal, S = 16384: peak memory of forward + backward far below one
    (S x S) score matrix (explicit scores would hold 4 GiB for these 4 heads)."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh, dev = this_rank().mesh, this_rank().device
        s, h, d = 16384, 4, 64
        xs = [torch.randn(1, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
              for _ in "qkv"]  # fmt: skip
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with shardlab.patched():
            y = F.scaled_dot_product_attention(
                *(distribute(x, mesh, [Shard(2)]) for x in xs), is_causal=True
            )
            y.to_local().sum().backward()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base

    (peak,) = cuda_ranks_for(1).run(body)
    assert peak < 256 * 2**20, peak / 2**20


@pytest.mark.parametrize("world", [2, 3])
def test_conv_and_redistribute_on_cuda(cuda_ranks_for, world):
    """Halo convolution (forward and backward) and an uneven all-to-all-v on CUDA ranks
    equal one device; gloo ranks sharing a GPU stage their messages through the host."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        torch.backends.cudnn.allow_tf32 = False
        ctx = this_rank()
        mesh, dev, n = ctx.mesh, ctx.device, ctx.world_size
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 5, 3, padding=1).double().to(dev)
        x = torch.randn(2, 3, 19, 7, dtype=torch.float64).to(dev).requires_grad_()
        ref = conv(x)
        ref_gx, ref_gw = torch.autograd.grad(ref.square().sum(), (x, conv.weight))
        sizes = [[19 - 5 * (n - 1)] + [5] * (n - 1)]
        with shardlab.patched():
            y = conv(distribute(x, mesh, [Shard(2)], sizes))
            moved = y.redistribute(mesh, [Shard(3)])
            gx, gw = torch.autograd.grad(moved.full_tensor().square().sum(), (x, conv.weight))
        return [
            (y.full_tensor() - ref).abs().max().item(),
            (gx - ref_gx).abs().max().item(),
            (gw - ref_gw).abs().max().item(),
            torch.equal(moved.full_tensor(), y.full_tensor()),
            y.to_local().device.type,
        ]

    for errs in cuda_ranks_for(world).run(body):
        assert max(errs[:3]) < 1e-10 and errs[3] and errs[4] == "cuda", errs


def test_explain_memory_column_on_cuda(cuda_ranks_for):
    """On CUDA the allocator gives each module's peak: the column is on by default."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh, dev = this_rank().mesh, this_rank().device
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).to(dev)
        x = torch.randn(2, 3, 32, 16, device=dev)
        with shardlab.patched():
            ex = shardlab.explain(model, distribute(x, mesh, [Shard(2)]))
        rows = {(r.name, r.phase): r for r in ex.rows(this_rank().rank)}
        return rows["0", "forward"].peak_bytes

    for peak in cuda_ranks_for(2).run(body):
        assert peak is not None and peak >= 2 * 8 * 16 * 16 * 4, peak


def test_dropout_mask_is_made_on_the_gpu_and_equals_the_cpu_one(cuda_ranks_for):
    """``F.dropout`` of a cut CUDA ShardTensor: its keep mask (a function of the seed and
    each element's global index, ``ops/_counter.py``) is made on the GPU, with the same
    bits as on the CPU: the result equals the one-device mask built on the CPU."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.ops._counter import counter_uniform, draw_seed

        mesh, dev = this_rank().mesh, this_rank().device
        x = torch.randn(3, 11, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        torch.manual_seed(4)
        seed = draw_seed()
        keep = counter_uniform(seed, torch.arange(x.numel()).view(x.shape)) >= 0.3
        torch.manual_seed(4)
        with shardlab.patched():
            y = F.dropout(distribute(x.to(dev), mesh, [Shard(1)], [[8, 3]]), 0.3)
        want = x * (keep.double() / 0.7)
        return y.to_local().device.type, torch.equal(y.full_tensor().cpu(), want)

    assert cuda_ranks_for(2).run(body) == [("cuda", True)] * 2


def test_whole_tensor_fallback_with_strided_arguments_on_cuda(cuda_ranks_for):
    """An op with no rule (``scatter_reduce`` "mean" of cut entries into a whole target)
    on CUDA ShardTensors whose global strides are not the gathered tensor's (an index
    expanded over a dim, a transposed source): the gathered copies keep those strides on
    the GPU, equal to one device."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh, dev = this_rank().mesh, this_rank().device
        gen = torch.Generator().manual_seed(1)
        src = torch.randn(4, 9, dtype=torch.float64, generator=gen).to(dev)  # (cols, rows)
        idx = torch.randint(0, 3, (9,), generator=gen).to(dev)
        s_src = distribute(src, mesh, [Shard(1)], [[5, 4]]).t()  # (rows, cols), strides (1, 9)
        s_idx = distribute(idx, mesh, [Shard(0)], [[5, 4]])[:, None].expand(9, 4)
        zeros = torch.zeros(3, 4, dtype=torch.float64, device=dev)
        got = zeros.scatter_reduce(0, s_idx, s_src, "mean")
        ref = zeros.scatter_reduce(0, idx[:, None].expand(9, 4), src.t(), "mean")
        return got.to_local().device.type, (got.full_tensor() - ref).abs().max().item()

    for kind, err in cuda_ranks_for(2).run(body):
        assert kind == "cuda" and err < 1e-12, (kind, err)
