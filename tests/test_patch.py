"""The wrapt patches: routing, identical plain calls, idempotent, reversible, thread-safe."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab import patch
from shardlab.patch import PATCHED_NAMES
from tests.conftest import python_last_line


def _originals():
    return {name: getattr(F, name) for name in PATCHED_NAMES}


def test_enable_disable_idempotent_and_reversible():
    before = _originals()
    assert not patch.is_enabled()
    shardlab.enable()
    shardlab.enable()
    wrapped = _originals()
    assert all(wrapped[n] is not before[n] for n in PATCHED_NAMES)
    assert all(getattr(F, n).__wrapped__ is before[n] for n in PATCHED_NAMES)
    shardlab.disable()
    shardlab.disable()
    assert _originals() == before and not patch.is_enabled()


def test_context_restores_even_on_exception():
    before = _originals()
    with pytest.raises(KeyError):
        with shardlab.patched():
            assert patch.is_enabled()
            with shardlab.patched():  # nested: the outer one still owns the patches
                pass
            assert patch.is_enabled()
            raise KeyError
    assert _originals() == before
    shardlab.enable()
    with shardlab.patched():
        pass
    assert patch.is_enabled()  # it was enabled before the block: stays enabled
    shardlab.disable()
    assert _originals() == before


def test_plain_calls_identical_results_and_errors():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
    logits, target = torch.randn(5, 7), torch.randint(0, 7, (5,))
    q = torch.randn(1, 2, 4, 8)
    calls = [
        lambda: F.conv2d(x, w, padding=1, stride=2),
        lambda: F.conv1d(x[:, :, 0], w[:, :, 0], padding="same"),
        lambda: F.conv_transpose2d(x, w.transpose(0, 1), stride=2, output_padding=1),
        lambda: F.pad(x, (1, 2, 2, 1), mode="reflect"),
        lambda: F.cross_entropy(logits, target, label_smoothing=0.1),
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        lambda: torch.nn.Conv2d(3, 4, 3, padding_mode="circular", padding=1)(x),
    ]
    bad = [
        lambda: F.conv2d(x, w[:, :2]),
        lambda: F.pad(x, (1,), mode="reflect"),
        lambda: F.cross_entropy(logits, target + 10),
    ]
    torch.manual_seed(1)
    want = [c() for c in calls]
    want_err = []
    for c in bad:
        with pytest.raises(Exception) as info:
            c()
        want_err.append((type(info.value), str(info.value)))
    with shardlab.patched():
        torch.manual_seed(1)
        got = [c() for c in calls]
        for c, (etype, msg) in zip(bad, want_err):
            with pytest.raises(etype) as info:
                c()
            assert str(info.value) == msg
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_thread_safe_enable_disable():
    before, failed = _originals(), []

    def churn():
        try:
            for _ in range(200):
                with shardlab.patched():  # (another thread may unpatch while this one
                    F.conv1d(torch.ones(1, 1, 4), torch.ones(1, 1, 2))  # is in a wrapper)
        except Exception as e:  # noqa: BLE001  (reported below, with the thread's error)
            failed.append(repr(e))

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shardlab.disable()
    assert not failed, failed
    assert _originals() == before


def test_shard_tensor_routes_and_unhandled_names_say_what_is_supported(ranks_for):
    def body():
        mesh = shardlab.this_rank().mesh
        with shardlab.patched():
            x = shardlab.distribute(torch.randn(2, 3, 8), mesh, [Shard(2)])
            y = F.conv1d(x, torch.randn(4, 3, 3), padding=1)
            from shardlab.engine.registry import RULES
            from shardlab.ops.registry import original

            ce = original("cross_entropy")
            saved = RULES.pop(ce, None)  # as if it had no handler
            try:
                F.cross_entropy(x, x)
                msg = None
            except NotImplementedError as exc:
                msg = str(exc)
            finally:
                if saved is not None:
                    RULES[ce] = saved
        still = F.conv1d is patch.ORIGINALS.get("conv1d", F.conv1d)
        return type(y).__name__, msg, still

    for kind, msg, _ in ranks_for(2).run(body):
        assert kind == "ShardTensor"
        assert "cross_entropy" in msg and "conv2d" in msg


FAKE_NATTEN = """
def na1d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None):
    return "natten's own na1d"


def na2d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None):
    return "natten's own na2d"


def na3d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None):
    return "natten's own na3d"
"""


def test_natten_imported_after_enable_routes_shard_tensors(ranks_for, tmp_path):
    """natten has no CPU wheel here: a stand-in package with its signatures, imported
    after ``patched()`` (wrapt's import hook) and before (patched at enable)."""
    pkg = tmp_path / "natten"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from natten.functional import na1d, na2d, na3d\n")
    (pkg / "functional.py").write_text(FAKE_NATTEN)

    def body(path):
        import importlib
        import sys

        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.ops.neighborhood import na1d

        sys.path.insert(0, path)
        x = torch.randn(1, 9, 1, 2, dtype=torch.float64)
        sx = distribute(x, this_rank().mesh, [Shard(1)], [[4, 5]])
        out = {}
        try:
            with shardlab.patched():
                import natten.functional as nf  # first import: inside the block

                out["plain"] = nf.na1d(x, x, x, 3)
                y = nf.na1d(sx, sx, sx, 3)
                out["sharded"] = type(y).__name__
                out["exact"] = torch.allclose(y.full_tensor(), na1d(x, x, x, 3))
                try:
                    nf.na1d(sx, sx, sx, 3, stride=2)
                except NotImplementedError as exc:
                    out["stride"] = str(exc)
            out["after"] = nf.na1d(sx, sx, sx, 3)  # restored
            with shardlab.patched():  # natten already imported: patched again
                out["again"] = type(importlib.import_module("natten").na2d).__name__
            out["restored"] = type(nf.na2d).__name__
        finally:
            sys.path.remove(path)
            for m in [m for m in sys.modules if m.startswith("natten")]:
                del sys.modules[m]
        return out

    for r in ranks_for(2).run(body, str(tmp_path)):
        assert r["plain"] == "natten's own na1d" and r["sharded"] == "ShardTensor", r
        assert r["exact"] and "stride=2 is not supported" in r["stride"], r
        assert r["after"] == "natten's own na1d", r
        assert r["again"] == "FunctionWrapper" and r["restored"] == "function", r


def test_dynamo_imported_under_patched_still_traces_torch_functions():
    """torch imports dynamo on the first op it checks (a ShardTensor op's meta check, under
    ``shardlab.patched()``); imported while ``F.max_pool2d`` is patched, dynamo took the
    wrapper for torch's function and broke every later compiled graph at it (torch 2.15).
    A fresh interpreter: dynamo first imported inside ``patched()``, then a plain model
    compiled outside it has no graph break."""
    code = (
        "import sys, torch, torch.nn.functional as F, shardlab\n"
        "with shardlab.patched():\n"
        "    import torch._dynamo\n"
        "from torch._dynamo.utils import counters\n"
        "f = torch.compile(lambda x: F.max_pool2d(x, 2) + F.avg_pool2d(x, 2), backend='eager')\n"
        "f(torch.randn(1, 1, 4, 4))\n"
        "print(sum(counters['graph_break'].values()))\n"
    )
    assert python_last_line(code) == "0"


def test_a_compiled_step_entering_patched_each_time_compiles_once():
    """A compiled graph guards on the type of each ``F`` function it calls; a step that
    enters ``shardlab.patched()`` itself (once per step) met a new wrapper type each time
    and recompiled every step. The same wrapper goes back at each ``enable()``."""
    from torch._dynamo.utils import counters

    with shardlab.patched():
        first = F.conv1d
    with shardlab.patched():
        assert F.conv1d is first
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda x, w: F.conv1d(x, w, padding=1).relu().sum(), backend="eager")
    x, w = torch.randn(1, 2, 9), torch.randn(3, 2, 3)
    for _ in range(3):
        with shardlab.patched():
            got = step(x, w)
    assert torch.allclose(got, F.conv1d(x, w, padding=1).relu().sum())
    assert counters["stats"]["unique_graphs"] == 1
