"""neuraloperator's FNO, unchanged, on a field cut along H (issue 62, item 3): it dispatches
its spectral contraction through opt_einsum (which reads the class's module) and
transforms with ``rfftn`` over (H, W), whose cut moves to W and back (``_fft_r2c.transpose``)
instead of a whole-field gather. Loss, every parameter's gradient and an optimizer step
equal one device (float32: neuraloperator keeps complex64 weights; tolerance 1e-5).

What stays whole, by the library's own code: its ``SpectralConv`` writes the contracted
modes into a plain ``torch.zeros`` spectrum (``out_fft[slices] = ...``), a tensor that
holds the whole value by definition. That copy gathers the kept modes, (B, C, m_H, m_W)
complex numbers, not the field; the inverse transform then runs on that plain tensor."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("neuralop")


def _body(world):
    from neuralop.models import FNO
    from torch.distributed.tensor import Shard

    import shardlab

    torch.manual_seed(0)
    model = FNO(n_modes=(4, 4), hidden_channels=8, in_channels=1, out_channels=1, n_layers=2)
    ref = FNO(n_modes=(4, 4), hidden_channels=8, in_channels=1, out_channels=1, n_layers=2)
    ref.load_state_dict(model.state_dict())
    mesh = shardlab.this_rank().mesh
    g = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    sizes = {2: [9, 7], 3: [7, 0, 9]}[world]  # uneven, an empty piece
    x = shardlab.distribute(g, mesh, [Shard(2)], [sizes])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    with shardlab.patched(), shardlab.trace() as t:
        loss = (model(x) - shardlab.distribute(target, mesh, [Shard(2)], [sizes])).pow(2).mean()
        loss.backward()
    want = (ref(g) - target).pow(2).mean()
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    bad = [n for n, p in ref.named_parameters() if not torch.allclose(grads[n], p.grad, atol=1e-5)]
    opt.step()
    opt_ref.step()
    stepped = all(
        torch.allclose(a, b, atol=1e-5)
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )
    gathers = [(e.kind, e.bytes, e.shapes) for e in t.events if e.label.startswith("whole")]
    labels = sorted({e.label for e in t.events})
    return abs(loss.full_tensor().item() - want.item()) < 1e-5, bad, stepped, gathers, labels


@pytest.mark.parametrize("world", [2, 3])
def test_fno_trains_on_a_field_cut_along_h_with_its_transforms_on_the_shards(ranks_for, world):
    for exact, bad, stepped, gathers, labels in ranks_for(world).run(_body, world):
        assert exact and not bad and stepped, bad
        assert "_fft_r2c.transpose" in labels, labels  # rfftn's cut moved, not gathered
        # the only whole-tensor copy: the kept modes into the library's plain spectrum,
        # (B=2, C=8, 4, 3) complex64 per layer and rank (the field is (2, 8, 16, 16))
        modes = 2 * 8 * 4 * 3 * 8
        assert all(b <= modes for _, b, _ in gathers), gathers
        assert all(shape[1:4] == (8, 4, 3) for _, _, shapes in gathers for shape in shapes)
