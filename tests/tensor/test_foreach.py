"""``torch._foreach_*`` ops and the fused optimizer steps on ShardTensors
(``shardlab/engine/aten/foreach.py``), against torch on one device: torch's own foreach
OpInfo database (out-of-place, in place, backward), every ``torch.optim`` optimizer with
``foreach=True`` and ``fused=True`` on a model with cut parameters, ``clip_grad_norm_``;
worlds 1-4, 1-D and 2-D meshes, uneven and empty shards. Before the rule, every in-place
foreach op (each optimizer step) silently left cut parameters as they were."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.engine.aten.foreach import PLAIN, element_layouts
from shardlab.layout import ShardLayout
from tests.tensor._cases import random_sizes, samples_without_stack_walk


def _lay(shape, placements, sizes=None):
    return ShardLayout.build(shape, (2,), placements, sizes)


def test_element_layouts_from_layouts_only():
    """Step 1 as a pure function: the layout each element runs in (its first ShardTensor's),
    PLAIN, or None (alone, whole: a Partial self, a broadcast, a written plain tensor)."""
    a = _lay((7, 5), [Shard(0)], [[4, 3]])
    b = _lay((7, 5), [Shard(0)], [[3, 4]])
    r = _lay((7, 5), [Replicate()])
    p = _lay((7, 5), [Partial()])
    elements = [
        [(a, (7, 5), True), (a, (7, 5), False), (None, (), False)],  # param, grad, step
        [(a, (7, 5), True), (b, (7, 5), False)],  # the gradient cut otherwise: moved to a
        [(r, (7, 5), True), (p, (7, 5), False)],  # a Partial gradient: reduced into r
        [(p, (7, 5), True), (a, (7, 5), False)],  # a Partial self: alone, whole
        [(a, (7, 5), False), (None, (7, 5), False)],  # a plain tensor with dims: cut to a
        [(a, (7, 5), False), (None, (7, 5), True)],  # ... but written: alone
        [(a, (7, 5), False), (r, (1, 5), False)],  # a broadcast: alone
        [(None, (3,), True), (None, (3,), False)],  # plain tensors only (a plain parameter)
    ]
    assert element_layouts(elements) == [a, a, r, None, a, None, None, PLAIN]


def _foreach_cases():
    """(name, input shapes, args, kwargs) of torch's foreach OpInfos, 4 tensors a list."""
    from torch.testing._internal.common_methods_invocations import (
        foreach_binary_op_db,
        foreach_other_op_db,
        foreach_pointwise_op_db,
        foreach_reduce_op_db,
        foreach_unary_op_db,
    )

    dbs = (foreach_unary_op_db, foreach_binary_op_db, foreach_pointwise_op_db,
           foreach_reduce_op_db, foreach_other_op_db)  # fmt: skip
    return [op for db in dbs for op in db]


def _layout_for(rng, mesh, shape):
    """Random placements (one per mesh dim) and uneven sizes, some empty."""
    places, sizes = [], []
    for m in range(mesh.ndim):
        d = rng.randrange(len(shape) + 1) if shape else 0
        if d == len(shape) or any(getattr(p, "dim", -1) == d for p in places):
            places.append(Replicate())
            sizes.append(None)
        else:
            places.append(Shard(d))
            sizes.append(random_sizes(rng, shape[d], mesh.shape[m]))
    return places, (sizes if any(sizes) else None)


def _full(x):
    from shardlab import ShardTensor

    if isinstance(x, ShardTensor):
        return x.full_tensor()
    if isinstance(x, (list, tuple)):
        return type(x)(_full(v) for v in x)
    return x


def _close(got, want) -> None:
    torch.testing.assert_close(_full(got), want, rtol=1e-9, atol=1e-12, equal_nan=True)


def _one_sample(op, sample, mesh, rng, mixed) -> str | None:
    """The sample on one device and cut: "equal", or what went wrong; None when torch
    itself refuses it."""
    from shardlab import distribute

    inputs = list(sample.input)
    layouts = [_layout_for(rng, mesh, tuple(t.shape)) for t in inputs]

    def cut(t, i, other=False):
        if t.shape != inputs[i].shape or other:  # (other: element 0 unlike its input)
            return distribute(t, mesh, [Replicate()] * mesh.ndim)
        return distribute(t, mesh, *layouts[i])

    args = [
        [cut(t.clone(), i, mixed and i == 0) for i, t in enumerate(a)]
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)
        else a
        for a in sample.args
    ]
    grad = op.supports_autograd
    try:
        xs = [t.clone().requires_grad_(grad) for t in inputs]
        ref = op.op(xs, *sample.args, **sample.kwargs)
        if grad:
            w = [torch.randn_like(r) for r in ref]
            sum((r * wi).sum() for r, wi in zip(ref, w)).backward()
    except Exception:  # noqa: BLE001
        return None
    try:
        leaves = [cut(t.clone(), i).requires_grad_(grad) for i, t in enumerate(inputs)]
        out = op.op(leaves, *args, **sample.kwargs)
        _close(out, list(ref))
        if grad:
            sum((_full(r) * wi).sum() for r, wi in zip(out, w)).backward()
            for a, b in zip(leaves, xs):
                if b.grad is not None:
                    _close(a.grad, b.grad)
        if op.inplace_variant is not None:
            want = [t.clone() for t in inputs]
            op.inplace_variant(want, *sample.args, **sample.kwargs)
            got = [cut(t.clone(), i) for i, t in enumerate(inputs)]
            before = [g._layout for g in got]
            op.inplace_variant(got, *args, **sample.kwargs)
            assert [g._layout for g in got] == before, "in place changed a layout"
            _close(got, want)
        return "equal"
    except AssertionError as exc:
        return "WRONG: " + str(exc).strip().splitlines()[0][:150]
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {str(exc)[:150]}"


def _sweep_body(seed: int, mixed: bool, mesh_shape=None):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh
        if mesh_shape is not None:
            from shardlab import this_rank

            mesh = this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        results = {}
        for op in _foreach_cases():
            with samples_without_stack_walk():
                samples = op.sample_inputs("cpu", torch.float64, num_input_tensors=[4])
                for k, sample in enumerate(samples):
                    verdict = _one_sample(op, sample, mesh, rng, mixed)
                    if verdict is not None:
                        results[f"{op.name}[{k}]"] = verdict
        return results

    return body


@pytest.mark.parametrize(
    "world, mesh_shape, mixed",
    [
        (1, None, False),
        pytest.param(2, None, False, marks=pytest.mark.more_worlds),
        (3, None, True),
        pytest.param(4, None, False, marks=pytest.mark.more_worlds),
        (4, (2, 2), False),
    ],  # fmt: skip
)
def test_foreach_op_db_equals_torch(ranks_for, world, mesh_shape, mixed):
    """Every sample of torch's foreach OpInfos (4 tensors a list, each cut its own way):
    results, gradients and the in-place variant equal one device. ``mixed``: the first
    element's other tensors laid out unlike its input (step 3, per element, whole)."""
    per_rank = ranks_for(world).run(_sweep_body(seed=world, mixed=mixed, mesh_shape=mesh_shape))
    assert all(r == per_rank[0] for r in per_rank)
    results = per_rank[0]
    bad = {k: v for k, v in results.items() if v != "equal"}
    assert not bad, bad
    assert len(results) > 120, len(results)  # 139 on torch 2.13


def _steps(m, opt, step, clip=False):
    """Three training steps of ``m`` (5 -> 3) on fixed data, each ending in ``step()``;
    the trace of the last ``step()``."""
    import torch.nn.functional as F

    import shardlab

    for k in range(3):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
        y = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        with shardlab.patched():
            loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=True)
        with shardlab.trace() as tr:
            step()
    return tr


_OPTIMIZERS = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=0.05, amsgrad=True),
    "AdamW": dict(lr=0.05, weight_decay=0.1),
    "Adamax": dict(lr=0.05),
    "NAdam": dict(lr=0.05, decoupled_weight_decay=True, weight_decay=0.1),
    "RAdam": dict(lr=0.05),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "Adagrad": dict(lr=0.1),
    "Adadelta": dict(lr=1.0),
    "ASGD": dict(lr=0.05),
    "Rprop": dict(lr=0.01),
}
_FUSED = {"SGD", "Adam", "AdamW", "Adagrad"}
DEBUG = False


def _optim_body(names, mode: str, clip: bool, mesh_shape=None):
    def body():
        import torch.nn as nn

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        if mesh_shape is not None:
            from shardlab import this_rank

            mesh = this_rank().mesh_for(mesh_shape)
        R = Replicate()

        def model(shard):
            rng = random.Random(7)  # the same cuts for both sharded runs
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.LayerNorm(3))
            m = m.double()
            if shard:  # weights cut along either dim, unevenly; biases cut or whole
                for name, p in list(m.named_parameters()):
                    mod, attr = name.split(".")
                    how = ([R] * mesh.ndim,) if mod == "3" else _layout_for(rng, mesh, p.shape)
                    st = distribute(p.detach(), mesh, *how)  # (3: LayerNorm, whole)
                    setattr(m[int(mod)], attr, nn.Parameter(st))
            return m

        def run(name, how, shard):
            opts = dict(_OPTIMIZERS[name])
            opts["foreach" if how != "fused" else "fused"] = how != "loop"
            m = model(shard)
            opt = getattr(torch.optim, name)(m.parameters(), **opts)
            tr = _steps(m, opt, opt.step, clip)
            return [_full(p).detach() for p in m.parameters()], tr.bytes()

        res = {}
        for name in names:
            same, sent = [], []
            for how in (mode, "loop"):  # loop: foreach=False, on the same cuts
                (want, _), (got, nbytes) = run(name, how, False), run(name, how, True)
                same.append(
                    all(torch.allclose(a, b, rtol=1e-10, atol=1e-13) for a, b in zip(want, got))
                )
                sent.append(nbytes)
            res[name] = (all(same), sent[0] <= 3 * sent[1]) if not DEBUG else (same, sent)
        return res

    return body


@pytest.mark.parametrize("clip", [pytest.param(False, marks=pytest.mark.more_worlds), True])
@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize(
    "world, mesh_shape",
    [(1, None), (2, None), pytest.param(3, None, marks=pytest.mark.more_worlds), (4, (2, 2))],
)
def test_optimizers_on_cut_parameters_equal_one_device(ranks_for, world, mesh_shape, mode, clip):
    """Three steps of every optimizer (``foreach=True``; ``fused=True`` where torch has
    it), optionally after ``clip_grad_norm_(foreach=True)``, on a model whose parameters
    are cut at random: the parameters equal the same steps on one device, and the step
    itself sends at most 3x the bytes of the same optimizer with ``foreach=False``: the
    gradients that come back laid out unlike their parameter move, as in ``p.add_(g)``,
    and a fused step that writes a parameter and a state laid out otherwise moves one of
    them there and back (measured: fused SGD 2.7x on 2 ranks; most foreach steps 1x or
    less)."""
    names = sorted(_FUSED) if mode == "fused" else sorted(_OPTIMIZERS)
    per_rank = ranks_for(world).run(_optim_body(names, mode, clip, mesh_shape))
    for res in per_rank:
        assert res == {n: (True, True) for n in names}, res


def test_aligned_calls_take_no_meta_run_and_equal_torch(ranks_for):
    """The one-pass path (``foreach.aligned``: each element's tensors of one layout): an
    AdamW step (``foreach=True``) on uneven cut parameters makes no meta run and sends
    nothing; out of place, each result has its element's layout and torch's strides. The
    cases it leaves to the full path still equal torch: a transposed (non-contiguous)
    ``self``, a Partial element, a plain element among cut ones, elements cut unlike
    each other's tensors."""

    def body():
        from torch.distributed.tensor import distribute_tensor

        import shardlab
        import shardlab.engine.meta as c  # (its meta_call, counted)
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        n = mesh.size()
        sizes = [[1 + 2 * r for r in range(n)]]
        rows = sum(sizes[0])
        torch.manual_seed(0)
        full = [torch.randn(rows, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
        params = [distribute(full[0], mesh, [Shard(0)], sizes).requires_grad_(),
                  distribute(full[1], mesh, [Replicate()]).requires_grad_()]  # fmt: skip
        ref = [f.clone().requires_grad_() for f in full]
        for p, r in zip(params, ref):
            g = torch.randn(r.shape, dtype=torch.float64)
            r.grad = g
            p.grad = distribute(g, mesh, list(p.placements), sizes if p.ndim == 2 else None)
        opt, ropt = (torch.optim.AdamW(ps, lr=0.1, foreach=True) for ps in (params, ref))
        opt.step(), ropt.step()
        metas, real = [], c.meta_call
        c.meta_call = lambda *a, **k: metas.append(a[0]) or real(*a, **k)
        try:
            with shardlab.trace() as tr:
                opt.step()
        finally:
            c.meta_call = real
        ropt.step()
        out = {"meta runs": metas, "sent": tr.bytes()}
        out["step"] = all(torch.equal(p.full_tensor(), r) for p, r in zip(params, ref))
        a = distribute(full[0], mesh, [Shard(0)], sizes)
        got, want = torch._foreach_sqrt([a.abs()]), torch._foreach_sqrt([full[0].abs()])
        out["out of place"] = (got[0]._layout == a._layout, got[0].stride() == want[0].stride(),
                               torch.equal(got[0].full_tensor(), want[0]))  # fmt: skip
        t = distribute(full[0].t().contiguous(), mesh, [Shard(1)], sizes).t()  # (rows, 3)
        got, want = torch._foreach_exp([t]), torch._foreach_exp([full[0].t().contiguous().t()])
        out["transposed"] = (
            got[0].stride() == want[0].stride(),
            torch.equal(got[0].full_tensor(), want[0]),
        )
        ones = torch.full((2,), float(n), dtype=torch.float64)
        part = shardlab.ShardTensor.from_local(ones, mesh, [Partial()])
        plain, cut = torch.ones(4, dtype=torch.float64), distribute(full[1], mesh, [Replicate()])
        other = distribute(full[0], mesh, [Replicate()])  # element 0 cut unlike a
        torch._foreach_mul_([part, plain, a], [2.0, 3.0, 4.0])
        torch._foreach_add_([a, cut], [other, cut])
        dt = distribute_tensor(full[1], mesh, [Shard(0)])  # a DTensor of torch's beside ours
        torch._foreach_add_([cut, dt], [cut, dt.clone()])
        out["full path"] = (torch.equal(part.full_tensor(), torch.full((2,), 2.0 * n * n)),
                            torch.equal(plain, torch.full((4,), 3.0)),
                            torch.equal(a.full_tensor(), 5 * full[0]),
                            torch.equal(cut.full_tensor(), 4 * full[1]),
                            torch.equal(dt.full_tensor(), 2 * full[1]))  # fmt: skip
        return out

    for world in (1, 3):
        for res in ranks_for(world).run(body):
            assert res == {"meta runs": [], "sent": 0, "step": True, "out of place": (True,) * 3,
                           "transposed": (True, True), "full path": (True,) * 5}, res  # fmt: skip


def test_plain_and_cut_parameters_in_one_model_with_clipping(ranks_for):
    """Cut weights beside plain parameters (a LayerNorm, the biases), in one optimizer group,
    ``clip_grad_norm_`` with its default ``foreach`` (on the CPU: ``g.mul_(clip_coef)`` per
    gradient, a plain gradient times a 0-d ShardTensor), then AdamW foreach and fused: equal
    to one device. The per-gradient ``mul_`` raised "Shape torch.Size([]) is not the
    expected shape" (torch's meta reference for an in-place op takes a 0-d tensor as a
    scalar only on the CPU; shardlab's meta copy was on the meta device)."""

    def body():
        import copy

        import torch.nn as nn
        import torch.nn.functional as F

        import shardlab
        from shardlab import distribute

        mesh = shardlab.this_rank().mesh
        n = mesh.size()
        res = []
        for kw in ({"foreach": True}, {"fused": True}, {"foreach": False}):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3)).double()
            ref = copy.deepcopy(m)
            w0 = distribute(
                m[0].weight.detach(), mesh, [Shard(0)], [[7 - 2 * (n - 1)] + [2] * (n - 1)]
            )
            m[0].weight = nn.Parameter(w0)
            m[2].weight = nn.Parameter(distribute(m[2].weight.detach(), mesh, [Shard(1)]))
            opts = [
                torch.optim.AdamW(x.parameters(), lr=0.05, weight_decay=0.1, **kw) for x in (m, ref)
            ]
            for k in range(3):
                gen = torch.Generator().manual_seed(k)
                x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
                y = torch.randn(4, 3, generator=gen, dtype=torch.float64)
                for model, opt in zip((m, ref), opts):
                    opt.zero_grad()
                    with shardlab.patched():
                        loss = F.mse_loss(model(x), y)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                    opt.step()
            res.append(all(torch.allclose(_full(a), b, rtol=1e-12, atol=1e-14)
                           for a, b in zip(m.parameters(), ref.parameters())))  # fmt: skip
        return res

    for world in (1, 3):
        assert ranks_for(world).run(body) == [[True] * 3] * world


@pytest.mark.parametrize("foreach", [False, True])
def test_grad_scaler_on_cut_parameters_equal_one_device(ranks_for, foreach):
    """``torch.amp.GradScaler`` around fp16 autocast, an inf in one step's input (the step is
    skipped and the scale halved on every rank), ``unscale_`` then ``clip_grad_norm_``: the
    parameters and scales equal one device's; ``unscale_`` sends one all-reduce of
    ``found_inf`` per rank (the fallback gathered every gradient)."""

    def body():
        import torch.nn as nn
        import torch.nn.functional as F

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh

        def model(shard):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
            if shard:
                cuts = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
                for name, p in list(m.named_parameters()):
                    mod, attr = name.split(".")
                    place = cuts.get(name)
                    how = ([place], [[4, 3]]) if place else ([Replicate()],)
                    setattr(m[int(mod)], attr, nn.Parameter(distribute(p.detach(), mesh, *how)))
            return m

        outs, events = [], []
        for shard in (False, True):
            m = model(shard)
            opt = torch.optim.AdamW(m.parameters(), lr=0.01, foreach=foreach)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            scales = []
            for step in range(4):
                gen = torch.Generator().manual_seed(step)
                x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
                if step == 2:
                    x[0, 0] = float("inf")
                with shardlab.patched(), torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(m(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                with shardlab.trace() as tr:
                    scaler.unscale_(opt)
                events.append(sorted({e.label for e in tr.events}) if shard else [])
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=foreach)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            outs.append(([_full(p).detach() for p in m.parameters()], scales))
        same = all(torch.equal(a, b) for a, b in zip(outs[0][0], outs[1][0]))
        return same, outs[0][1] == outs[1][1] == [1024.0, 1024.0, 512.0, 512.0], events[4:]

    for same, scales, events in ranks_for(2).run(body):
        assert same and scales
        assert events == [["unscale found_inf"]] * 4, events


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_optimizer_step_on_cut_parameters(ranks_for, world):
    """``torch.compile(optimizer.step)`` (AdamW, foreach): compiled, the step passes its
    bias corrections as one CPU tensor of scalars (``_foreach_addcdiv_.Tensor``), which
    torch's meta check refused as a meta tensor, and which is one number per element.
    Equal to the same compiled step on one device, to the float32 of torch's compiled
    step counts: atol 1e-7 over three steps of lr 0.1 (eager and compiled AdamW differ by
    ~3e-6 on one device; on 2 ranks the graph breaks around sharded ops run part of the
    step eagerly, in float64)."""

    def body():
        import torch.nn as nn

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        sizes = [[4, 3]] if mesh.size() == 2 else [[7]]

        def run(shard):
            torch._dynamo.reset()
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
            if shard:
                cuts = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
                for name, p in list(m.named_parameters()):
                    mod, attr = name.split(".")
                    how = ([cuts[name]], sizes) if name in cuts else ([Replicate()],)
                    setattr(m[int(mod)], attr, nn.Parameter(distribute(p.detach(), mesh, *how)))
            opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True)
            _steps(m, opt, torch.compile(opt.step, backend="aot_eager"))
            return [_full(p).detach() for p in m.parameters()]

        want, got = run(False), run(True)
        return all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(want, got))

    assert ranks_for(world).run(body) == [True] * world


def test_functional_fused_steps_and_per_tensor_sums(ranks_for):
    """The out-of-place fused steps (``_fused_adam``, ``_fused_sgd``: what functionalized and
    compiled code calls) give their five (three) result lists, an empty one where the step
    keeps no such state (no amsgrad, no momentum); ``_foreach_powsum`` (a sum per tensor)
    and ``_foreach_norm`` give one scalar per tensor. Each against the plain call."""

    def body():
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        gen = torch.Generator().manual_seed(0)
        shapes = [(7, 5), (5,), (3, 4)]
        cuts = [([Shard(0)], [[5, 2]]), ([Replicate()],), ([Shard(1)], [[1, 3]])]
        plain = [[torch.randn(s, dtype=torch.float64, generator=gen).abs() for s in shapes]
                 for _ in range(3)]  # fmt: skip
        steps = [torch.tensor(3.0) for _ in shapes]

        def cut(ts):
            return [distribute(t.clone(), mesh, *how) for t, how in zip(ts, cuts)]

        aten = torch.ops.aten
        calls = {
            "_fused_adam": lambda p, g, m, v: aten._fused_adam.default(
                p, g, m, v, [], steps, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0,
                eps=1e-8, amsgrad=False, maximize=False),
            "_fused_sgd": lambda p, g, m, v: aten._fused_sgd.default(
                p, g, [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                nesterov=False, maximize=False, is_first_step=True),
            "_foreach_powsum": lambda p, g, m, v: aten._foreach_powsum.Scalar(p, 3),
            "_foreach_norm": lambda p, g, m, v: aten._foreach_norm.Scalar(p, 3),
        }  # fmt: skip
        ok = {}
        for name, fn in calls.items():
            want = fn(*plain, plain[0])
            got = _full(fn(*[cut(ts) for ts in plain], cut(plain[0])))
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            ok[name] = len(got) == len(want) and all(
                len(a) == len(b) and all(torch.allclose(x, y) for x, y in zip(a, b))
                for a, b in zip(got, want)
            )
        return ok

    for res in ranks_for(2).run(body):
        assert res == {k: True for k in res} and len(res) == 4, res


def test_torch_save_and_deepcopy_of_optimizer_state(ranks_for, tmp_path):
    """``torch.save(optimizer.state_dict())`` with cut parameters (AdamW's states are made by
    ``zeros_like``), then ``torch.load`` with and without ``weights_only``, and
    ``copy.deepcopy`` of the state: each state comes back equal, in its layout (saving
    raised "... is not pickleable": a note of how the state was made)."""
    path = str(tmp_path)

    def body():
        import copy

        import torch.nn as nn

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        for name, how in {
            "0.weight": ([Shard(0)], [[4, 3]]),
            "2.weight": ([Shard(1)], [[2, 5]]),
        }.items():
            mod, attr = name.split(".")
            p = getattr(m[int(mod)], attr)
            setattr(m[int(mod)], attr, nn.Parameter(distribute(p.detach(), mesh, *how)))
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True)
        _steps(m, opt, opt.step)
        state = opt.state_dict()["state"]
        f = f"{path}/rank{mesh.get_rank()}.pt"
        torch.save(opt.state_dict(), f)
        backs = [torch.load(f)["state"], torch.load(f, weights_only=False)["state"]]
        backs.append(copy.deepcopy(opt.state_dict())["state"])
        same = []
        for back in backs:
            for k, s in state.items():
                for key in ("exp_avg", "exp_avg_sq"):
                    a, b = s[key], back[k][key]
                    lay = getattr(a, "_layout", None) == getattr(b, "_layout", None)
                    same.append(lay and torch.equal(_full(a), _full(b)))
        return all(same) and len(same) == 3 * 2 * 4

    assert ranks_for(2).run(body) == [True, True]
