"""Point-to-point messages through host memory (gloo ranks with CUDA tensors), run here
with the staging forced on CPU tensors: every path that sends (redistribute, scatter,
halo convolution, ring attention) gives the same values and the same messages."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from shardlab.comm import p2p

f64 = torch.float64


@pytest.mark.parametrize(
    "device, backend, staged",
    [
        ("cpu", "gloo", False),
        ("cuda", "gloo", True),
        ("cuda", "nccl", False),
        ("cpu", "nccl", False),
    ],
)
def test_needs_staging(device, backend, staged):
    assert p2p.needs_staging(device, backend) is staged


def _every_path():
    import shardlab
    from shardlab import distribute, scatter_tensor, this_rank
    from shardlab.trace import trace

    mesh, me = this_rank().mesh, this_rank().rank
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 17, 5, generator=gen, dtype=f64, requires_grad=True)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    q, k, v = (torch.randn(1, 2, 13, 4, generator=gen, dtype=f64, requires_grad=True)
               for _ in range(3))  # fmt: skip
    sizes = [7, 6, 4][: mesh.size()] if mesh.size() == 3 else None
    with shardlab.patched(), trace() as t:
        xs = distribute(x, mesh, [Shard(2)], [sizes] if sizes else None)
        y = conv(xs)  # halo exchange forward and backward
        moved = y.redistribute(mesh, [Shard(3)])  # all-to-all-v, point to point
        att = F.scaled_dot_product_attention(
            *(distribute(a, mesh, [Shard(2)]) for a in (q, k, v)), is_causal=True
        )
        scattered = scatter_tensor(x.detach() if me == 0 else None, 0, mesh, [Shard(1)])
        loss = moved.full_tensor().square().sum() + att.full_tensor().square().sum()
        loss.backward()
        got = [
            moved.full_tensor().detach(),
            att.full_tensor().detach(),
            scattered.redistribute(mesh, [Replicate()]).to_local(),
            x.grad,
            q.grad,
            k.grad,
            conv.weight.grad,
        ]
    messages = sorted((e.kind, e.peer, e.bytes, e.label) for e in t.events)
    return got, messages


def test_staged_messages_match_direct_ones(ranks_for):
    def body():
        from shardlab.comm import p2p as c

        direct = _every_path()
        saved, posts = c.needs_staging, []
        c.needs_staging = lambda device_type, backend: posts.append(device_type) or True
        try:
            staged = _every_path()
        finally:
            c.needs_staging = saved
        return direct, staged, len(posts)

    for (got, msgs), (got_s, msgs_s), posts in ranks_for(3).run(body):
        assert msgs == msgs_s and len(msgs) > 10 and posts > 5
        for a, b in zip(got, got_s):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
def test_max_and_min_over_ranks_keep_nan_inf_and_signed_zero(ranks_for, world):
    """A max / min reduced across ranks (``amax``, ``max``, ``min``, an infinity norm) is
    NaN when any element is, as torch's is: gloo's and NCCL's MAX / MIN drop NaNs
    (``max(1, nan)`` was 1 on two ranks), silently. Infinities and -0.0 pass through."""

    def body():
        import random

        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank
        from tests.tensor._cases import random_sizes

        mesh = this_rank().mesh
        rng = random.Random(3)
        special = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.0, -2.5]
        bad = []
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            for trial in range(12):
                vals = [rng.choice(special) for _ in range(6 * 5)]
                g = torch.tensor(vals, dtype=dtype).reshape(6, 5)
                x = distribute(g, mesh, [Shard(0)], random_sizes(rng, 6, mesh.size()))
                calls = {
                    "amax": lambda t: t.amax(0),
                    "amin": lambda t: t.amin(0),
                    "max": lambda t: t.max(),
                    "min": lambda t: t.min(),
                    "norm inf": lambda t: torch.linalg.vector_norm(t, float("inf")),
                    "norm -inf": lambda t: torch.linalg.vector_norm(t, -float("inf"), dim=0),
                }
                for name, fn in calls.items():
                    want, got = fn(g), fn(x).full_tensor()
                    same = torch.equal(want.isnan(), got.isnan()) and torch.equal(
                        want.nan_to_num(), got.nan_to_num()
                    )
                    if not same:
                        bad.append((str(dtype), trial, name))
        return bad

    assert ranks_for(world).run(body) == [[]] * world
