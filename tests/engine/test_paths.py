"""How far an op travels through the code (docs/guides/engine.md): a call the engine has
seen before runs through at most three of shardlab's files, with or without autograd; a
call it has not seen reaches its rule within six."""

from __future__ import annotations


def _files_of(op, x) -> list[str]:
    """The shardlab files whose code runs during ``op(x)``, in first-call order."""
    import sys

    files: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and "/shardlab/" in frame.f_code.co_filename:
            name = frame.f_code.co_filename.split("/shardlab/", 1)[1]
            if name not in files:
                files.append(name)

    sys.setprofile(profile)
    try:
        op(x)
    finally:
        sys.setprofile(None)
    return files


RULES = {"mul": "engine/aten/pointwise.py", "sum": "engine/aten/reductions.py",
         "view": "engine/aten/views.py"}  # fmt: skip


def test_a_kept_decision_runs_through_three_files_a_miss_reaches_its_rule_within_six(ranks_for):
    def body():
        import torch
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab.engine import decisions, meta, nograd

        mesh = shardlab.this_rank().mesh
        out = {}
        for grad in (False, True):
            x = shardlab.distribute(torch.randn(8, 4), mesh, [Shard(0)]).requires_grad_(grad)
            ops = {
                "mul": lambda t: t * 2.0,
                "sum": lambda t: t.sum(0),
                "view": lambda t: t.view(4, 8),
            }
            for op in ops.values():  # once first: a fresh rank's one-time setup (the
                op(x)  # registry loading its rules) is not the path of a miss
            for name, op in ops.items():
                decisions.clear()
                nograd.TABLE.clear()
                meta._META_CACHE.clear()  # (torch's meta run too: the coldest miss)
                miss = _files_of(op, x)
                for _ in range(3):  # kept (the no-grad replay learns on its second call)
                    op(x)
                out[grad, name] = (miss, _files_of(op, x))
        return out

    for r, paths in enumerate(ranks_for(2).run(body)):
        for (grad, name), (miss, hit) in paths.items():
            assert len(hit) <= 3, (r, grad, name, hit)
            assert hit[0] == "tensor/entry.py", hit
            assert "engine/dispatch.py" in miss, miss  # (the full path: decided again)
            assert set(hit) < set(miss), (hit, miss)
            assert RULES[name] in miss[:6], (r, grad, name, miss)
