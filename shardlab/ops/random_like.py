"""``rand_like`` / ``randn_like`` / ``randint_like`` of a ShardTensor: each rank draws its
own block of ONE global tensor, laid out as the input (no message, ever).

The numbers follow sharded dropout's convention (``dropout.py``, its ``mask_scheme``):

* ``"counter"`` (default): element ``e`` (its global row-major flat index) gets
  ``u(seed, e)`` of ``_counter.py``, whatever rank holds it, whatever the mesh and the
  sizes; ``seed`` one draw of ``torch.randint`` from the generator (the default one, or
  the call's ``generator=``), so every rank seeded alike (``torch.manual_seed``) draws
  the same seed and advances its generator alike. O(block) work per rank::

      rand_like     u(seed, e)                                      in [0, 1)
      randn_like    sqrt(-2 log(1 - u(seed, 2e))) cos(2 pi u(seed, 2e + 1))   (Box-Muller)
      randint_like  low + floor(u(seed, e) (high - low))            in [low, high)

  the same tensor on 1 rank as on 4, not the bits of torch's own generator;
* ``"torch"``: every rank draws torch's own tensor of the global shape (the same as one
  device after the same ``manual_seed``) and keeps its block: exact, O(global) work and
  memory per rank (for checks and teaching).

1. the input's layout, Partial mesh dims made Replicate (random numbers are not a sum)
2. on each rank: the global indices its block holds, per dim (any layout: the layout's
   own list), and the numbers of those elements (Replicate mesh dims: the same numbers
   on every rank along them, as the global index is the same)

Messages: none. Not differentiable (torch's are not either).
"""

from __future__ import annotations

import math

import torch

from shardlab.engine import _common as c
from shardlab.engine.registry import register
from shardlab.engine.rule import Plan
from shardlab.ops import dropout
from shardlab.ops._counter import counter_uniform

aten = torch.ops.aten

_KINDS = {
    aten.rand_like.default: "rand",
    aten.rand_like.generator: "rand",
    aten.randn_like.default: "randn",
    aten.randn_like.generator: "randn",
    aten.randint_like.default: "randint",
    aten.randint_like.generator: "randint",
    aten.randint_like.low_dtype: "randint",
    aten.randint_like.low_generator_dtype: "randint",
}


@register(*_KINDS)
def random_like(func, args, kwargs):
    x = args[0]
    if not isinstance(x, c.ShardTensor) or any(not isinstance(a, int) for a in args[1:]):
        return NotImplemented
    layout = c.without_partial(x._layout)  # 1.
    moves = (None,) * (len(args) + len(kwargs))
    return Plan(x.device_mesh, layout, moves, "random_like", local=_Draw(func, x.device_mesh,
                                                                          layout))  # fmt: skip


class _Draw:
    """Step 2 on this rank (the seed drawn when it runs: each call draws anew)."""

    __slots__ = ("func", "kind", "layout", "mesh")

    def __init__(self, func, mesh, layout):
        self.func, self.kind, self.mesh, self.layout = func, _KINDS[func], mesh, layout

    def __call__(self, args, kwargs):
        block = args[0]
        gen = kwargs.get("generator")
        dtype = kwargs.get("dtype") or block.dtype
        device = kwargs.get("device") or block.device
        bounds = (0, args[1]) if len(args) == 2 else tuple(args[1:3])
        coord = c.me(self.mesh)
        shape = self.layout.global_shape
        if dropout._SCHEME[0] == "torch":  # torch's own tensor of the global shape, my block
            full = {"rand": torch.rand, "randn": torch.randn}.get(self.kind)
            if full is None:
                whole = torch.randint(*bounds, shape, generator=gen, dtype=dtype, device=device)
            else:
                whole = full(shape, generator=gen, dtype=dtype, device=device)
            for d in range(len(shape)):
                held = torch.as_tensor(self.layout.dim_indices(d, coord), device=device)
                whole = whole.index_select(d, held)
            return whole
        seed = int(torch.randint(0, 2**62, (), generator=gen))
        flat = torch.zeros((), dtype=torch.int64, device=device)
        for d, n in enumerate(shape):  # the row-major flat index of each element here
            held = torch.as_tensor(self.layout.dim_indices(d, coord), device=device)
            flat = flat.unsqueeze(-1) * n + held
        if self.kind == "randn":
            u1, u2 = counter_uniform(seed, 2 * flat), counter_uniform(seed, 2 * flat + 1)
            out = torch.sqrt(-2 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)
        elif self.kind == "rand":
            out = counter_uniform(seed, flat)
        else:
            low, high = bounds
            out = low + torch.floor(counter_uniform(seed, flat) * (high - low))
        out = out.to(dtype)
        if self.kind == "rand" and dtype.is_floating_point:  # (u near 1, rounded: below 1)
            one = torch.ones((), dtype=dtype, device=device)
            out = out.clamp(max=torch.nextafter(one, torch.zeros_like(one)))
        return out
