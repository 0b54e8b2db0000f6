"""In-place views (``transpose_``, ``t_``, ``squeeze_``, ``unsqueeze_``) of ShardTensors, and
the torch RNNs that use one on their output (``batch_first=True``), against one device."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from shardlab import ShardTensor, distribute, this_rank

f64 = torch.float64

CALLS = [
    ("transpose_", lambda t: t.transpose_(0, 2)),
    ("transpose_ neg", lambda t: t.transpose_(-1, 1)),
    ("swapdims_", lambda t: t.swapdims_(0, 1)),
    ("unsqueeze_", lambda t: t.unsqueeze_(1)),
    ("unsqueeze_ end", lambda t: t.unsqueeze_(-1)),
    ("squeeze_ dim", lambda t: t.squeeze_(3)),
    ("squeeze_", lambda t: t.squeeze_()),
    ("squeeze_ dims", lambda t: t.squeeze_((0, 3))),
]


def _calls(mesh_shape, sizes):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        placements = [Shard(1)] if len(mesh_shape) == 1 else [Shard(1), Shard(2)]
        g = torch.randn(2, 7, 4, 1, dtype=f64, generator=torch.Generator().manual_seed(0))
        w = None
        out = {}
        for name, call in CALLS:
            xr = g.clone().requires_grad_()
            ref_in = xr * 1  # a non-leaf: in place is allowed
            ref = call(ref_in)
            w = torch.randn(ref.shape, dtype=f64, generator=torch.Generator().manual_seed(1))
            (ref * w).sum().backward()
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, placements, sizes) * 1
            got = call(st)
            full = got.full_tensor()
            (full * w).sum().backward()
            out[name] = (
                got is st,
                isinstance(got, ShardTensor),
                tuple(got.shape) == tuple(ref.shape) and got.stride() == ref.stride(),
                torch.equal(full, ref),
                torch.allclose(x.grad, xr.grad, atol=1e-12),
                tuple(got.to_local().shape) == got.sharding.local_shape(mesh.get_coordinate()),
            )
        return out

    return body


@pytest.mark.parametrize(
    ("mesh_shape", "sizes"),
    [((2,), [[5, 2]]), ((3,), [[4, 0, 3]]), ((2, 2), [[3, 4], [1, 3]])],
)
def test_inplace_views_equal_torch(ranks_for, mesh_shape, sizes):
    """Each op returns its input, laid out anew: torch's shape and strides, values, the
    input's gradient, and a block of the layout's local shape on every rank."""
    world = 1
    for n in mesh_shape:
        world *= n
    for rank in ranks_for(world).run(_calls(mesh_shape, sizes)):
        for name, checks in rank.items():
            assert all(checks), (name, checks)


@pytest.mark.parametrize("cls", [nn.GRU, nn.RNN, nn.LSTM])
def test_rnns_batch_first_cut_along_batch_or_time(ranks_for, cls):
    """torch's RNN kernels transpose their output in place with ``batch_first=True`` (GRU
    and RNN raised before): output, input and parameter gradients as on one device."""

    def body():
        mesh = this_rank().mesh
        results = []
        for batch_first in (True, False):
            for cut in ("batch", "time"):
                torch.manual_seed(0)
                rnn = cls(6, 5, num_layers=2, batch_first=batch_first, bidirectional=True)
                rnn = rnn.double()
                x = torch.randn(3, 7, 6, dtype=f64)  # (B, T, F)
                x = x if batch_first else x.transpose(0, 1).contiguous()
                dim = (0 if batch_first else 1) if cut == "batch" else (1 if batch_first else 0)
                xr = x.clone().requires_grad_()
                ref = rnn(xr)[0]
                w = torch.randn(ref.shape, dtype=f64)
                (ref * w).sum().backward()
                grads = [p.grad.clone() for p in rnn.parameters()]
                rnn.zero_grad(set_to_none=True)
                xs = x.clone().requires_grad_()
                sizes = [2, 0, 1] if x.shape[dim] == 3 else [4, 0, 3]
                y = rnn(distribute(xs, mesh, [Shard(dim)], [sizes]))[0]
                out = y.full_tensor()
                (out * w).sum().backward()
                ok = torch.allclose(out, ref, atol=1e-12)
                ok &= torch.allclose(xs.grad, xr.grad, atol=1e-12)
                ok &= all(
                    torch.allclose(p.grad, g, atol=1e-12) for p, g in zip(rnn.parameters(), grads)
                )
                results.append(bool(ok))
        return results

    assert ranks_for(3).run(body) == [[True] * 4] * 3


def test_t_and_an_inplace_view_of_a_view(ranks_for):
    """``t_`` of a 2-D ShardTensor, and ``transpose_`` of a slice (an autograd view of a
    non-leaf): values and the gradient as on one device."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(7, 4, dtype=f64, generator=torch.Generator().manual_seed(0))
        out = []
        for call in (lambda t: (t * 1).t_(), lambda t: (t * 1)[:, 1:3].transpose_(0, 1)):
            xr = g.clone().requires_grad_()
            ref = call(xr)
            w = torch.randn(ref.shape, dtype=f64, generator=torch.Generator().manual_seed(1))
            (ref * w).sum().backward()
            x = g.clone().requires_grad_()
            got = call(distribute(x, mesh, [Shard(0)], [[4, 0, 3]]))
            full = got.full_tensor()
            (full * w).sum().backward()
            out.append(
                torch.equal(full, ref)
                and got.stride() == ref.stride()
                and torch.equal(x.grad, xr.grad)
            )
        return out

    assert ranks_for(3).run(body) == [[True, True]] * 3


def test_inplace_views_of_copied_views_write_back_or_refuse(ranks_for):
    """A view that had to be a copy (``B.view(4, 7)`` of ``B`` cut [4, 3] along its rows)
    transposed in place, then zeroed: ``B`` is zeroed, as on one device. ``squeeze_`` of a
    size-1 dim one rank holds: in place, the cut moved to the other dim (no message); of a
    1-D tensor's only dim (a copy, which an in-place view cannot be): torch's out-of-place
    call is named, on every rank."""

    def body():
        mesh = this_rank().mesh
        b = distribute(torch.arange(28.0).view(7, 4), mesh, [Shard(0)], [[4, 3, 0]]) * 1
        x = b.view(4, 7)
        x.t_()
        x.zero_()
        zeroed = bool((b.full_tensor() == 0).all())
        # the base relayouted in place after a copied view of it was made: the view's
        # writes still reach the base's memory, in torch's order
        g = torch.arange(28.0).view(7, 4)
        ref = g.clone()
        ref_v = ref.view(4, 7)
        ref.t_()
        ref_v.add_(torch.arange(28.0).view(4, 7))
        base = distribute(g, mesh, [Shard(0)], [[4, 3, 0]]) * 1
        v = base.view(4, 7)
        base.t_()
        v.add_(torch.arange(28.0).view(4, 7))
        zeroed = zeroed and torch.equal(base.full_tensor(), ref)
        # a size-1 dim one rank holds vanishes where it lies (the cut moves to the other dim)
        g1 = torch.randn(1, 4, generator=torch.Generator().manual_seed(0))
        one = distribute(g1, mesh, [Shard(0)]) * 1
        one.squeeze_(0)
        where = one.shape == (4,) and one.sharding.sizes_along(0) == (4, 0, 0)
        where = where and torch.equal(one.full_tensor(), g1.squeeze(0))
        lone = distribute(torch.randn(1), mesh, [Shard(0)]) * 1  # (no other dim to cut)
        try:
            lone.squeeze_(0)
            refused = None
        except NotImplementedError as exc:
            refused = "squeeze(" in str(exc)
        return zeroed, where, refused

    assert ranks_for(3).run(body) == [(True, True, True)] * 3
