"""``ExpertParallel``: a parallel style for ``parallelize_module`` that spreads a
mixture-of-experts block's experts over the ranks of a 1-D mesh.

Applying it (:meth:`ExpertParallel._apply`, as torch's styles):

1. the experts module's stacked weights (E, ...) become ``Shard(0)`` ShardTensors: rank r
   keeps experts ``r*E/p .. (r+1)*E/p - 1``; its ``num_experts`` becomes E/p;
2. the experts module's ``forward`` becomes :func:`shardlab.experts.routing.route` around
   its own forward (which then runs this rank's experts only);
3. the block's ``forward`` reads a ShardTensor's local block (each rank's own tokens) and
   hands its result back with the same layout; the block's other parameters (router,
   shared experts) get their gradients summed over the ranks (data parallel).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from shardlab.experts import routing
from shardlab.experts.exchange import summed, summed_together
from shardlab.tensor import ShardTensor, distribute, scatter_tensor
from shardlab.tensor.create import from_layout
from shardlab.trace import label

__all__ = ["ExpertParallel"]


class ExpertParallel(ParallelStyle):
    """Expert parallelism for a mixture-of-experts block (transformers' Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, DeepSeek-V3 sparse blocks: a router ``gate`` and fused ``experts``
    whose weights are stacked along dim 0), applied with ``parallelize_module`` on a 1-D
    mesh of p ranks. Each rank holds its own tokens; E/p experts live on each rank::

                         rank 0                       rank 1          (E = 4, p = 2)
        tokens           its own (a cut of B or S)    its own
        router (gate)    whole, alike                 whole, alike    gradient: summed
        experts          0, 1  (Shard(0) of E)        2, 3            gradient: here
        shared expert    whole, alike                 whole, alike    gradient: summed

        forward   route -> counts -> dispatch --rows--> experts -> combine --rows--> x w, sum
        backward                     dispatch^T <------ experts <-- combine^T <------

    The block's input is each rank's tokens: a ShardTensor (or DTensor) cut along a token
    dim (batch or sequence, not the last) over the same mesh, whose local block is read
    and whose layout the output gets; or a plain tensor, read as this rank's own tokens
    (as under data parallelism). The tokens may be cut over a larger mesh of which the
    experts' mesh is one dim (``mesh["ep"]`` of ``("ep", "sp")``: each rank its own
    sequences along ``ep``, its own positions along ``sp``): then the all-to-alls run over
    ``ep`` only, and every weight's gradient, the experts' too, is also summed over the
    other dims (the experts' at once, in one all-reduce per layer: ``experts.weights
    backward``). Either way the result
    equals one device running the block on all the ranks' tokens together: forward, the
    input's gradient, each rank's experts' gradients (their slice of one device's) and the
    router's (summed over the ranks, equal on every rank, with the other replicated
    gradients in one all-reduce at the end of the backward). Do not wrap the block in DDP
    over the same ranks: its experts differ.

    Messages per call, on the mesh's group (``shardlab.trace`` labels): forward one
    ``all_to_all`` of E int64 counts (``experts.counts``), the token rows out
    (``experts.dispatch``) and the results back (``experts.combine``); backward the two
    transposes. The rows each rank hands to a row all-to-all: ``T_r*k*H*itemsize`` bytes
    (its routed pairs, those for its own experts included).

    Args:
        experts: the name of the block's experts module (``"experts"``), which has
            ``num_experts`` and ``forward(hidden (T, H), top_k_index (T, k),
            top_k_weights (T, k))``.
        capacity_factor: None (default): no token is dropped, splits are as uneven as the
            routing. A number c > 0: each rank sends each expert at most
            ``ceil(c * T_r * k / E)`` (token, expert) pairs, the first in token order; the
            pairs beyond are dropped (they add nothing to their token's output: the
            router's other choices do, unscaled).

    Example::

        from torch.distributed.tensor.parallel import parallelize_module
        mesh = shardlab.this_rank().mesh
        parallelize_module(model, mesh, {"model.layers.*.mlp": ExpertParallel()})
        ids = shardlab.distribute(batch, mesh, [Shard(0)], sizes=[[3, 2]])  # own tokens
        with shardlab.patched():
            model(input_ids=ids, labels=ids).loss.backward()
    """

    def __init__(self, *, experts: str = "experts", capacity_factor: float | None = None):
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"ExpertParallel(capacity_factor=...): expected None or a number > 0, got "
                f"{capacity_factor!r}"
            )
        self.experts = experts
        self.capacity_factor = capacity_factor

    def __repr__(self) -> str:
        return f"ExpertParallel(experts={self.experts!r}, capacity_factor={self.capacity_factor})"

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        """Spread ``module``'s experts over ``device_mesh`` (what ``parallelize_module``
        calls, on every rank). With ``src_data_rank`` (torch's, default 0) that rank's
        weights are the ones kept: its experts scattered, its other parameters broadcast;
        with None each rank keeps its slice of its own weights and sends nothing."""
        state = _State(module, device_mesh, self)
        state.split_experts(self.src_data_rank)
        experts = state.experts
        experts.forward = functools.partial(_experts_forward, state, experts.forward)
        module.forward = functools.partial(_block_forward, state, module.forward)
        module._shardlab_expert_parallel = state
        return module


@dataclass
class _State:
    """What a parallelized block knows: its mesh, its experts, its replicated parameters."""

    block: nn.Module
    mesh: object
    style: ExpertParallel
    experts: nn.Module = field(init=False)
    group: object = field(init=False)
    ranks: int = field(init=False)
    local: int = field(init=False)  # experts per rank, E/p
    replicated: list = field(init=False)  # (module, name) of every other parameter
    # while the block runs: the process groups of the token mesh's other dims (a 2-D mesh:
    # experts over one dim, tokens also cut over the others), over which every weight's
    # gradient, the experts' too, is summed
    others: list = field(init=False, default_factory=list)

    def __post_init__(self):
        block, mesh, name = self.block, self.mesh, self.style.experts
        where = type(block).__name__
        if getattr(mesh, "ndim", None) != 1:
            raise ValueError(
                f"ExpertParallel: device_mesh must be 1-D (the ranks the experts are spread "
                f"over), got {getattr(mesh, 'ndim', mesh)!r} dims: pass mesh['ep'] of a "
                "larger mesh"
            )
        if hasattr(block, "_shardlab_expert_parallel"):
            raise RuntimeError(f"ExpertParallel: this {where} is already expert-parallel")
        experts = getattr(block, name, None)
        total = getattr(experts, "num_experts", None)
        if not isinstance(experts, nn.Module) or not isinstance(total, int):
            raise TypeError(
                f"ExpertParallel(experts={name!r}): {where} has no experts module "
                f"{name!r} with an int num_experts (transformers' fused experts: Mixtral, "
                "Qwen2-MoE, OLMoE, DeepSeek-V3 ...); name it with experts="
            )
        self.experts, self.group, self.ranks = experts, mesh.get_group(0), mesh.size()
        if total % self.ranks:
            raise ValueError(
                f"ExpertParallel: the {total} experts of {where}.{name} (num_experts) do not "
                f"split evenly over the {self.ranks} ranks of device_mesh: num_experts must "
                f"be a multiple of the mesh size"
            )
        self.local = total // self.ranks
        for sub in experts.modules():
            for pname, p in sub.named_parameters(recurse=False):
                if sub is not experts or p.dim() == 0 or p.shape[0] != total:
                    raise ValueError(
                        f"ExpertParallel: {where}.{name} holds {pname} of shape "
                        f"{tuple(p.shape)}: expected every expert weight stacked along dim "
                        f"0 ({total}, ...), directly on the experts module"
                    )
        inside = set(experts.modules())
        self.replicated = [
            (m, n)
            for m in block.modules()
            if m not in inside
            for n, p in m.named_parameters(recurse=False)
        ]

    def split_experts(self, src) -> None:
        """Step 1 of the module docstring (and the broadcast of the rest from ``src``)."""
        at = None if src is None else int(self.mesh.mesh.reshape(-1)[src])  # global rank
        for name, p in list(self.experts.named_parameters(recurse=False)):
            whole = p.detach()
            if at is None:  # no message: my slice of my own weights
                mine = distribute(whole, self.mesh, [Shard(0)])
            else:
                with label("experts.setup"):
                    mine = scatter_tensor(whole, at, self.mesh, [Shard(0)])
            self.experts.register_parameter(name, nn.Parameter(mine, p.requires_grad))
        self.experts.num_experts = self.local
        if at is not None:
            with label("experts.setup"), torch.no_grad():
                for m, n in self.replicated:
                    dist.broadcast(m._parameters[n].data, at, group=self.group)


@contextlib.contextmanager
def _swapped(values):
    """``module.<name>`` is ``value`` inside, for each (module, name, value) of ``values``
    (the parameter objects stay registered; only what the forward reads changes)."""
    saved = []
    try:
        for module, name, value in values:
            saved.append((module, name, module._parameters[name]))
            module._parameters[name] = value
        yield
    finally:
        for module, name, old in reversed(saved):
            module._parameters[name] = old


def _experts_forward(state: _State, own_forward, *args, **kwargs):
    """The experts module's forward, expert-parallel: (hidden (T, H), top_k_index (T, k),
    top_k_weights (T, k)) -> (T, H), as one device would give it."""
    bound = inspect.signature(own_forward).bind(*args, **kwargs)
    hidden, index, weights = list(bound.arguments.values())[:3]
    experts = state.experts
    names, blocks = zip(*[(n, p.to_local()) for n, p in experts.named_parameters(recurse=False)])
    # (E/p, ...) each: summed over the token mesh's other dims, if any, in one all-reduce
    local = dict(zip(names, summed_together(blocks, state.others, "experts.weights")))

    def run_local(rows, ids, ones):  # this rank's experts: the module's own forward
        with _swapped([(experts, n, t) for n, t in local.items()]):
            return own_forward(rows, ids, ones)

    return routing.route(
        hidden, index, weights, run_local=run_local, local=state.local,
        params=list(local.values()), group=state.group, ranks=state.ranks,
        capacity=state.style.capacity_factor,
    )  # fmt: skip


def _block_forward(state: _State, own_forward, *args, **kwargs):
    """The block's forward on this rank's tokens; its replicated parameters' gradients
    summed over the ranks; a ShardTensor's layout handed on to the result."""
    bound = inspect.signature(own_forward).bind(*args, **kwargs)
    first = next(iter(bound.arguments))
    x = bound.arguments[first]
    cut, others = _tokens_of(x, state) if isinstance(x, DTensor) else (None, [])
    if cut is not None:
        bound.arguments[first] = cut.to_local()  # (.., T_r, .., H): this rank's block
    groups = [state.group, *others]
    values = [(m, n, summed(m._parameters[n], groups)) for m, n in state.replicated]
    state.others = others
    try:
        with _swapped(values):
            out = own_forward(*bound.args, **bound.kwargs)
    finally:
        state.others = []
    if cut is None:
        return out
    shape = bound.arguments[first].shape

    def back(t):  # the block's result, cut as its input was
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.shape == shape:
            return from_layout(t, cut.device_mesh, cut._layout)
        return t

    return torch.utils._pytree.tree_map(back, out)


def _tokens_of(x: DTensor, state: _State) -> tuple[ShardTensor, list]:
    """``x`` as a ShardTensor whose every mesh dim cuts a token dim, one of them the
    experts' mesh, and the process groups of its other mesh dims; or an error that says
    what is wrong (every rank alike: the layout is global)."""
    st = ShardTensor.from_dtensor(x)
    ranks = dist.get_process_group_ranks
    mesh = st.device_mesh
    mine = [d for d in range(mesh.ndim) if ranks(mesh.get_group(d)) == ranks(state.group)]
    if not mine:
        raise ValueError(
            f"ExpertParallel: the block's input is cut over the mesh {mesh}, none of whose "
            f"dims is the experts' {state.mesh}: cut the tokens over the experts' mesh"
        )
    for place in st.placements:
        if not isinstance(place, Shard) or place.dim % st.ndim == st.ndim - 1:
            raise ValueError(
                f"ExpertParallel: the block's input is {place!r} over a dim of its mesh; "
                "each rank must hold its own tokens: cut a token dim (batch or sequence, "
                "Shard(0) or Shard(1)) over every mesh dim, not the hidden dim, nor "
                "Replicate/Partial"
            )
    return st, [mesh.get_group(d) for d in range(mesh.ndim) if d != mine[0]]
