"""The private torch behaviour shardlab relies on (``shardlab/_compat.py``), pinned.

A new torch release that changes one of these fails here, in one place, rather than
deep inside a sharded model.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from shardlab import _compat


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo group (world 1) for the DTensor objects below."""
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(29400 + os.getpid() % 500)
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def test_the_installed_torch_is_in_the_supported_range():
    lo, hi = _compat.SUPPORTED
    assert lo <= _compat.torch_version() <= hi
    _compat.check_torch_version()


def test_an_unsupported_torch_is_one_clear_message(monkeypatch):
    from importlib import metadata

    for version in ("2.10.1", "2.16.0.dev20261101", "3.0.0"):
        monkeypatch.setattr(metadata, "version", lambda name, v=version: v)
        with pytest.raises(ImportError, match=r"supports torch 2\.11 to 2\.15.*pip install"):
            _compat.check_torch_version()


def test_dtensor_spec_fields(mesh):
    from torch.distributed.tensor import DTensor, Shard

    spec = _compat.dtensor_spec(mesh, (Shard(0),), (4, 3), (3, 1), torch.float64)
    assert spec.placements == (Shard(0),) and tuple(spec.tensor_meta.shape) == (4, 3)
    t = DTensor(torch.zeros(4, 3, dtype=torch.float64), spec, requires_grad=False)
    assert tuple(t.shape) == (4, 3) and t.stride() == (3, 1) and t.placements == (Shard(0),)


def test_strided_shard_is_rows_of_chunks():
    """``_StridedShard(d, split_factor=f)``: dim d as (f, n/f), each row chunked: what
    ``layout_of_dtensor`` reads as atoms (f, n/f) with atom 1 cut in chunks."""
    from torch.distributed.tensor.placement_types import _StridedShard

    p = _StridedShard(0, split_factor=3)
    assert _compat.strided_shard_parts(p) == (0, 3)
    pieces, _ = p._split_tensor(torch.arange(12), 2, with_padding=False)
    assert [t.tolist() for t in pieces] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]


def test_subclass_dispatch_needs_routing_exactly_where_compat_says(mesh):
    """2.11 sends DTensor subclasses to DTensor's C++ dispatch even when they override
    ``__torch_dispatch__``; later releases call the override. ``route_dispatch`` covers
    the first case through torch's per-(op, class) rule registry."""
    from torch.distributed.tensor import DTensor, Replicate

    calls = []

    class Sub(DTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return torch.zeros(())

    d = DTensor.from_local(torch.ones(3), mesh, [Replicate()])
    s = Sub(d._local_tensor, d._spec, requires_grad=False)
    _ = s + 1
    assert bool(calls) != _compat.subclass_dispatch_is_bypassed()
    from torch._library.simple_registry import singleton

    assert hasattr(singleton.find("aten::add.Tensor").torch_dispatch_rules, "register")


def test_decompositions_and_tags_exist():
    aten = torch.ops.aten
    assert _compat.decomposition(aten.addmm.default) is not None  # the Python table
    assert _compat.decomposition(aten.expand_as.default) is not None  # composite kernel
    assert torch.Tag.pointwise in aten.add.Tensor.tags
    assert torch.Tag.nondeterministic_seeded in aten.bernoulli.default.tags
