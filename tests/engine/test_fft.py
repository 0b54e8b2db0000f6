"""Fourier transforms along dims no mesh dim cuts (``shardlab/engine/aten/fft.py``): each
rank transforms its own block; values and gradients equal one device; no message in the
forward, none in the backward either (``shardlab/ops/fft.py`` writes ``rfft``'s backward
with ops that stay cut). Along a cut dim (``_transposed``): the cut moves to another dim,
one all-to-all per transposition; a 1-D signal cut along its only dim says it gathers."""

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


CUT = {
    "fft": lambda t, d: torch.fft.fft(t, dim=d[0]),
    "ifft ortho": lambda t, d: torch.fft.ifft(t, dim=d[0], norm="ortho"),
    "rfft": lambda t, d: torch.fft.rfft(t, dim=d[0]),
    "rfft n=5": lambda t, d: torch.fft.rfft(t, n=5, dim=d[0]),
    "irfft(rfft)": lambda t, d: torch.fft.irfft(
        torch.fft.rfft(t, dim=d[0]), n=t.shape[d[0]], dim=d[0]
    ),
    "fft2": lambda t, d: torch.fft.fft2(t, dim=d),
    "rfft2 forward": lambda t, d: torch.fft.rfft2(t, dim=d, norm="forward"),
    "irfft2(rfft2)": lambda t, d: torch.fft.irfft2(
        torch.fft.rfft2(t, dim=d), s=[t.shape[k] for k in d], dim=d
    ),
    "fftn": lambda t, d: torch.fft.fftn(t),
    "rfftn s": lambda t, d: torch.fft.rfftn(t, s=(3, 6)),
    "hfft": lambda t, d: torch.fft.hfft(t, dim=d[0]),
    "ihfft2 ortho": lambda t, d: torch.fft.ihfft2(t, dim=d, norm="ortho"),
}  # fmt: skip


def _cut_body(seed, world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import sizes_for

    rng = random.Random(seed)
    meshes = [shardlab.this_rank().mesh]
    if world == 4:
        meshes.append(shardlab.this_rank().mesh_for((2, 2)))
    bad = []
    for case in range(8):
        mesh = meshes[case % len(meshes)]
        shape = tuple(rng.randint(2, 7) for _ in range(3))
        places = [Shard(rng.randint(0, 2)) for _ in range(mesh.ndim)]
        sizes = sizes_for(rng, shape, tuple(mesh.shape), places)
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        for name, fn in CUT.items():
            d = rng.sample([0, 1, 2], 2)
            x = shardlab.distribute(g, mesh, places, sizes).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"):
                y = fn(x, d)
            want = fn(ref, d)
            seed = torch.Generator().manual_seed(1)
            w = torch.randn(want.shape, dtype=want.dtype, generator=seed)
            with shardlab.gathers("raise"):
                torch.real(y * w).sum().backward()
            torch.real(want * w).sum().backward()
            if not (
                torch.allclose(y.full_tensor(), want, atol=1e-9)
                and torch.allclose(x.grad.full_tensor(), ref.grad, atol=1e-9)
            ):
                bad.append((name, shape, places, sizes, d))
    return bad


@pytest.mark.parametrize(
    "world", [2, 3, pytest.param(4, marks=pytest.mark.more_worlds)]
)  # fmt: skip
def test_ffts_along_cut_dims_move_the_cut_and_equal_one_device(ranks_for, world):
    """Every transform along cut dims, 1-D and 2-D meshes, uneven and empty pieces: the
    cut moves to another dim (an all-to-all), never a whole-tensor gather, forward or
    backward (``gathers("raise")``)."""
    for bad in ranks_for(world).run(_cut_body, world, world):
        assert not bad, bad[:3]


def test_rfft2_and_irfft2_of_an_image_cut_along_h_each_move_every_element_once(ranks_for):
    """The issue's case: ``rfft2`` / ``irfft2`` over (H, W) of a (B, C, H, W) image cut
    along H: one all-to-all each way, forward and backward (each element of the spectrum
    sent once, point to point), the spectrum cut along W, the image back along H."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(2, 3, 7, 8, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(2)], [[3, 2, 2]]).requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as forward:
            spectrum = torch.fft.rfft2(x)  # (2, 3, 7, 5) complex
            back = torch.fft.irfft2(spectrum * 2, s=(7, 8))
        with shardlab.gathers("raise"), shardlab.trace() as backward:
            back.pow(2).sum().backward()
        ref = g.clone().requires_grad_(True)
        want = torch.fft.irfft2(torch.fft.rfft2(ref) * 2, s=(7, 8))
        want.pow(2).sum().backward()
        return (
            [(e.kind, e.bytes, e.label) for e in forward.events],
            [(e.kind, e.bytes, e.label) for e in backward.events],
            spectrum.placements[0].dim, back.placements[0].dim,
            torch.allclose(back.full_tensor(), want),
            torch.allclose(x.grad.full_tensor(), ref.grad),
        )  # fmt: skip

    out = ranks_for(3).run(body)
    spectrum_bytes = 2 * 3 * 7 * 8 * 16  # (the backward's inverse runs on the whole one)
    for forward, backward, spectrum_dim, back_dim, exact, exact_grad in out:
        assert exact and exact_grad
        assert (spectrum_dim, back_dim) == (3, 2)
        assert {label for *_, label in forward} == {"_fft_r2c.transpose", "_fft_c2r.transpose"}
        assert {label for *_, label in backward} <= {"_fft_c2c.transpose", "_fft_c2r.transpose",
                                                      "_fft_r2c.transpose"}  # fmt: skip
    # each element of the spectrum crosses at most once per transposition: the bytes all
    # ranks send are at most those of the spectrum, less what each rank keeps
    for events in ([f for f, *_ in out], [b for _, b, *_ in out]):
        for label in {lab for ev in events for *_, lab in ev}:
            sent = sum(b for ev in events for kind, b, lab in ev if kind == "send" and lab == label)
            received = sum(
                b for ev in events for kind, b, lab in ev if kind == "recv" and lab == label
            )
            assert sent == received and 0 < sent < spectrum_bytes, (label, sent)


def test_a_signal_cut_along_its_only_dim_says_it_gathers(ranks_for):
    """A 1-D signal cut along its one dim has no other dim to move the cut to: the
    whole-tensor path computes it, exact, and warns."""

    def body():
        import warnings

        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        g = torch.randn(6, dtype=torch.float64)
        x = shardlab.distribute(g, mesh, [Shard(0)], [[4, 2]])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = torch.fft.fft(x)
        said = [m for m in w if issubclass(m.category, shardlab.GatherWarning)]
        return torch.allclose(y.full_tensor(), torch.fft.fft(g)), len(said)

    for exact, said in ranks_for(2).run(body):
        assert exact and said == 1


def _roll_body(seed):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.tensor._cases import sizes_for

    mesh = shardlab.this_rank().mesh
    meshes = [mesh] + ([shardlab.this_rank().mesh_for((2, 2))] if mesh.size() == 4 else [])
    rng, bad, labels = random.Random(seed), [], set()
    for case in range(12):
        m = meshes[case % len(meshes)]
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        places = [Shard(rng.randrange(len(shape))) for _ in range(m.ndim)]
        sizes = sizes_for(rng, shape, tuple(m.shape), places)
        g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        dims = [rng.randrange(len(shape)) for _ in range(rng.randint(1, 2))]
        shifts = [rng.randint(-7, 7) for _ in dims]
        fns = {
            "roll": lambda t, s=shifts, d=dims: torch.roll(t, s, d),
            "fftshift": lambda t: torch.fft.fftshift(t),
            "ifftshift": lambda t, d=dims: torch.fft.ifftshift(t, dim=d[0]),
        }
        w = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        for name, fn in fns.items():
            x = shardlab.distribute(g, m, places, sizes).requires_grad_(True)
            ref = g.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = fn(x)
                (y * w).sum().backward()
            (fn(ref) * w).sum().backward()
            labels |= {e.label for e in t.events}
            if not (
                torch.equal(y.full_tensor(), fn(g))
                and torch.allclose(x.grad.full_tensor(), ref.grad)
            ):
                bad.append((name, shape, places, sizes, dims, shifts))
    return bad, labels


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_roll_and_fftshift_along_cut_dims_shift_rows_to_their_new_owners(ranks_for, world):
    """``roll`` (``fftshift``'s op) along a cut dim: two slices put back in the other
    order, each row sent to its new owner once (``cat.align``), no whole-tensor gather;
    forward and backward equal one device, 1-D and 2-D meshes, uneven and empty pieces."""
    for bad, labels in ranks_for(world).run(_roll_body, world):
        assert not bad, bad[:3]
        assert labels <= {"cat.align"}, labels
