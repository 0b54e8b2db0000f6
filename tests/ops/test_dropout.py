"""Sharded F.dropout: one global mask whatever the layout, reproducible from the seed."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardlab
from shardlab import distribute, this_rank
from shardlab.ops.dropout import mask_scheme


def test_torch_scheme_is_torch_dropout_bit_for_bit(ranks_for):
    def body():
        mesh = this_rank().mesh
        g = torch.randn(2, 3, 9, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x = g.clone().requires_grad_()
        with shardlab.patched(), mask_scheme("torch"):
            st = distribute(x, mesh, [Shard(2)], sizes=[4, 0, 1, 4])
            torch.manual_seed(7)
            with shardlab.trace() as t:
                y = nn.Dropout(0.3)(st)
            after = torch.rand(3)  # the generator advanced exactly as on one device
        out = y.full_tensor()
        out.sum().backward()
        xr = g.clone().requires_grad_()
        torch.manual_seed(7)
        ref = F.dropout(xr, 0.3)
        ref.sum().backward()
        same_after = torch.equal(after, torch.rand(3))
        return torch.equal(out, ref), torch.equal(x.grad, xr.grad), same_after, t.counts()

    for eq, geq, same_after, counts in ranks_for(4).run(body):
        assert eq and geq and same_after and counts == {}


def test_counter_scheme_same_mask_for_every_layout(ranks_for):
    def body():
        from shardlab import this_rank

        mesh1, mesh2 = this_rank().mesh, this_rank().mesh_for((2, 2))
        g = torch.rand(3, 2, 11, 6, dtype=torch.float64) + 1  # no zeros in the input
        outs = []
        with shardlab.patched():
            for mesh, places, sizes in [
                (mesh1, [Replicate()], None),  # = one device
                (mesh1, [Shard(2)], [[5, 0, 1, 5]]),
                (mesh1, [Shard(0)], [[0, 2, 1, 0]]),
                (mesh2, [Shard(3), Shard(2)], [[1, 5], [6, 5]]),
            ]:
                torch.manual_seed(11)
                x = g.clone().requires_grad_()
                y = F.dropout(distribute(x, mesh, places, sizes=sizes), p=0.4)
                out = y.full_tensor()
                out.sum().backward()
                outs.append((out, x.grad))
            evals = F.dropout(distribute(g, mesh1, [Shard(2)]), 0.4, training=False)
        same = all(torch.equal(o, outs[0][0]) and torch.equal(gr, outs[0][1]) for o, gr in outs)
        kept = outs[0][0] != 0
        scale_ok = torch.allclose(outs[0][0][kept], g[kept] / 0.6)
        grad_ok = torch.equal(outs[0][1], kept.double() / 0.6)
        rate = 1 - kept.double().mean().item()
        return same, scale_ok, grad_ok, rate, torch.equal(evals.full_tensor(), g)

    for same, scale_ok, grad_ok, rate, ident in ranks_for(4).run(body):
        assert same and scale_ok and grad_ok and ident
        assert 0.3 < rate < 0.5, rate


def test_edge_probabilities_and_errors(ranks_for):
    def body():
        mesh = this_rank().mesh
        x = distribute(torch.randn(2, 5, 3), mesh, [Shard(1)], sizes=[4, 1])
        with shardlab.patched():
            errors = []
            for p in (-0.1, 1.5):
                try:
                    F.dropout(x, p)
                except ValueError as exc:
                    errors.append(str(exc))
            same = F.dropout(x, 0.0) is x and F.dropout(x, 0.5, training=False) is x
            zeros = F.dropout(x, 1.0).full_tensor().abs().sum().item() == 0
        return errors, same, zeros

    for errors, same, zeros in ranks_for(2).run(body):
        assert len(errors) == 2 and "between 0 and 1" in errors[0] and same and zeros


def test_flattened_and_doubly_cut_rows_keep_their_layout(ranks_for):
    """(B, S, D) with S cut, flattened to (B*S, D) (a strided layout, as transformers' MLPs
    do), and a dim cut by both dims of a 2-D mesh: dropout (and a layer norm over the last
    dim) keep the layout and send nothing; the mask is one device's."""

    def body():
        from shardlab import this_rank
        from shardlab.trace import trace

        mesh1, mesh2 = this_rank().mesh, this_rank().mesh_for((2, 2))
        g = torch.rand(3, 11, 6, dtype=torch.float64) + 1
        w = torch.randn(6, dtype=torch.float64)
        torch.manual_seed(5)
        ref = F.layer_norm(F.dropout(g.reshape(33, 6), p=0.3), (6,), w)
        res = []
        with shardlab.patched():
            for mesh, places, sizes in [
                (mesh1, [Shard(1)], [[4, 0, 2, 5]]),  # flattened below: strided rows
                (mesh2, [Shard(0), Shard(0)], [[2, 1], [(1, 1), (1, 0)]]),  # doubly cut
            ]:
                st = distribute(g, mesh, places, sizes=sizes).reshape(33, 6)
                before = st.sharding
                torch.manual_seed(5)
                with trace() as t, mask_scheme("torch"):  # torch's own mask, as ref's
                    y = F.layer_norm(F.dropout(st, p=0.3), (6,), w)
                res.append((torch.allclose(y.full_tensor(), ref), y.sharding == before,
                            t.counts()))  # fmt: skip
        return res

    for per_rank in ranks_for(4).run(body):
        for ok, same_layout, counts in per_rank:
            assert ok and same_layout and counts == {}, (ok, same_layout, counts)
