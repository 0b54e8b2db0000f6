"""Fourier transforms along dims no mesh dim cuts (``shardlab/engine/aten/fft.py``): each
rank transforms its own block; values and gradients equal one device; no message in the
forward, no whole-tensor gather in the backward (``rfft``'s backward still pads its
gradient into a whole ``new_zeros``: one all-gather of the gradient, ``copy_.align``);
along a cut dim, the gather is said."""

from __future__ import annotations

import pytest
import torch

FFTS = {
    "rfft": lambda t, d: torch.fft.rfft(t, dim=d).abs(),
    "fft": lambda t, d: torch.fft.fft(t, dim=d).real,
    "ifft": lambda t, d: torch.fft.ifft(t, dim=d, norm="forward").imag,
    "irfft(rfft)": lambda t, d: torch.fft.irfft(2 * torch.fft.rfft(t, dim=d), n=t.shape[d], dim=d),
    "hfft": lambda t, d: torch.fft.hfft(t, dim=d),
    "rfftn": lambda t, d: torch.fft.rfftn(t, dim=(0, d)).abs() if d != 0 else t.sum(),
}


def _body(seed):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import random_sizes

    rng = random.Random(seed)
    mesh = shardlab.this_rank().mesh
    bad, sent = [], []
    for case in range(6):
        shape = (rng.randint(1, 4), rng.randint(2, 9), rng.randint(2, 8))  # (hfft: n >= 2)
        cut = rng.choice([1, 2])
        dim = 2 if cut == 1 else 1  # a dim the cut does not touch
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        sizes = random_sizes(rng, shape[cut], mesh.size())
        for name, fn in FFTS.items():
            x = shardlab.distribute(g, mesh, [Shard(cut)], [sizes]).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x, dim)
            with shardlab.gathers("raise"):
                y.sum().backward()
            want = fn(ref, dim)
            want.sum().backward()
            if not (
                torch.allclose(y.full_tensor(), want, atol=1e-9)
                and torch.allclose(x.grad.full_tensor(), ref.grad, atol=1e-9)
            ):
                bad.append((name, shape, cut, sizes))
            sent.append((name, [e.label for e in t.events]))
    return bad, sent


@pytest.mark.parametrize("world", [2, 3])
def test_ffts_along_uncut_dims_run_on_each_block(ranks_for, world):
    for bad, sent in ranks_for(world).run(_body, world):
        assert not bad, bad[:3]
        assert all(not labels for _, labels in sent), [s for s in sent if s[1]][:3]  # forward


def test_an_fft_along_a_cut_dim_says_it_gathers(ranks_for):
    def body():
        import warnings

        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(6, 4, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 2]])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = torch.fft.rfft(x, dim=0)
        said = [m for m in w if issubclass(m.category, shardlab.GatherWarning)]
        return torch.allclose(y.full_tensor(), torch.fft.rfft(g, dim=0)), len(said)

    for exact, said in ranks_for(2).run(body):
        assert exact and said == 1
