"""The other doors to the window families: torch's own callables that compute what an
F-level family computes, with other arguments, taken over at ``__torch_function__``.

A ShardTensor reaches a convolution, a pooling or a resampling through many callables
besides ``torch.nn.functional.<name>``: torch's builtins (``torch.convolution``,
``torch.max_pool2d``, ``torch._C._nn.upsample_bilinear2d`` …, what ``F`` calls once a
call is plain, and what torch's op database and older libraries call directly), and the
F functions ``F.<name>`` dispatches to (``F.max_pool2d_with_indices``, which
``F.max_pool2d(..., return_indices=True)`` hands ``__torch_function__``). Each is taken
here (:class:`Door`): its arguments are put in the F function's order and the call goes
to the same entry as ``F.<name>`` (:func:`shardlab.ops.registry.call`), so it sends the
same messages, only the halo rows (``conv2d.halo``, ``max_pool2d.halo``,
``interpolate.halo`` …; see each family). A layout or argument the family does not take
(``NotImplementedError``) goes on to torch's own call on the ShardTensors, as before.
A call with no ShardTensor never comes here: torch's own code runs unchanged.

================================================  ==========================================
torch callable                                    entry (arguments)
================================================  ==========================================
``torch.convolution``, ``torch._convolution``      ``conv{n}d`` / ``conv_transpose{n}d``
``torch.max_pool{1,2,3}d``                         ``max_pool{n}d``
``torch.max_pool1d_with_indices``,                 ``max_pool{n}d(..., return_indices=True)``
``torch._C._nn.max_pool{2,3}d_with_indices``,
``F.max_pool{n}d_with_indices``
``torch.adaptive_max_pool1d``,                     ``adaptive_max_pool{n}d(..., True)``
``torch._C._nn.adaptive_max_pool{2,3}d``,
``F.adaptive_max_pool{n}d_with_indices``
``torch._C._nn.adaptive_avg_pool{2,3}d``            ``adaptive_avg_pool{n}d``
``torch._C._nn.upsample_*``, ``_upsample_*_aa``      ``interpolate(mode=..., antialias=...)``
``torch._C._nn.im2col``                            ``unfold``
``torch.group_norm``, ``torch.instance_norm``       ``group_norm``, ``instance_norm``
================================================  ==========================================

(``torch.conv{n}d``, ``torch.conv_transpose{n}d``, ``torch.avg_pool1d``,
``torch.adaptive_avg_pool1d`` and ``torch._C._nn.avg_pool{2,3}d`` *are* the F functions:
their families register them at ``__torch_function__`` themselves. ``torch.batch_norm``
and ``F.batch_norm`` stay with aten: on whole blocks the engine keeps torch's kernel as one
local call, ``tests/engine/test_whole.py``; on a cut, torch's decomposition and the rules.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardlab.engine.registry import register
from shardlab.ops.registry import call

__all__ = ["DOORS", "Door"]

_NN = torch._C._nn


class Door:
    """The registry's entry for a torch callable that reaches ``F.<name>``'s family:
    ``adapt(*args, **kwargs)`` returns the F function's ``(args, kwargs)`` (``name``
    None: ``(name, args, kwargs)``, the entry chosen by the arguments), or raises
    ``NotImplementedError``: torch's own call then, as without this door."""

    __slots__ = ("name", "adapt")

    def __init__(self, name, adapt):
        self.name, self.adapt = name, adapt

    def __call__(self, func, args, kwargs):
        try:
            out = self.adapt(*args, **kwargs)
            name, args, kwargs = (self.name, *out) if self.name else out
            return call(name, args, kwargs)
        except NotImplementedError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"Door(-> F.{self.name or '<by arguments>'})"


DOORS: dict = {}  # torch callable -> Door


def _door(fn, name, adapt) -> None:
    if fn is None:  # (not in this torch)
        return
    DOORS[fn] = door = Door(name, adapt)
    register(fn, at_function=True)(door)


def _same(*args, **kwargs):
    return args, kwargs


# convolution: aten's signature, transposed or not
def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                 groups, *_flags, **_more):  # fmt: skip
    n = weight.ndim - 2
    if transposed:
        args = (input, weight, bias, stride, padding, output_padding, groups, dilation)
        return f"conv_transpose{n}d", args, {}
    return f"conv{n}d", (input, weight, bias, stride, padding, dilation, groups), {}


_door(torch.convolution, None, _convolution)
_door(getattr(torch, "_convolution", None), None, _convolution)


# max pooling: the builtins (no return_indices) and the F / builtin *_with_indices
def _with_indices(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                  return_indices=True):  # fmt: skip
    return (input, kernel_size, stride, padding, dilation, ceil_mode), {"return_indices": True}


def _adaptive_with_indices(input, output_size, return_indices=True):
    return (input, output_size, True), {}


for _n in (1, 2, 3):
    _door(getattr(torch, f"max_pool{_n}d"), f"max_pool{_n}d", _same)
    _door(getattr(F, f"max_pool{_n}d_with_indices"), f"max_pool{_n}d", _with_indices)
    _door(getattr(F, f"adaptive_max_pool{_n}d_with_indices"), f"adaptive_max_pool{_n}d",
          _adaptive_with_indices)  # fmt: skip
_door(torch.max_pool1d_with_indices, "max_pool1d", _with_indices)
_door(torch.adaptive_max_pool1d, "adaptive_max_pool1d", _adaptive_with_indices)
for _n in (2, 3):
    _door(getattr(_NN, f"max_pool{_n}d_with_indices"), f"max_pool{_n}d", _with_indices)
    _door(getattr(_NN, f"adaptive_max_pool{_n}d"), f"adaptive_max_pool{_n}d",
          _adaptive_with_indices)  # fmt: skip
    _door(getattr(_NN, f"adaptive_avg_pool{_n}d"), f"adaptive_avg_pool{_n}d", _same)


# resampling: torch's upsample kernels, as F.interpolate calls them
def _upsample(mode: str, n: int, corners: bool, antialias: bool = False):
    """``(input, output_size, [align_corners,] scale_factors)`` (what F.interpolate
    calls), or the overload with one scale per dim (``scales_h`` …): an output size
    that is ``floor(size * scale)`` on every dim, as F.interpolate makes it."""

    def adapt(input, output_size=None, *rest, **kwargs):
        align = None
        if corners:
            align = rest[0] if rest else kwargs.pop("align_corners", None)
            rest = rest[1:]
        vec = rest[0] is None or isinstance(rest[0], (list, tuple)) if rest else True
        if len(rest) <= 1 and vec and set(kwargs) <= {"scale_factors"}:
            scales = rest[0] if rest else kwargs.get("scale_factors")
        else:  # one scale per spatial dim
            named = [kwargs.get(k) for k in ("scales", "scales_d", "scales_h", "scales_w")]
            per_dim = [*rest, *[s for s in named if s is not None]]
            if output_size is None or len(per_dim) not in (0, n):
                raise NotImplementedError(f"upsample: arguments {rest}, {kwargs}")
            scales = None
            if any(s is not None for s in per_dim):
                spatial = input.shape[-n:]
                if any(s is None or math.floor(L * s) != o
                       for L, s, o in zip(spatial, per_dim, output_size)):  # fmt: skip
                    raise NotImplementedError("upsample: an output size apart from its scales")
                scales, output_size = per_dim, None
        if scales is not None:
            return (input, None, list(scales), mode, align, False, antialias), {}
        return (input, list(output_size), None, mode, align, None, antialias), {}

    return adapt


_UPSAMPLE = {
    "upsample_nearest{n}d": ("nearest", False),
    "_upsample_nearest_exact{n}d": ("nearest-exact", False),
}
for _n in (1, 2, 3):
    for _name, (_mode, _corners) in _UPSAMPLE.items():
        _door(getattr(_NN, _name.format(n=_n), None), "interpolate",
              _upsample(_mode, _n, _corners))  # fmt: skip
for _name, _mode, _n in (("upsample_linear1d", "linear", 1),
                         ("upsample_bilinear2d", "bilinear", 2),
                         ("upsample_trilinear3d", "trilinear", 3),
                         ("upsample_bicubic2d", "bicubic", 2)):  # fmt: skip
    _door(getattr(_NN, _name, None), "interpolate", _upsample(_mode, _n, True))
_door(getattr(_NN, "_upsample_bilinear2d_aa", None), "interpolate",
      _upsample("bilinear", 2, True, antialias=True))  # fmt: skip
_door(getattr(_NN, "_upsample_bicubic2d_aa", None), "interpolate",
      _upsample("bicubic", 2, True, antialias=True))  # fmt: skip


# windows without weights, and the norms (torch's argument orders)
_door(_NN.im2col, "unfold", _same)  # (input, kernel_size, dilation, padding, stride): F's


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    return (input, num_groups, weight, bias, eps), {}


def _instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum,
                   eps, cudnn_enabled=True):  # fmt: skip
    return (input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps), {}


_door(torch.group_norm, "group_norm", _group_norm)
_door(torch.instance_norm, "instance_norm", _instance_norm)
