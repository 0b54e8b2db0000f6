"""Whole-tensor gathers are never silent (``shardlab/comm/gathers.py``): an op with no rule
for a cut layout warns once per op and layout on every rank, ``gathers("raise")`` and
``patched(gather="raise")`` refuse it on every rank before anything is sent, and
``shardlab.explain`` lists it under its module."""

from __future__ import annotations

import pytest
import torch


def test_a_gather_warns_once_per_op_and_layout_on_every_rank(ranks_for):
    def body():
        import warnings

        from torch.distributed.tensor import Replicate, Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(9, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[5, 4]])
        whole = shardlab.distribute(g, mesh, [Replicate()])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = torch.fft.rfft(x)  # a signal cut along its only dim: no rule, the fallback
            torch.fft.rfft(x)  # the same op and layout: warned already
            torch.fft.rfft(whole)  # every rank holds it whole: no gather
        said = [str(m.message) for m in w if issubclass(m.category, shardlab.GatherWarning)]
        return said, torch.allclose(y.full_tensor(), torch.fft.rfft(g))

    for said, exact in ranks_for(2).run(body):
        assert exact
        assert len(said) == 1, said
        (msg,) = said
        assert "_fft_r2c has no rule" in msg and "Shard(0) sizes [5, 4] on mesh dim 0" in msg
        assert "(9,) onto every rank (72 B per rank" in msg and "a rule is missing" in msg


def test_gathers_raise_refuses_on_every_rank_before_sending(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        x = shardlab.distribute(torch.randn(7), mesh, [Shard(0)], [[4, 3]])  # (one dim)
        out = {}
        with shardlab.trace() as t:
            try:
                with shardlab.gathers("raise"):
                    torch.fft.fft(x)
            except shardlab.GatherError as e:
                out["raised"] = "_fft_r2c" in str(e) and "refused" in str(e)
        out["sent"] = len(t.events)
        try:
            with shardlab.patched(gather="raise"):
                torch.fft.rfft(x)
        except shardlab.GatherError:
            out["patched"] = True
        y = torch.fft.rfft(x)  # outside the scopes: the default (warns), exact
        out["after"] = y.shape == (4,)
        with shardlab.gathers("ignore"), shardlab.patched(gather=None):
            out["ignored"] = torch.fft.rfft(x * 3).shape == (4,)
        return out

    for out in ranks_for(2).run(body):
        assert out == {"raised": True, "sent": 0, "patched": True, "after": True, "ignored": True}


def test_a_bad_mode_names_the_argument():
    from shardlab.comm.gathers import gathers

    with pytest.raises(ValueError, match=r"gathers\(mode\).*'raise'.*got 'loud'"):
        with gathers("loud"):
            pass


def test_is_gather_only_for_a_missing_rule_that_makes_a_cut_tensor_whole():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from shardlab.comm.gathers import is_gather
    from shardlab.layout import ShardLayout

    cut = ShardLayout.build((8, 4), (2,), [Shard(0)])
    whole = ShardLayout.build((8, 4), (2,), [Replicate()])
    other = ShardLayout.build((8, 4), (2,), [Shard(1)])
    assert is_gather(cut, whole, "whole-tensor fallback for cdist")
    assert is_gather(cut, whole, "auto-redistribute for unbind")
    assert not is_gather(cut, other, "auto-redistribute for sort")  # another dim cut instead
    assert not is_gather(cut, whole, "embedding.align")  # part of a rule's algorithm
    assert not is_gather(whole, whole, "whole-tensor fallback for cdist")
    summed = ShardLayout.build((8, 4), (2,), [Partial()])
    assert not is_gather(summed, whole, "whole-tensor fallback for div")  # an all-reduce
    empty = ShardLayout.build((0, 3), (2,), [Shard(1)], [[1, 2]])
    empty_whole = ShardLayout.build((0, 3), (2,), [Replicate()])
    assert not is_gather(empty, empty_whole, "whole-tensor fallback for _linalg_svd")  # (nothing)


def test_explain_lists_the_gathers_per_module(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        class Spectrum(torch.nn.Module):
            def forward(self, x):
                return torch.fft.rfft(x.sum(1)).abs()  # a cut 1-D signal: gathered

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(6, 6)
                self.spec = Spectrum()

            def forward(self, x):
                return self.spec(self.lin(x))

        mesh = shardlab.this_rank().mesh
        x = shardlab.distribute(torch.randn(5, 6), mesh, [Shard(0)], [[3, 2]])
        with shardlab.gathers("ignore"):
            ex = shardlab.explain(Model(), x, backward=False)
        return ex.gathers()

    for found in ranks_for(2).run(body):
        assert found == {"spec": ["_fft_r2c"]}, found
