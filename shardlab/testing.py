"""pytest plugin: one persistent pool of ranks per world size, shared by the session.

Enabled with ``-p shardlab.testing`` (the project's pytest config does it).
A multi-rank test is then a plain function::

    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_sum(ranks_for, world):
        def body():
            x = torch.ones(1); dist.all_reduce(x); return x.item()
        assert ranks_for(world).run(body) == [world] * world

Test modules are pickled by value, so their functions reach the ranks whatever
``sys.path`` the ranks started with.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from shardlab.runtime import Ranks

TEST_TIMEOUT = 10.0  # seconds a broken collective may block a test's ranks


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped, with the reason, where torch sees none)"
    )


def pytest_collection_modifyitems(session, config, items):
    for name in {item.module.__name__ for item in items if getattr(item, "module", None)}:
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch  # is_available() asks the driver; it creates no CUDA context

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(
                reason="no CUDA device here (torch.cuda.is_available() is False)"
            )
            for item in gpu:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def ranks_for():
    """``ranks_for(n)`` -> the session's :class:`shardlab.Ranks` of ``n`` gloo ranks."""
    pools: dict[int, Ranks] = {}

    def get(n: int) -> Ranks:
        if n not in pools or pools[n]._closed:
            pools[n] = Ranks(n, timeout=TEST_TIMEOUT)
        return pools[n]

    yield get
    for p in pools.values():
        p.close()


@pytest.fixture(scope="session")
def cuda_ranks_for():
    """``cuda_ranks_for(n)`` -> the session's pool of ``n`` ranks on CUDA: nccl with one
    GPU per rank where there are enough, else gloo ranks sharing the GPUs (point to
    point staged through host memory). For tests marked ``gpu``."""
    pools: dict[int, Ranks] = {}

    def get(n: int) -> Ranks:
        import torch

        if n not in pools or pools[n]._closed:
            backend = "nccl" if torch.cuda.device_count() >= n else "gloo"
            pools[n] = Ranks(n, backend=backend, device="cuda", timeout=60.0)
        return pools[n]

    yield get
    for p in pools.values():
        p.close()
