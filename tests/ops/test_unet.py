"""A small U-Net from nn modules runs unchanged on an image sharded over H (and W).

Two levels down (max pool), two up (conv_transpose, then bilinear interpolate), skip
connections by torch.cat on channels, F.pad to the odd skip sizes, batch norm. Shard
boundaries are multiples of 4 (2 pooling levels), so pooling halves every shard, x2
upsampling doubles it back and the skip connections line up: sizes stay uneven, one
shard empty, the image 13 x 10.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab import distribute, this_rank


def _block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class UNet(nn.Module):
    def __init__(self, cin=2, cout=3, width=4):
        super().__init__()
        self.enc1, self.enc2 = _block(cin, width), _block(width, 2 * width)
        self.bottom = _block(2 * width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(2 * width, 2 * width, 2, stride=2)
        self.dec2, self.dec1 = _block(4 * width, width), _block(2 * width, width)
        self.head = nn.Conv2d(width, cout, 1)

    @staticmethod
    def _fit(u, skip):  # pad the upsampled map to the skip's (odd) size
        return F.pad(u, [0, skip.shape[3] - u.shape[3], 0, skip.shape[2] - u.shape[2]])

    def forward(self, x):
        x1 = self.enc1(x)  # (N, w, H, W)
        x2 = self.enc2(self.pool(x1))  # (N, 2w, H/2, W/2)
        x3 = self.bottom(self.pool(x2))  # (N, 2w, H/4, W/4)
        u2 = self._fit(self.up2(x3), x2)
        y2 = self.dec2(torch.cat([x2, u2], 1))
        u1 = F.interpolate(y2, scale_factor=2, mode="bilinear", align_corners=False)
        y1 = self.dec1(torch.cat([x1, self._fit(u1, x1)], 1))
        return self.head(y1)


N_BATCH_NORMS = 10


def _run(mesh_shape, placements, sizes):
    def body():

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        torch.manual_seed(0)
        ref_model, model = UNet().double(), UNet().double()
        model.load_state_dict(ref_model.state_dict())
        ok = True
        for _ in range(2):  # two training steps: running statistics too
            g = torch.randn(2, 2, 13, 10, dtype=torch.float64)
            w_out = torch.randn(2, 3, 13, 10, dtype=torch.float64)
            xr = g.clone().requires_grad_()
            ref = ref_model(xr)
            (ref * w_out).sum().backward()
            x = g.clone().requires_grad_()
            with shardlab.patched():
                st = distribute(x, mesh, placements, sizes=sizes)
                with shardlab.trace(mesh=mesh) as t:
                    y = model(st)
            out = y.full_tensor()
            (out * w_out).sum().backward()
            ok &= list(y.sharding.sizes_along(2)) == list(st.sharding.sizes_along(2))
            ok &= torch.allclose(out, ref, atol=1e-10)
            ok &= torch.allclose(x.grad, xr.grad, atol=1e-10)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                ok &= type(p.grad) is torch.Tensor and torch.allclose(p.grad, q.grad, atol=1e-10)
            for b, c in zip(model.buffers(), ref_model.buffers()):
                ok &= torch.allclose(b.double(), c.double(), atol=1e-12)
            model.zero_grad()
            ref_model.zero_grad()
        kinds = t.counts()
        stats = t.filter(label="batch_norm.stats forward").counts()
        return bool(ok), kinds, stats

    return body


def test_unet_4_ranks_uneven_h(ranks_for):
    for ok, kinds, stats in ranks_for(4).run(_run((4,), [Shard(2)], [[4, 4, 0, 5]])):
        assert ok
        assert stats == {"all_reduce": N_BATCH_NORMS}  # one per batch norm, forward
        assert kinds["all_reduce"] == N_BATCH_NORMS  # all else: point-to-point halos
        assert set(kinds) <= {"all_reduce", "send", "recv"}


def test_unet_2d_mesh_h_and_w(ranks_for):
    got = ranks_for(4).run(_run((2, 2), [Shard(2), Shard(3)], [[8, 5], [4, 6]]))
    for ok, kinds, stats in got:
        assert ok and stats == {"all_reduce": N_BATCH_NORMS}
        assert kinds["all_reduce"] == N_BATCH_NORMS


def test_unet_unaligned_shard_boundaries(ranks_for):
    """Boundaries that pooling does not halve evenly ([3, 5, 1, 4]): the skip connections
    meet layouts of other sizes, which are moved to match (point to point), still exact."""
    for ok, kinds, stats in ranks_for(4).run(_run((4,), [Shard(2)], [[3, 5, 1, 4]])):
        assert ok and stats == {"all_reduce": N_BATCH_NORMS}
        assert set(kinds) <= {"all_reduce", "send", "recv"}
