"""Every patched ``torch.nn.functional`` call and ShardTensor aten ops under
``torch.autocast`` equal the unsharded call under the same autocast: the result's dtype,
the gradients' dtypes, and the values at the lower precision's tolerance
(``shardlab/ops/autocast.py``).

Each call gets float32, bfloat16 (and float16) inputs, and mixed ones, on inputs cut
unevenly over 2 and 3 ranks, CPU autocast in bfloat16 and float16. (CUDA autocast follows
the same code with torch's CUDA lists: the ``gpu`` tests.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlab.patch import PATCHED_NAMES

# name -> (function of the sharded input x and plain extras, the input's shape, the cut dim)
H = 9  # the cut length


def _calls():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w2, b, w1 = r(4, 3, 3, 3), r(4), r(4, 3, 3)
    img, seq, q = (2, 3, H, 5), (2, H, 4), (1, 2, H, 4)
    return {
        "conv1d": (lambda x, t: F.conv1d(x, w1.to(t), b.to(t), padding=1), (2, 3, H), 2),
        "conv2d": (lambda x, t: F.conv2d(x, w2.to(t), b.to(t), padding=1), img, 2),
        "conv3d": (lambda x, t: F.conv3d(x, w2[..., None].to(t), None, padding=1), img + (2,), 2),
        "conv_transpose2d": (
            lambda x, t: F.conv_transpose2d(x, w2.transpose(0, 1).to(t), stride=2),
            img,
            2,
        ),
        "pad": (lambda x, t: F.pad(x, (1, 1, 1, 1), mode="reflect"), img, 2),
        "max_pool2d": (lambda x, t: F.max_pool2d(x, 3, 1, 1), img, 2),
        "avg_pool3d": (lambda x, t: F.avg_pool3d(x, 2, ceil_mode=True), img + (2,), 2),
        "adaptive_avg_pool2d": (lambda x, t: F.adaptive_avg_pool2d(x, (3, 2)), img, 2),
        "interpolate": (lambda x, t: F.interpolate(x, scale_factor=2, mode="bilinear"), img, 2),
        "batch_norm": (lambda x, t: F.batch_norm(x, None, None, training=True), img, 2),
        "group_norm": (lambda x, t: F.group_norm(x, 1, w2[:3, 0, 0, 0].to(t)), img, 2),
        "instance_norm": (lambda x, t: F.instance_norm(x), img, 2),
        "layer_norm": (lambda x, t: F.layer_norm(x, (4,), b.to(t)), seq, 1),
        "dropout": (lambda x, t: F.dropout(x, 0.0), seq, 1),
        "cross_entropy": (lambda x, t: F.cross_entropy(x, _target(x)), (2, 4, H, 3), 2),
        "scaled_dot_product_attention": (
            lambda x, t: F.scaled_dot_product_attention(x, x * 0.5, x, is_causal=True),
            q,
            2,
        ),
        "linear (aten)": (lambda x, t: F.linear(x, w2[:, :, 0, 0].to(t)), seq[:2] + (3,), 1),
        "matmul (aten)": (lambda x, t: x @ w2[0, :, :, 0].to(t), seq[:2] + (3,), 1),
        "softmax (aten)": (lambda x, t: x.softmax(-1), seq, 1),
        "sum (aten)": (lambda x, t: x.sum(), seq, 1),
        "mse_loss (losses)": (lambda x, t: F.mse_loss(x, x.detach() * 0.5), seq, 1),
    }


def _target(x):
    n, _, h, w = x.shape
    return torch.arange(n * h * w).reshape(n, h, w) % x.shape[1]


def test_every_patched_name_with_a_shape_signature_is_covered():
    covered = {n.split(" ")[0] for n in _calls()}
    # not under autocast here: unfold (a view: no dtype), the adaptive max pools and the
    # other pooling/conv variants run the same code as the ones listed
    left = set(PATCHED_NAMES) - covered
    assert left <= {
        "conv_transpose1d", "conv_transpose3d", "max_pool1d", "max_pool3d", "avg_pool1d",
        "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
        "adaptive_max_pool2d", "adaptive_max_pool3d", "multi_head_attention_forward", "unfold",
    }, left  # fmt: skip


TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def _body(amp_dtype, in_dtype, param_dtype):
    def body():
        import random

        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank
        from tests.tensor._cases import random_sizes

        mesh = this_rank().mesh
        rng = random.Random(7)
        out = {}
        for name, (f, shape, dim) in _calls().items():
            g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(in_dtype)
            with torch.autocast("cpu", dtype=amp_dtype):
                xr = g.clone().requires_grad_()
                ref = f(xr, param_dtype)
                ref.float().sum().backward()
                sizes = random_sizes(rng, shape[dim], mesh.size())
                xs = g.clone().requires_grad_()
                with shardlab.patched():
                    got = f(distribute(xs, mesh, [Shard(dim)], [sizes]), param_dtype)
                    full = got.full_tensor()
                    full.float().sum().backward()
            tol = max(TOL[ref.dtype], TOL[amp_dtype]) * max(1.0, ref.float().abs().max().item())
            out[name] = {
                "dtype": (str(got.dtype), str(ref.dtype)),
                "grad dtype": (str(xs.grad.dtype), str(xr.grad.dtype)),
                "close": torch.allclose(full.float(), ref.float(), rtol=0, atol=tol),
                "grad close": torch.allclose(
                    xs.grad.float(), xr.grad.float(), rtol=0, atol=tol * 4
                ),
            }
        return out

    return body


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "amp_dtype,in_dtype,param_dtype",
    [
        (torch.bfloat16, torch.float32, torch.float32),  # the usual: float32 model, bf16 amp
        (torch.bfloat16, torch.bfloat16, torch.float32),  # activations already bf16
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32, torch.float32),
    ],
)
def test_patched_calls_follow_torch_autocast(ranks_for, world, amp_dtype, in_dtype, param_dtype):
    res = ranks_for(world).run(_body(amp_dtype, in_dtype, param_dtype))
    for rank in res:
        for name, r in rank.items():
            assert r["dtype"][0] == r["dtype"][1], (name, r)
            assert r["grad dtype"][0] == r["grad dtype"][1], (name, r)
            assert r["close"] and r["grad close"], (name, r)


def test_autocast_decisions_are_cached_and_bounded():
    from shardlab.ops import autocast

    autocast._CACHE.clear()
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    calls = []

    def handler(*a, **k):
        calls.append([t.dtype for t in a if isinstance(t, torch.Tensor)])
        return a[0]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            autocast.autocast_call("conv2d", F.conv2d, handler, [x, w], {}, "cpu")
        assert len(autocast._CACHE) == 1  # one signature, probed once
        assert calls[-1] == [torch.bfloat16, torch.bfloat16]
        # any part of the signature changes the key: a shape, a dtype, a keyword
        autocast.autocast_call("conv2d", F.conv2d, handler, [x[:, :, :4], w], {}, "cpu")
        autocast.autocast_call("conv2d", F.conv2d, handler, [x.double(), w.double()], {}, "cpu")
        autocast.autocast_call("conv2d", F.conv2d, handler, [x, w], {"padding": 1}, "cpu")
        assert len(autocast._CACHE) == 4
        for i in range(autocast._CACHE_SIZE + 10):  # bounded
            autocast.autocast_call("dropout", F.dropout, handler, [x], {"p": i / 1e6}, "cpu")
        assert len(autocast._CACHE) == autocast._CACHE_SIZE
    # autocast off: the arguments untouched, nothing probed
    autocast._CACHE.clear()
    autocast.autocast_call("conv2d", F.conv2d, handler, [x, w], {}, "cpu")
    assert calls[-1] == [torch.float32, torch.float32] and not autocast._CACHE


def test_modules_under_autocast(ranks_for):
    """Unchanged modules: multi-head attention (a composite: autocast op by op inside, as
    torch), a transformer encoder layer, batch norm (its float32 running statistics)."""

    def body():
        import torch.nn as nn
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(8, 2, batch_first=True)
        enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        bn, bn_ref = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        x, mask, img = torch.randn(2, 7, 8), torch.randn(7, 7), torch.randn(2, 3, 7, 5)
        cases = [
            ("mha", lambda t: mha(t, t, t, attn_mask=mask)[0], x, 1, None),
            ("mha weights", lambda t: mha(t, t, t)[1], x, 1, None),
            ("encoder", enc, x, 1, None),
            ("batch norm", bn, img, 2, bn_ref),
        ]
        out = {}
        for name, f, g, dim, ref_module in cases:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref = (ref_module or f)(g)
                with shardlab.patched():
                    got = f(distribute(g, mesh, [Shard(dim)], [[3, 4]]))
            full = got.full_tensor() if hasattr(got, "full_tensor") else got
            out[name] = (got.dtype == ref.dtype) and torch.allclose(
                full.float(), ref.float(), atol=2e-2 * max(1.0, ref.float().abs().max().item())
            )
        out["running stats"] = (
            bn.running_mean.dtype == torch.float32
            and torch.allclose(bn.running_mean, bn_ref.running_mean, atol=1e-6)
            and torch.allclose(bn.running_var, bn_ref.running_var, atol=1e-6)
        )
        return out

    for res in ranks_for(2).run(body):
        assert all(res.values()), res


@pytest.mark.gpu
def test_cuda_autocast_decisions_follow_torchs_cuda_lists():
    """The CUDA policy, read from torch on fake CUDA tensors: convolutions and attention in
    the lower precision, layer/group norm and cross-entropy in float32 (torch's CUDA float32
    list, unlike CPU), batch norm untouched (its float32 running statistics stay). Needs a
    GPU: without one torch turns CUDA autocast off ("CUDA is not available")."""
    from shardlab.ops import autocast

    x16, x32 = torch.empty(2, 3, 8, 8, dtype=torch.float16), torch.empty(2, 3, 8, 8)
    w32, s32 = torch.empty(4, 3, 3, 3), torch.empty(3)
    t = torch.zeros(2, 8, 8, dtype=torch.long)
    cases = [
        ("conv2d", F.conv2d, [x32, w32], {0: torch.float16, 1: torch.float16}),
        ("layer_norm", F.layer_norm, [x16, (8,)], {0: torch.float32}),
        ("group_norm", F.group_norm, [x16, 1], {0: torch.float32}),
        ("cross_entropy", F.cross_entropy, [x16, t], {0: torch.float32}),
        ("batch_norm", F.batch_norm, [x16, s32, s32.clone(), s32.clone(), s32.clone(), True], {}),
        ("scaled_dot_product_attention", F.scaled_dot_product_attention,
         [x32, x32, x32], {0: torch.float16, 1: torch.float16, 2: torch.float16}),
    ]  # fmt: skip
    autocast._CACHE.clear()
    with torch.autocast("cuda", dtype=torch.float16):
        for name, fn, args, want in cases:
            assert autocast._casts(name, fn, args, {}, "cuda") == want, name
