"""``shardlab.explain`` on the real-models zoo: every module in call order, forward and
backward, its layouts and the messages it caused; the totals equal a tracer around the
same step; nothing stays hooked."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models import _zoo

pytest.importorskip("transformers")


def _body(name):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh, me = this_rank().mesh, this_rank().rank
        if name in _zoo.DECODERS:
            model = _zoo.decoder(name)
            ids = torch.randint(
                0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(0)
            )
            sizes = _zoo.uneven(_zoo.TOKENS[1], mesh.size())
            make = lambda: {
                "input_ids": (s := distribute(ids, mesh, [Shard(1)], sizes)),
                "labels": s,
            }  # noqa: E731
        else:
            model, kind = _zoo.vision(name)
            b, _, h, w = _zoo.IMAGE
            x = torch.randn(_zoo.IMAGE, generator=torch.Generator().manual_seed(0))
            labels = (
                torch.zeros(b, h, w, dtype=torch.long)
                if kind == "seg"
                else torch.ones(b, dtype=torch.long)
            )
            sizes = _zoo.uneven(h, mesh.size())
            make = lambda: {
                "pixel_values": distribute(x, mesh, [Shard(2)], sizes),
                "labels": labels,
            }  # noqa: E731
        count = lambda: sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
        )  # noqa: E731
        with shardlab.patched():  # transformers adds its own output hooks on a first call
            model(**make())
        before = count()
        with shardlab.patched(), shardlab.trace() as outer:
            ex = shardlab.explain(model, **make())
        hooks = count() - before  # the model's own hooks stay, explain's are gone
        fwd = [r.name for r in ex.rows(me) if r.phase == "forward"]
        called = [n for n, _ in model.named_modules()]
        ev = [e for e in outer.events if e.label != "explain gather"]
        return {
            "total": ex.totals(me),
            "outer": {
                "messages": sum(1 for e in ev if e.kind in ("send", "recv")),
                "collectives": sum(1 for e in ev if e.kind not in ("send", "recv")),
                "bytes": sum(e.bytes for e in ev),
            },
            # the model is called first, its modules after it, each once per phase
            "order ok": fwd[0] == type(model).__name__
            and len(set(fwd)) == len(fwd)
            and set(fwd) <= set(called) | {type(model).__name__},
            "backward rows": sum(1 for r in ex.rows(me) if r.phase == "backward"),
            "with messages": sum(1 for r in ex.rows(me) if r.events),
            "sharded inputs": sum(1 for r in ex.rows(me) if any("Shard(" in i for i in r.inputs)),
            "json ranks": len(json.loads(ex.to_json())["ranks"]),
            "table lines": len(ex.table().splitlines()),
            "html": ex._repr_html_().startswith("<table>"),
            "plot": ex.plot().get_size_inches()[0] * ex.plot().dpi,
            "hooks": hooks,
        }

    return body


@pytest.mark.parametrize("name", _zoo.VISION + _zoo.DECODERS)
def test_explain_every_zoo_model(ranks_for, name):
    per_rank = ranks_for(3).run(_body(name))
    for r in per_rank:
        assert r["total"] == r["outer"], r  # every message is attributed, once
        assert r["order ok"] and r["backward rows"] > 0 and r["with messages"] > 0, r
        assert r["sharded inputs"] > 0 and r["json ranks"] == 3 and r["html"], r
        assert r["table lines"] > 5 and r["plot"] == 950 and r["hooks"] == 0, r


def _conv_net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, padding=1)
    )


@pytest.mark.parametrize("memory", [True, False, None])
def test_memory_column(ranks_for, memory):
    """A module's peak is at least the activation it made (on CPU, counted by a dispatch
    mode); ``memory=False``, and the default on CPU: the column is left out, and no
    dispatch mode is installed."""

    def body():
        from torch.distributed.tensor import Shard
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        import shardlab
        from shardlab import distribute, this_rank

        torch.manual_seed(0)
        model = _conv_net()
        x = torch.randn(2, 3, 40, 16)
        modes = []
        with shardlab.patched(), shardlab.explain(model, memory=memory) as ex:
            modes.append(len(_get_current_dispatch_mode_stack()))
            model(distribute(x, this_rank().mesh, [Shard(2)], [16, 14, 10])).sum().backward()
        rows = {(r.name, r.phase): r for r in ex.explanation.rows(this_rank().rank)}
        return modes[0], rows["0", "forward"].peak_bytes, ex.explanation.table().splitlines()[1]

    for modes, peak, line in ranks_for(3).run(body):
        assert modes == (1 if memory else 0)  # the tracer itself is no dispatch mode
        if memory:
            assert peak >= 2 * 8 * 10 * 16 * 4 and not line.endswith("| -"), (peak, line)
        else:
            assert peak is None and line.endswith("| -"), line


def test_gather_in_two_rounds(ranks_for):
    """Rows larger than the first round's room: a second round, the same on every rank."""

    def body():
        import torch.distributed as dist

        from shardlab.explainer import explain as ex

        me = dist.get_rank()
        small = ex._gather([me] * 3, torch.device("cpu"))
        room, ex._ROOM = ex._ROOM, 64
        try:
            big = ex._gather(["x" * (50 + 100 * me)], torch.device("cpu"))
        finally:
            ex._ROOM = room
        return small, [len(b[0]) for b in big]

    for small, big in ranks_for(3).run(body):
        assert small == [[0] * 3, [1] * 3, [2] * 3] and big == [50, 150, 250]


class _Branchy(torch.nn.Module):
    """A parent with its own convolution between two children, and a residual: each
    of the three convolutions exchanges halos forward and again backward."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.own = torch.nn.Parameter(torch.randn(4, 4, 3, 3) / 6)
        self.second = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1))

    def forward(self, x):
        h = self.first(x)
        h = torch.nn.functional.conv2d(h.relu(), self.own, padding=1)  # the parent's own
        return self.second(h) + x


def test_backward_messages_land_on_their_module(ranks_for):
    """Backward, each module holds the halo messages of its own convolution: as many as
    it sent and received forward (the gradients of the same rows go back), and the
    activation between them none; the input's own backward (``distribute`` gathers the
    gradient on every rank: 2 sends, 2 receives) belongs to no module."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        torch.manual_seed(0)
        model = torch.nn.Sequential(_Branchy(), torch.nn.ReLU(), _Branchy())
        x = torch.randn(2, 4, 21, 6, requires_grad=True)  # its gradient too: every halo
        with shardlab.patched():
            ex = shardlab.explain(model, distribute(x, this_rank().mesh, [Shard(2)], [8, 6, 7]))
        p2p = {
            (r.name, r.phase): sum(1 for e in r.events if e[0] in ("send", "recv"))
            for r in ex.rows(this_rank().rank)
        }
        return p2p

    for r, p2p in enumerate(ranks_for(3).run(body)):
        hops = 2 if r == 1 else 1  # the middle rank has two neighbours
        for block in ("0", "2"):
            for name in (f"{block}.first", block, f"{block}.second.1"):
                assert p2p[name, "forward"] == 2 * hops, (name, p2p)
                assert p2p[name, "backward"] == 2 * hops, (name, p2p)
            assert p2p.get((f"{block}.second.0", "backward"), 0) == 0, p2p
        assert p2p.get(("1", "backward"), 0) == 0, p2p
        assert p2p["(outside modules)", "backward"] == 4, p2p


def test_a_model_applied_twice(ranks_for):
    """``model(model(x))``: the second call's inputs are the first call's outputs, whose
    nodes stay the first call's modules'; each convolution's backward holds the halos of
    both calls, the input's gradient gather alone is outside every module."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        torch.manual_seed(0)
        conv = lambda: torch.nn.Conv2d(3, 3, 3, padding=1)  # noqa: E731
        model = torch.nn.Sequential(conv(), torch.nn.Tanh(), conv())  # ends in a halo
        x = torch.randn(2, 3, 21, 6, requires_grad=True)
        with shardlab.patched(), shardlab.trace() as outer:
            with shardlab.explain(model) as ex:
                xs = distribute(x, this_rank().mesh, [Shard(2)], [8, 6, 7])
                model(model(xs)).sum().backward()
        rows = ex.explanation.rows(this_rank().rank)
        p2p = {
            (r.name, r.phase): sum(1 for e in r.events if e[0] in ("send", "recv")) for r in rows
        }
        total = sum(len(r.events) for r in rows)
        return p2p, total, len([e for e in outer.events if e.label != "explain gather"])

    for r, (p2p, total, outer) in enumerate(ranks_for(3).run(body)):
        hops = 2 if r == 1 else 1
        assert total == outer, (total, outer)
        for conv in ("0", "2"):
            assert p2p[conv, "forward"] == p2p[conv, "backward"] == 2 * 2 * hops, p2p
        assert p2p["(outside modules)", "backward"] == 4, p2p


class _Pooling(torch.nn.Module):
    """A learned query attends to every token; the attention weights, also returned by
    ``nn.MultiheadAttention``, are dropped (as SigLIP's pooling head does)."""

    def __init__(self):
        super().__init__()
        self.probe = torch.nn.Parameter(torch.randn(1, 1, 8))
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        out, _ = self.attn(self.probe.expand(x.shape[0], 1, 8), x, x)  # weights dropped
        return out


def test_outputs_nobody_keeps_are_left_out(ranks_for):
    """A module output that is dropped right away (its autograd nodes freed: torch 2.11
    then refuses to read them) neither breaks explain nor shows in backward."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        model = _Pooling()
        x = torch.randn(2, 7, 8)
        with shardlab.patched():
            ex = shardlab.explain(model, distribute(x, mesh, [Shard(1)], [[4, 3]]))
        return sorted({(r.name, r.phase) for r in ex.rows(this_rank().rank)})

    for rows in ranks_for(2).run(body):
        assert ("attn", "forward") in rows and ("attn", "backward") in rows, rows


def test_the_parameters_gradient_sum_has_a_row_of_its_own(ranks_for):
    """The one all-reduce of every parameter's gradient runs after the last node of the
    backward (``shardlab.tensor.grad_sum``): a row of its own, not the last module's."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        x = torch.randn(7, 4)
        with shardlab.patched():
            ex = shardlab.explain(model, distribute(x, this_rank().mesh, [Shard(0)], [4, 3]))
        return {
            (r.name, r.phase): [(e[0], e[1], e[4]) for e in r.events]
            for r in ex.rows(this_rank().rank)
            if r.events
        }

    params = (4 * 5 + 5 + 5 * 3 + 3) * 4  # float32
    for rows in ranks_for(2).run(body):
        assert rows == {
            ("(parameters' gradients)", "backward"): [("all_reduce", params, "params backward")]
        }, rows
