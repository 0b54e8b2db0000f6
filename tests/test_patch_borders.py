"""With the patch on, code that uses only torch's own DTensors runs torch's code.

Each scenario is a pattern of torch's own DTensor and tensor-parallel tests (conv, math
ops, TP styles, TP examples): it runs once without shardlab's patch and once inside
``shardlab.patched()`` on the same ranks, and both runs must agree on everything torch
would show: values, result types, placements, gradients and their placements,
``CommDebugMode``'s collective counts, and the type and text of an error.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import python_last_line


def _scenarios():
    """name -> fn(mesh) -> a picklable record of what torch shows."""
    import functools

    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    def show(t):
        """What torch shows of a tensor: its type, placements, global values."""
        if isinstance(t, DTensor):
            return (type(t).__name__, tuple(map(str, t.placements)), t.full_tensor().detach())
        if isinstance(t, torch.Tensor):
            return (type(t).__name__, (), t.detach())
        return t

    def counts(mode):
        return sorted((str(k), v) for k, v in mode.get_comm_counts().items())

    def grads(model):
        return [(n, show(p.grad)) for n, p in model.named_parameters()]

    def seeded(fn):
        @functools.wraps(fn)
        def run(mesh):
            torch.manual_seed(0)
            try:
                return fn(mesh)
            except Exception as e:  # noqa: BLE001  (the error is what torch shows)
                return ("raised", type(e).__name__, str(e)[:200])

        return run

    @seeded
    def tp_mlp(mesh):  # test_tp_examples: Colwise then Rowwise, forward and backward
        mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(5, 8, dtype=torch.float64)
        with CommDebugMode() as mode:
            y = mlp(x)
            y.sum().backward()
        return show(y), grads(mlp), counts(mode)

    @seeded
    def sequence_parallel_norm(mesh):  # test_tp_style: SequenceParallel on a layer norm
        norm = nn.LayerNorm(8).double()
        parallelize_module(norm, mesh, SequenceParallel())
        x = torch.randn(2, 7, 8, dtype=torch.float64)
        with CommDebugMode() as mode:
            y = norm(x)
            y.sum().backward()
        return show(y), grads(norm), counts(mode)

    @seeded
    def layer_norm_bwd(mesh):  # test_math_ops: Shard(1) input, Replicate weight
        x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
        w = torch.randn(8, dtype=torch.float64, requires_grad=True)
        b = torch.randn(8, dtype=torch.float64, requires_grad=True)
        dx = distribute_tensor(x, mesh, [Shard(1)])
        dw = distribute_tensor(w, mesh, [Replicate()])
        db = distribute_tensor(b, mesh, [Replicate()])
        with CommDebugMode() as mode:
            y = F.layer_norm(dx, (8,), dw, db)
            y.sum().backward()
        return show(y), show(dw.grad), show(db.grad), counts(mode)

    @seeded
    def norm_then_colwise(mesh):  # test_layer_norm_bwd_req_grad: LN, then Colwise linear
        model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 12)).double()
        parallelize_module(model, mesh, {"0": SequenceParallel(), "1": ColwiseParallel()})
        x = torch.randn(2, 6, 8, dtype=torch.float64)
        with CommDebugMode() as mode:
            y = model(x)
        with CommDebugMode() as back:
            y.sum().backward()
        return show(y), grads(model), counts(mode), counts(back)

    @seeded
    def loss_parallel_class_sharded(mesh):  # test_tp_examples::test_loss_parallel
        head = nn.Linear(8, 12).double()
        parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
        x = torch.randn(5, 8, dtype=torch.float64)
        t = torch.tensor([3, 1, 11, 0, 7])
        with CommDebugMode() as mode, loss_parallel():
            loss = F.cross_entropy(head(x), t)
            loss.backward()
        return show(loss), grads(head), counts(mode)

    @seeded
    def loss_parallel_batch_sharded(mesh):  # torch raises ValueError
        from torch.distributed.tensor.parallel import loss

        logits = distribute_tensor(torch.randn(4, 6, dtype=torch.float64), mesh, [Shard(0)])
        try:
            with loss_parallel():
                return show(F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])))
        finally:  # torch's loss_parallel() leaves its handlers on after an error
            loss._disable_custom_loss_ops()

    @seeded
    def plain_cross_entropy(mesh):  # no loss_parallel: DTensor's own cross-entropy
        logits = distribute_tensor(
            torch.randn(4, 6, dtype=torch.float64, requires_grad=True), mesh, [Shard(0)]
        )
        with CommDebugMode() as mode:
            loss = F.cross_entropy(logits, distribute_tensor(torch.tensor([0, 1, 2, 3]), mesh))
        return show(loss), counts(mode)

    @seeded
    def downsampling_conv(mesh):  # test_convolution_ops: distribute_module, one SGD step
        conv = nn.Conv2d(3, 4, 2, stride=2).double()
        distribute_module(conv, mesh)
        x = distribute_tensor(torch.randn(2, 3, 8, 8, dtype=torch.float64), mesh, [Shard(0)])
        with CommDebugMode() as mode:
            y = conv(x)
            y.square().sum().backward()
        torch.optim.SGD(conv.parameters(), lr=0.1).step()
        return show(y), grads(conv), show(conv.weight), counts(mode)

    @seeded
    def conv_cut_along_w(mesh):  # DTensor's own result (2.13: each block alone, labelled
        # Replicate; 2.11: its RuntimeError). (Cut along H, uneven, torch 2.11's gloo aborts
        # the process: a collective of mismatched sizes, with the patch or without.)
        conv = nn.Conv2d(2, 3, 3).double()
        x = distribute_tensor(torch.randn(1, 2, 6, 8, dtype=torch.float64), mesh, [Shard(3)])
        distribute_module(conv, mesh)
        with CommDebugMode() as mode:
            y = conv(x)
        return show(y), counts(mode)

    @seeded
    def pooling_interpolate_dropout(mesh):  # other patched names on plain DTensors
        x = distribute_tensor(torch.randn(2, 3, 8, 6, dtype=torch.float64), mesh, [Shard(0)])
        with CommDebugMode() as mode:
            outs = [
                F.max_pool2d(x, 2),
                F.avg_pool2d(x, 3, padding=1),
                F.adaptive_avg_pool2d(x, (3, 2)),
                F.interpolate(x, scale_factor=2, mode="nearest"),
                F.group_norm(x, 3),
                F.pad(x, (1, 1)),
                F.dropout(x, 0.0),
            ]
        return [show(o) for o in outs], counts(mode)

    return {
        f.__name__: f
        for f in (
            tp_mlp,
            sequence_parallel_norm,
            layer_norm_bwd,
            norm_then_colwise,
            loss_parallel_class_sharded,
            loss_parallel_batch_sharded,
            plain_cross_entropy,
            downsampling_conv,
            conv_cut_along_w,
            pooling_interpolate_dropout,
        )
    }


def _differences(a, b, where=""):
    """Where two records differ (tensors: exactly equal values, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
        return [] if same else [where]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}/{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.more_worlds)])
def test_plain_dtensor_code_runs_as_without_the_patch(ranks_for, world):
    def body():
        import shardlab

        mesh = shardlab.this_rank().mesh
        out = {}
        for name, fn in _scenarios().items():
            without = fn(mesh)
            with shardlab.patched():
                within = fn(mesh)
            out[name] = (_differences(without, within), without[0] == "raised")
        return out

    got = ranks_for(world).run(body)
    for rank in got:
        for name, (diff, _) in rank.items():
            assert diff == [], (name, diff[:5])
    # torch's own refusal is kept (loss_parallel with batch-sharded logits)
    assert got[0]["loss_parallel_batch_sharded"][1]


def test_dtensors_taken_over_only_when_asked(ranks_for):
    """``patched(dtensors=True)`` (or ``ShardTensor.from_dtensor``) takes a plain DTensor
    over: an image cut along H gets the halo convolution, exact, with the model's plain
    parameters; plain ``patched()`` leaves it to torch, which refuses plain parameters
    next to a DTensor (its ``RuntimeError``), as without shardlab."""

    def body():
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        import shardlab
        from shardlab import ShardTensor

        mesh = shardlab.this_rank().mesh
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(2, 3, 3, padding=1).double()
        img = torch.randn(1, 2, 9, 5, dtype=torch.float64)
        x = distribute_tensor(img, mesh, [Shard(2)])

        def torchs():
            try:
                return type(conv(x)).__name__
            except RuntimeError as e:
                return "mixed torch.Tensor and DTensor" in str(e)

        without = torchs()
        with shardlab.patched():
            within = torchs()
            ours = conv(ShardTensor.from_dtensor(x))
            with shardlab.patched(dtensors=True):
                scoped = conv(x)
            after = torchs()  # the scope ended: torch's again
        ref = conv(img)
        return (
            without is True and within is True and after is True,
            type(ours) is ShardTensor and torch.allclose(ours.full_tensor(), ref),
            type(scoped) is ShardTensor and torch.allclose(scoped.full_tensor(), ref),
            type(x) is DTensor,
        )

    assert ranks_for(2).run(body) == [(True, True, True, True)] * 2


def test_enable_imports_no_compiler():
    """``import shardlab`` and ``enable()`` import neither dynamo nor a plotting library
    (a fresh interpreter); dynamo imported afterwards, inside the patch, still sees torch's
    own functions (``tests/test_patch.py`` compiles with it)."""
    code = (
        "import sys, torch.distributed.tensor, shardlab\n"
        "shardlab.enable()\n"
        "print(sorted(m for m in ('torch._dynamo', 'matplotlib', 'transformers') "
        "if m in sys.modules))\n"
    )
    assert python_last_line(code) == "[]"


_DYNAMO_FIRST_SCRIPT = """
import sys, torch, torch._dynamo
import torch.distributed as dist, torch.nn.functional as F
from torch._dynamo.utils import counters
import shardlab

def f(x):
    return F.max_pool2d(F.relu(x), 2).sum()

x = torch.randn(1, 2, 8, 8)
group = lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
if sys.argv[1] == "group-then-patch":  # (init_process_group clears dynamo's table)
    group()
with shardlab.patched():
    if sys.argv[1] == "patch-then-group":
        group()
    counters.clear()
    out = torch.compile(f, backend="eager")(x)
graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
unwrapped = torch._dynamo.trace_rules.get_torch_obj_rule_map.__class__.__name__  # (after)
print(graphs, breaks, torch.equal(out, f(x)), unwrapped)
"""


@pytest.mark.parametrize("order", ["group-then-patch", "patch-then-group"])
def test_dynamo_imported_before_the_patch_still_traces_torchs_functions(order):
    """dynamo imported first, then the process group made before or after the patch
    (``init_process_group`` clears dynamo's table of the torch functions it may trace,
    read again on the next compile): a plain function with ``F.max_pool2d`` compiles to one
    graph, as without the patch. (The table read while ``F`` held shardlab's wrappers broke
    every graph at ``F.max_pool2d``, plain tensors too; found when the ranks' forkserver
    began to import dynamo before the patch.) After the patch, dynamo's reader is its own."""
    assert python_last_line(_DYNAMO_FIRST_SCRIPT, order) == "1 0 True _lru_cache_wrapper"


_LOCAL_TENSOR_SCRIPT = """
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
import shardlab

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

def run():
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(4, 8, 6), mesh, [Shard(1)])
    w = distribute_tensor(torch.randn(6), mesh, [Replicate()])
    img = distribute_tensor(torch.randn(4, 2, 8, 8), mesh, [Shard(0)])
    logits = distribute_tensor(torch.randn(8, 5), mesh, [Shard(0)])
    target = distribute_tensor(torch.randint(0, 5, (8,)), mesh, [Shard(0)])
    weight = distribute_tensor(torch.randn(3, 2, 3, 3), mesh, [Replicate()])
    calls = [lambda: F.layer_norm(x, (6,), w, w), lambda: F.interpolate(img, scale_factor=2),
             lambda: F.cross_entropy(logits, target), lambda: F.conv2d(img, weight)]
    out = []
    for call in calls:  # (torch's own error, where it raises one, is what it shows)
        try:
            o = call()
            out.append((type(o).__name__, o.placements, o.full_tensor()))
        except Exception as e:
            out.append(("raised", type(e).__name__, torch.tensor(0)))
    return out

with LocalTensorMode(4):
    without = run()
    with shardlab.patched():
        within = run()
    same = all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(without, within))
    try:
        shardlab.distribute(torch.randn(8, 4), init_device_mesh("cpu", (4,)), [Shard(0)])
        error = "none"
    except NotImplementedError as e:
        error = "LocalTensorMode" in str(e) and "shardlab.Ranks" in str(e)
print(same, error)
"""


def test_local_tensor_mode_plain_dtensors_and_a_clear_error():
    """torch's single-process simulator of ranks (``LocalTensorMode``, mesh coordinates are
    per-rank values): plain DTensors run the same with the patch as without (layer norm,
    interpolate, cross-entropy, conv); a ShardTensor says it does not run there."""
    pytest.importorskip("torch.distributed._local_tensor")
    assert python_last_line(_LOCAL_TENSOR_SCRIPT) == "True True"
