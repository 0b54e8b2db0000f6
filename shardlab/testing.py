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


def pytest_collection_modifyitems(session, config, items):
    for name in {item.module.__name__ for item in items if getattr(item, "module", None)}:
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)


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
