"""Training through distributed checkpoints: a model with ShardTensor parameters and its
AdamW state, and tutorial 08's FSDP x domain-parallel model, saved after one step with
``get_state_dict`` + ``dcp.save``, loaded into a fresh model and optimizer with ``dcp.load``
+ ``set_state_dict``: the loaded state is the saved one bit for bit, and one more step
equals the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardlab import distribute, this_rank


def _mlp(sizes, seed):
    """(5 -> 7 -> 3) MLP whose parameters are ShardTensors: rows cut by ``sizes``, columns
    cut by ``sizes``, a replicated bias; and its AdamW."""
    import torch.nn as nn

    mesh = this_rank().mesh
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    places = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": None}
    for name, p in list(m.named_parameters()):
        i, attr = name.split(".")
        place = places[name]
        st = distribute(p.detach(), mesh, [place or Replicate()], [sizes] if place else None)
        setattr(m[int(i)], attr, nn.Parameter(st))
    return m, torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)


def _step(model, optimizer, seed):
    import torch.nn.functional as F

    import shardlab

    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, generator=gen).double(), torch.randn(4, 3, generator=gen).double()
    with shardlab.patched():
        loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _values(model, optimizer):
    """Every parameter and optimizer state as a whole plain tensor (a copy), by name."""

    def whole(t):  # ShardTensor or DTensor (full_tensor of a replicated one may alias it)
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    full = {n: whole(p) for n, p in model.named_parameters()}
    names = dict(enumerate(full))
    for i, state in optimizer.state_dict()["state"].items():
        for key, v in state.items():
            full[f"{names[i]}.{key}"] = whole(v)
    return full


def _train(path, sizes, resume, make=_mlp, step=_step):
    """Save after one step; then either one more step (the uninterrupted run) or, when
    ``resume``, load into a fresh model and optimizer first."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not resume:
        model, optimizer = make(sizes, 0)
        step(model, optimizer, 1)
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        saved = _values(model, optimizer)
        step(model, optimizer, 2)
        return saved, _values(model, optimizer)
    model, optimizer = make(sizes, 1)  # other initial values
    msd, osd = get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    loaded = _values(model, optimizer)
    step(model, optimizer, 2)
    return loaded, _values(model, optimizer)


def _equal(a, b, exact):
    same = a.keys() == b.keys()
    for k in a:
        close = torch.allclose(a[k], b[k], rtol=1e-12, atol=1e-15)
        same &= torch.equal(a[k], b[k]) if exact else close
    return same


@pytest.mark.parametrize(
    "save_world, save_sizes, load_world, load_sizes",
    [(3, [1, 6, 0], 3, [1, 6, 0]), (3, [1, 6, 0], 3, [3, 0, 4]), (4, [2, 0, 4, 1], 2, [0, 7])],
)
def test_model_and_adamw_resume_exactly(
    ranks_for, tmp_path, save_world, save_sizes, load_world, load_sizes
):
    """The loaded state equals the saved one bit for bit; one more step equals the
    uninterrupted run (bit for bit on the same layout; other sizes sum the gradients in
    another order, so there to float64 rounding)."""
    saved, after = ranks_for(save_world).run(_train, str(tmp_path), save_sizes, False)[0]
    for loaded, resumed in ranks_for(load_world).run(_train, str(tmp_path), load_sizes, True):
        assert len(saved) == 16 and _equal(loaded, saved, exact=True)
        assert _equal(resumed, after, exact=save_sizes == load_sizes)


def _fsdp_domain(sizes, seed):
    """Tutorial 08's model: FSDP over mesh dim 'dp' (plain DTensor parameters), image rows
    cut over 'domain' (ShardTensor activations), on a (2, 2) mesh; and its AdamW."""
    import copy

    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from shardlab import this_rank

    mesh = this_rank().mesh_for((2, 2), names=("dp", "domain"))
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(8, 2, 1),
    ).double()
    net = fully_shard(copy.deepcopy(net), mesh=mesh["dp"])
    net.shardlab_input = (mesh, sizes)
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def _fsdp_step(net, optimizer, seed):
    import torch.nn.functional as F

    import shardlab

    mesh, sizes = net.shardlab_input
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(4, 3, 13, 10, generator=gen, dtype=torch.float64)
    mine = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    with shardlab.patched():
        x = distribute(images[mine], mesh["domain"], [Shard(2)], sizes)
        y = distribute(images[mine, :2].tanh(), mesh["domain"], [Shard(2)], sizes)
        loss = F.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
    optimizer.step()


def test_fsdp_and_domain_parallel_model_resumes_exactly(ranks_for, tmp_path):
    """Tutorial 08 (FSDP x domain), saved after a step and resumed: bit-exact."""
    args = str(tmp_path), [9, 4]
    saved, after = ranks_for(4).run(_train, *args, False, _fsdp_domain, _fsdp_step)[0]
    for loaded, resumed in ranks_for(4).run(_train, *args, True, _fsdp_domain, _fsdp_step):
        assert len(saved) == 6 * 4 and _equal(loaded, saved, exact=True)
        assert _equal(resumed, after, exact=True)
