"""The kernel a ring-attention block runs in, and how it is chosen.

A block is the local queries against one K/V block (or a piece of it: head-tail
balancing cuts each into two position runs). A block every query sees all of, or
the causal diagonal (the same positions), runs in a fused kernel that returns the
block's output and its logsumexp without a (S_q x S_kv) score matrix in memory;
the ring merges blocks by logsumexp, the same way on every device::

    block without a mask (or a boolean mask showing all of it)
      cpu                                         -> "cpu-flash"
      cuda, fp16/bf16, sm80+, D = D_v <= 256      -> "flash"       (FlashAttention-2)
      cuda, fp16/bf16/fp32                        -> "efficient"   (memory-efficient)
    a mask that hides part of the block, float64 on CUDA, a head dim the fused
    kernels take not (D or D_v not a multiple of 8 on CUDA), or the kernel
    switched off (torch.backends.cuda.enable_flash_sdp(False) ...)
                                                  -> "explicit"    (scores in memory)

:func:`choose` is a pure function of (device, dtype, head dims, capability, what
torch allows); :func:`forward` and :func:`backward` call torch's aten ops with
their exact contracts: q, k, v of shape (*, H, S, D) are viewed as 4-D, the
memory-efficient kernel's logsumexp is padded to a multiple of 32 rows (cut off
after forward, padded again for backward), and the random-number state the CUDA
kernels return (unused without dropout) goes from forward to backward in ``rng``.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

FUSED = ("cpu-flash", "flash", "efficient")


def choose(
    device_type: str,
    dtype: torch.dtype,
    d_qk: int,
    d_v: int,
    *,
    capability: tuple[int, int] | None = None,
    flash: bool = True,
    efficient: bool = True,
) -> str:
    """The kernel of an unmasked block: one of :data:`FUSED`, or ``"explicit"``.

    ``capability``: the CUDA device's compute capability; ``flash``/``efficient``:
    whether torch allows those kernels now (``torch.backends.cuda.*_sdp_enabled()``).
    """
    if d_qk < 1 or d_v < 1:
        return "explicit"
    if device_type == "cpu":
        return "cpu-flash" if d_qk == d_v else "explicit"
    if device_type != "cuda" or d_qk % 8 or d_v % 8:
        return "explicit"
    half = dtype in (torch.float16, torch.bfloat16)
    if flash and half and d_qk == d_v <= 256 and capability is not None and capability >= (8, 0):
        return "flash"
    if efficient and (half or dtype == torch.float32):
        return "efficient"
    return "explicit"


def choose_for(q: torch.Tensor, v: torch.Tensor) -> str:
    """:func:`choose` for these tensors, on this machine (what torch allows now)."""
    dev = q.device
    cap = flash = efficient = None
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        flash = torch.backends.cuda.flash_sdp_enabled()
        efficient = torch.backends.cuda.mem_efficient_sdp_enabled()
    return choose(
        dev.type,
        q.dtype,
        q.shape[-1],
        v.shape[-1],
        capability=cap,
        flash=bool(flash) if flash is not None else True,
        efficient=bool(efficient) if efficient is not None else True,
    )


def input_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a block's q, k, v enter ``kind`` in: the CUDA kernels take half
    precision as it is; the CPU kernel and explicit scores compute in float32 (or
    float64) and merge in it."""
    if kind in ("flash", "efficient"):
        return dtype
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _four(x: torch.Tensor) -> torch.Tensor:
    """(*, H, S, D) as (B, H, S, D), the kernels' layout (a view where it can be)."""
    if x.ndim == 4:
        return x.contiguous()
    if x.ndim < 4:
        return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape)).contiguous()
    return x.reshape(-1, *x.shape[-3:]).contiguous()


def _pad_rows(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """The memory-efficient kernel's logsumexp layout: (B, H, ceil(S/32)*32)."""
    padded = math.ceil(rows / 32) * 32
    if lse.shape[-1] == padded:
        return lse.contiguous()
    out = lse.new_zeros((*lse.shape[:-1], padded))
    out[..., :rows] = lse
    return out


def forward(kind: str, q, k, v, causal: bool, scale: float, rng: dict):
    """``kind``'s output (*, H, S_q, D_v) in q's dtype and logsumexp (*, H, S_q) in
    float32 (float64 for float64 inputs on CPU). ``causal``: the diagonal block (the
    same positions on both sides, so top-left and bottom-right alignment agree)."""
    q4, k4, v4 = _four(q), _four(k), _four(v)
    if kind == "cpu-flash":
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, scale=scale
        )[:2]
    elif kind == "flash":
        res = aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal, False, scale=scale)
        o, lse = res[0], res[1]
        rng.setdefault(kind, (res[6], res[7]))
    elif kind == "efficient":
        res = aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, None, True, 0.0, causal, scale=scale
        )
        o, lse = res[0], res[1][..., : q4.shape[-2]]  # (B, H, S_q) of the padded rows
        rng.setdefault(kind, (res[2], res[3]))
    else:
        raise ValueError(f"no fused kernel {kind!r}: one of {FUSED}")
    return o.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


def backward(kind: str, dout, q, k, v, out, lse, causal: bool, scale: float, rng: dict):
    """(dq, dk, dv) of ``kind``'s block, given the *final* output and logsumexp of the
    query rows (over every block: the ring's exact softmax), in the inputs' dtypes."""
    d4, q4, k4, v4, o4 = (_four(x) for x in (dout, q, k, v, out))
    l3 = lse.reshape(q4.shape[:-1]).contiguous()  # (B, H, S_q)
    sq, sk = q4.shape[-2], k4.shape[-2]
    if kind == "cpu-flash":
        g = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d4, q4, k4, v4, o4, l3, 0.0, causal, scale=scale
        )
    elif kind == "flash":
        seed, offset = rng[kind]
        g = aten._scaled_dot_product_flash_attention_backward(
            d4, q4, k4, v4, o4, l3, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
        )
    elif kind == "efficient":
        seed, offset = rng[kind]
        g = aten._scaled_dot_product_efficient_attention_backward(
            d4, q4, k4, v4, None, o4, _pad_rows(l3, sq), seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
    else:
        raise ValueError(f"no fused kernel {kind!r}: one of {FUSED}")
    return tuple(gx.reshape(x.shape) for gx, x in zip(g[:3], (q, k, v)))
