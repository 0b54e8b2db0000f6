"""``shardlab.explain``: what every module of a model did, forward and backward, per rank.

::

    # on the ranks (inside ranks.run or a %%ranks cell)
    ex = shardlab.explain(model, pixel_values=x, labels=y)      # one step: forward + backward
    with shardlab.explain(model) as ex:                         # or around your own step
        model(x).loss.backward()
    print(ex.table())      # modules in call order: layouts in/out, messages, bytes, ms, MiB
    ex.plot()              # modules down, ranks across: bytes received, halos and collectives
    ex.to_json()

How it attributes (no change to the model, hooks removed on exit):

1. forward: a pre-hook and a hook on every module keep a stack of the modules running;
   each message the tracer records belongs to the innermost one (its "self" share);
2. backward: each autograd node a module's forward created belongs to the module
   (innermost first). The engine runs nodes in decreasing sequence number, i.e. in the
   reverse of the order forward made them, so a module's nodes run in the same runs
   as they were made: when the outermost module returns, a pre-hook goes on the first
   node of each run (and on the inputs' nodes, which belong to no module); it names
   the owner until the next one, so a gradient's halo or all-reduce lands on the
   module whose forward caused it; the one all-reduce of the parameters' gradients
   after the last node (``shardlab.tensor.grad_sum``) has a row of its own;
3. time: between a module's hooks (forward, inclusive of its children) and between node
   pre-hooks (backward); memory: the peak while the module ran above what was live when
   it began (the CUDA allocator; on CPU, live tensor bytes counted by a dispatch mode);
4. on exit, every rank's rows are gathered (one ``all_gather``, after the
   explanation's own trace; an outer ``shardlab.trace()`` sees it labelled
   ``explain gather``), so each rank holds the numbers of all ranks.
"""

from __future__ import annotations

import time

import torch

from shardlab.explainer._memory import _Memory
from shardlab.explainer.explanation import Explanation, ModuleRecord

__all__ = ["Explanation", "ModuleRecord", "explain"]

_ALL_PARAMS = "(parameters' gradients)"  # shardlab.tensor.grad_sum's one all-reduce


def _snapshot(tensors) -> list:
    """What a module saw, cheaply (formatted on exit): (shape, ShardLayout or None)."""
    from shardlab.tensor import ShardTensor

    return [(tuple(t.shape), t.sharding if isinstance(t, ShardTensor) else None) for t in tensors]


def _describe(shape, lay) -> str:
    """``(2, 3, 32, 32) Shard(2) [13, 8, 11]``, or ``(2, 3) plain``."""
    if lay is None:
        return f"{shape} plain"
    parts = []
    for m, p in enumerate(lay.placements):
        sizes = lay.sizes[m]
        name = f"Shard({p.dim})" if type(p).__name__ == "Shard" else f"{type(p).__name__}()"
        parts.append(name + (f" {list(sizes[0])}" if sizes and len(sizes) == 1 else ""))
    return f"{shape} " + ", ".join(parts)


class Explainer:
    """The context manager behind :func:`explain` (``.explanation`` after the block)."""

    def __init__(self, model: torch.nn.Module, memory: bool | None = None):
        self.model, self.memory = model, memory
        self.explanation: Explanation | None = None

    # -- entering: hooks and the tracer --------------------------------------------
    def __enter__(self):
        from shardlab.runtime import this_rank
        from shardlab.trace import trace

        ctx = this_rank()
        self.rank, self.device = ctx.rank, ctx.device
        self.records: dict[tuple[str, str], ModuleRecord] = {}
        self.names = {m: n or type(m).__name__ for n, m in self.model.named_modules()}
        self.stack: list[tuple[torch.nn.Module, float, int, set]] = []
        self.marks: list[tuple[int, str]] = []  # (event index, owner) in time order
        self.node_frontier: dict = {}  # node -> where the walk that tagged it stopped
        self.owned: list = []  # (node, module or None: no module) not hooked yet
        self.node_hooks: dict = {}  # module (or None) -> its autograd-node pre-hook
        self.back_owner: str | None = None
        self.in_backward = False
        self.back_since = 0.0
        memory = self.device.type == "cuda" if self.memory is None else self.memory
        self._mem = _Memory(self.device) if memory else None
        self._trace = trace()
        self.t = self._trace.__enter__()
        if self._mem:
            self._mem.__enter__()
        self.handles = []
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(_plain(self._pre), with_kwargs=True))
            self.handles.append(m.register_forward_hook(_plain(self._post), with_kwargs=True))
        return self

    def _record(self, module, phase) -> ModuleRecord:
        name = self.names[module]
        key = (name, phase)
        if key not in self.records:
            self.records[key] = ModuleRecord(
                name,
                type(module).__name__,
                phase,
                len(self.records),
                name.count(".") + 1,
                peak_bytes=0 if self._mem else None,
            )
        return self.records[key]

    def _pre(self, module, args, kwargs):
        rec = self._record(module, "forward")
        tensors = _tensors((args, kwargs))
        rec.inputs = _snapshot(tensors[:4])  # strings on exit
        grad_fns = {a.grad_fn for a in tensors if a.grad_fn is not None}
        if self._mem and self.stack:  # the parent's peak so far, before the reset
            self.stack[-1][4] = max(self.stack[-1][4], self._mem.peak())
        base = self._mem.reset_peak() if self._mem else 0
        self.stack.append([module, time.perf_counter(), base, grad_fns, base])
        self.marks.append((len(self.t.events), self.names[module]))

    def _post(self, module, args, kwargs, output):
        _, start, base, stop, children = self.stack.pop()
        rec = self._record(module, "forward")
        tensors = _tensors(output)
        rec.outputs = _snapshot(tensors[:1])
        rec.seconds += time.perf_counter() - start
        if self._mem:  # [4]: the highest peak of this module's children
            top = max(self._mem.peak(), children)
            rec.peak_bytes = max(rec.peak_bytes, top - base)
            if self.stack:
                self.stack[-1][4] = max(self.stack[-1][4], top)
        self.marks.append((len(self.t.events), self.names[self.stack[-1][0]] if self.stack else ""))
        frontier = self._tag_nodes(module, tensors, stop)
        if not self.stack:  # the outermost module returned: its graph is complete
            # its inputs' nodes belong to no module (unless an earlier call claimed them)
            self.owned += [(n, None) for n in frontier if n not in self.node_frontier]
            self._hook_runs()

    def _tag_nodes(self, module, outputs, stop) -> list:
        """Claim the autograd nodes this module's forward made: from its outputs back to
        its inputs' nodes (``stop``, returned: the walk's frontier). A node an inner
        module (or an earlier one) claimed is not walked again: the walk jumps to where
        that module's walk stopped, so each node is visited about once however deep the
        modules nest."""
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen, frontier = set(), []
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in stop:
                frontier.append(node)
                continue
            done = self.node_frontier.get(node)
            if done is not None:  # tagged by an inner/earlier module: skip its part
                todo.extend(done)
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            self.node_frontier[node] = frontier  # complete when this walk ends
            self.owned.append((node, module))
            todo.extend(n for n, _ in node.next_functions if n is not None)
        return frontier

    def _hook_runs(self) -> None:
        """A pre-hook on the first node of each run of one owner, in the order backward
        will run them (decreasing sequence number). A node whose graph is already gone (an
        output nobody kept, as SigLIP's attention weights: torch 2.11 frees its custom
        nodes then) never runs: it is left out."""
        alive = []
        for node, module in self.owned:
            try:
                alive.append((node._sequence_nr(), node, module))
            except RuntimeError:  # "... invalid for this instance of _C._FunctionBase"
                continue
        alive.sort(key=lambda item: -item[0])
        last = self  # no owner yet
        for _, node, module in alive:
            if module is not last:
                hook = self.node_hooks.get(module)
                if hook is None:
                    hook = self.node_hooks[module] = self._node_hook(module)
                node.register_prehook(hook)
                last = module
        self.owned.clear()

    def _node_hook(self, module):
        """One per module: marks where backward enters the module (its time runs until
        backward enters another); ``None``: nodes of no module (the inputs' own)."""
        name = "" if module is None else self.names[module]

        def hook(grad_outputs):
            if not self.in_backward:  # the pass's first node: see where it ends
                self.in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            if name == self.back_owner:
                return
            now = time.perf_counter()
            if self.back_owner:
                prev = self.records[(self.back_owner, "backward")]
                prev.seconds += now - self.back_since
            self.marks.append((len(self.t.events), "back:" + name))
            if module is not None:
                self._record(module, "backward")
            self.back_owner, self.back_since = name, now

        return hook

    def _backward_ended(self) -> None:
        """A backward pass ended: what follows belongs to no module until the next call or
        pass (a pipeline schedule's sends and receives between its stage's backwards)."""
        self.in_backward = False
        if self.back_owner:
            prev = self.records[(self.back_owner, "backward")]
            prev.seconds += time.perf_counter() - self.back_since
        self.marks.append((len(self.t.events), "back:"))
        self.back_owner = None

    # -- leaving: attribute the events, gather the ranks --------------------------
    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        if self.back_owner:
            self.records[(self.back_owner, "backward")].seconds += (
                time.perf_counter() - self.back_since
            )
        if self._mem:
            self._mem.__exit__(*exc)
        self._trace.__exit__(*exc)
        if exc[0] is not None:
            return False
        from shardlab.tensor import grad_sum

        owner, marks = "", iter(self.marks + [(len(self.t.events) + 1, "")])
        nxt = next(marks)
        for i, e in enumerate(self.t.events):
            while nxt[0] <= i:
                owner = nxt[1]
                nxt = next(marks)
            key = (owner[5:], "backward") if owner.startswith("back:") else (owner, "forward")
            if e.label == grad_sum.LABEL:  # every parameter's, once the backward has ended
                key = (_ALL_PARAMS, "backward")
            rec = self.records.get(key)
            if rec is None:  # outside every module (the loss, the optimizer; the sum)
                where = _ALL_PARAMS if key[0] == _ALL_PARAMS else "(outside modules)"
                rec = self.records.setdefault(
                    (where, key[1]),
                    ModuleRecord(
                        where,
                        "",
                        key[1],
                        10**6,
                        0,
                        peak_bytes=0 if self._mem else None,
                    ),
                )
            rec.events.append((e.kind, e.bytes, e.peer, e.mesh_dim, e.label))

        for r in self.records.values():  # the layouts seen, as text
            r.inputs = [_describe(*x) for x in r.inputs]
            r.outputs = [_describe(*x) for x in r.outputs]
        mine = [
            dict(vars(r))
            for r in sorted(self.records.values(), key=lambda r: (r.phase != "forward", r.order))
        ]
        from shardlab.trace import label

        with label("explain gather"):  # after its own trace: not in the explanation
            everyone = _gather(mine, self.device)
        self.explanation = Explanation([[ModuleRecord(**r) for r in rows] for rows in everyone])
        return False


_ROOM = 1 << 15  # bytes each rank sends in the first round of _gather


def _gather(rows, device) -> list:
    """Every rank's ``rows``, on every rank: one ``all_gather`` of a fixed-size buffer
    (length + pickled rows) when they fit in 32 KiB, which every rank then knows; a
    second round at the largest size when any does not (``all_gather_object`` always
    takes two)."""
    import pickle

    import torch.distributed as dist

    data = pickle.dumps(rows)
    n, room = dist.get_world_size(), _ROOM
    while True:  # at most twice: every rank sees the same sizes, so all loop alike
        buf = torch.zeros(8 + room, dtype=torch.uint8, device=device)
        buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        if len(data) <= room:
            buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(buf) for _ in range(n)]
        dist.all_gather(parts, buf)
        out = torch.stack(parts).cpu()
        sizes = [int(out[r, :8].clone().view(torch.int64)) for r in range(n)]
        if max(sizes) <= room:
            return [pickle.loads(out[r, 8 : 8 + sizes[r]].numpy().tobytes()) for r in range(n)]
        room = max(sizes)


def _plain(hook):
    """``hook`` with subclass ``__torch_function__`` off: reading ``.shape`` or
    ``.grad_fn`` of a ShardTensor in a hook should not run shardlab's op machinery."""

    def run(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return hook(*args, **kwargs)

    return run


def _tensors(tree, out=None) -> list:
    """The tensors in nested tuples/lists/dicts (and transformers' ModelOutput)."""
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _tensors(x, out)
    elif isinstance(tree, dict) or (hasattr(tree, "values") and callable(tree.values)):
        for x in tree.values():
            _tensors(x, out)
    return out


def explain(model, *inputs, backward: bool = True, memory: bool | None = None, **kwargs):
    """Run ``model(*inputs, **kwargs)`` (and backward of its loss: ``.loss``, or the sum of
    the output) and explain it; without inputs, a context manager around your own step.

    ``memory``: each module's peak memory. On CUDA the allocator's statistics give it for
    free, and ``None`` (the default) turns it on; on CPU there are no such statistics:
    ``True`` counts live tensor bytes with a dispatch mode that sees every op (a Python
    call per op: about +20 % on a small model's step), so ``None`` leaves the column out
    (``-``) there, as ``torch.profiler`` leaves ``profile_memory`` off by default.

    Args:
        model: any ``nn.Module``, unchanged (its inputs ShardTensors, under
            :func:`shardlab.patched` where it needs the patched functions).
        inputs, kwargs: what the model is called with; none: a context manager.
        backward: also run and explain the backward (default True).
        memory: see above.

    Returns:
        An :class:`Explanation` with, for every module, in call order, forward and
        backward, the input and output layouts, the messages and collectives it caused
        (kind, bytes, peer, mesh axis, the op's label), its time and peak memory, on every
        rank.

    Communicates:
        The model's own messages, and at the end one all-gather of every rank's rows
        (a few KiB), so that each rank returns the whole explanation. Run it on every rank.

    Example::

        def step():
            with shardlab.patched():
                x = shardlab.distribute(img, mesh, [Shard(2)], sizes=[[13, 8, 11]])
                return shardlab.explain(model, x)          # forward + backward

        print(ranks.run(step)[0].table())

        with shardlab.explain(model) as ex:                 # around your own step
            model(x).sum().backward()
        ex.explanation.plot()
    """
    if not inputs and not kwargs:
        return Explainer(model, memory)
    with Explainer(model, memory) as ex:
        out = model(*inputs, **kwargs)
        if backward:
            loss = getattr(out, "loss", None)
            if loss is None:
                loss = out if isinstance(out, torch.Tensor) else out[0]
            (loss if loss.ndim == 0 else loss.sum()).backward()
    return ex.explanation
