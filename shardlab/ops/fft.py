"""Real-to-half-spectrum transforms whose backward stays on the shards.

``torch.fft.rfft`` / ``rfft2`` / ``rfftn`` / ``ihfft`` / ``ihfft2`` / ``ihfftn`` reach aten
as ``_fft_r2c``, whose forward the engine runs on the shards
(:mod:`shardlab.engine.aten.fft`). Torch's backward formula for it writes the gradient
into a fresh ``new_zeros`` of the whole spectrum, a tensor laid out whole on every rank:
the gradient would be gathered. Taken over at ``__torch_function__``, the same transform
gets a backward written with ops that stay cut::

    y = rfftn(x)              x (B, H, W) cut along H   ->   y (B, H, W//2 + 1)
    grad_x = real(ifftn(pad(grad_y, W//2 + 1 -> W)))  (torch's formula, unnormalised)
      1. the half spectrum padded with zeros along the last transformed dim
         (``constant_pad_nd``: each block pads its own part, no message)
      2. the inverse complex transform over the same dims (the engine's rule: local
         along whole dims, the transposition scheme along a cut one)
      3. its real part

Messages: those of the forward transform (none along whole dims, one all-to-all per
cut dim) and, in the backward, those of the inverse complex transform (the same).
The arguments (``n`` / ``s``, ``dim``, ``norm``) mean what torch's do; a call this does
not take (a complex or integer input, ``out=``) goes on to torch's own path.
"""

from __future__ import annotations

import torch

from shardlab.engine.registry import register
from shardlab.tensor.api import ShardTensor

aten = torch.ops.aten

_FORWARD_MODE = {None: 0, "backward": 0, "ortho": 1, "forward": 2}  # 1/sqrt(n), 1/n
_INVERSE_MODE = {None: 2, "backward": 2, "ortho": 1, "forward": 0}


class _HalfSpectrum(torch.autograd.Function):
    """``_fft_r2c(x, dims, mode, onesided=True)`` with torch's backward formula in ops
    that have rules on ShardTensors."""

    @staticmethod
    def forward(ctx, x, dims, mode):
        ctx.dims, ctx.mode, ctx.length = dims, mode, x.shape[dims[-1]]
        return aten._fft_r2c(x, dims, mode, True)

    @staticmethod
    def backward(ctx, grad):
        last = ctx.dims[-1] % grad.ndim
        missing = ctx.length - grad.shape[last]
        if missing > 0:  # 1. zeros for the half the forward left out
            grad = _zeros_after(grad, last, missing)
        full = aten._fft_c2c(grad, ctx.dims, ctx.mode, False)  # 2. inverse transform
        return torch.real(full), None, None  # 3.


def _zeros_after(x, d, k):
    """``x`` with ``k`` zeros appended along dim ``d`` (each block pads its own part)."""
    return aten.constant_pad_nd(x, [0, 0] * (x.ndim - 1 - d) + [0, k])


def _resized(x, dims, sizes):
    """``x`` cut or zero-padded to ``sizes`` along ``dims`` (torch's ``n`` / ``s``)."""
    for d, n in zip(dims, sizes, strict=True):
        if n == -1 or n == x.shape[d]:
            continue
        if n < 1:
            raise RuntimeError(f"Invalid number of data points ({n}) specified")
        if n < x.shape[d]:
            x = x.narrow(d, 0, n)
        else:
            x = _zeros_after(x, d, n - x.shape[d])
    return x


def _dims_and_sizes(x, s, dim, one: bool):
    """torch's reading of ``n`` / ``s`` and ``dim`` -> (dims, sizes), dims wrapped."""
    if one:  # rfft / ihfft: n, dim
        dims = [dim]
        sizes = [-1 if s is None else s]
    elif dim is None:
        dims = list(range(x.ndim)) if s is None else list(range(x.ndim - len(s), x.ndim))
        sizes = [-1] * len(dims) if s is None else list(s)
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        sizes = [-1] * len(dims) if s is None else list(s)
    if len(sizes) != len(dims):
        raise RuntimeError("When given, dim and shape arguments must have the same length")
    dims = [d % max(x.ndim, 1) for d in dims]
    if len(set(dims)) != len(dims):
        raise RuntimeError("FFT dims must be unique")
    return dims, sizes


def _half_spectrum(func, args, kwargs):
    """At ``__torch_function__``: a real-to-half-spectrum transform of a ShardTensor."""
    one = func in (torch.fft.rfft, torch.fft.ihfft)
    names = ("input", "n", "dim", "norm") if one else ("input", "s", "dim", "norm")
    call = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names or k in call:
            return NotImplemented  # (out=, or a duplicate: torch's own path says so)
        call[k] = v
    x = call["input"]
    if not isinstance(x, ShardTensor) or not x.dtype.is_floating_point:
        return NotImplemented  # torch's path: complex input refused, integers promoted
    default = -1 if one else ((-2, -1) if func in (torch.fft.rfft2, torch.fft.ihfft2) else None)
    dims, sizes = _dims_and_sizes(x, call.get("n", call.get("s")), call.get("dim", default), one)
    norm = call.get("norm")
    inverse = func in (torch.fft.ihfft, torch.fft.ihfft2, torch.fft.ihfftn)
    modes = _INVERSE_MODE if inverse else _FORWARD_MODE
    if norm not in modes:
        raise ValueError(f"Invalid normalization mode: {norm}")
    y = _HalfSpectrum.apply(_resized(x, dims, sizes), dims, modes[norm])
    return torch.conj(y) if inverse else y


register(
    torch.fft.rfft, torch.fft.rfft2, torch.fft.rfftn,
    torch.fft.ihfft, torch.fft.ihfft2, torch.fft.ihfftn,
    at_function=True,
)(_half_spectrum)  # fmt: skip
