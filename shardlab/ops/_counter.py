"""The counter-based random numbers shared by sharded dropout (``dropout.py``) and
attention dropout (``_attn_dropout.py``): a pure function of (seed, global index).

``u(seed, e) = splitmix64(seed + e * golden) / 2^64`` (the top 53 bits): element ``e``
of a global tensor gets the same number on whatever rank holds it, whatever the mesh
and the shard sizes. ``seed`` is one draw of ``torch.randint`` from the default
generator (:func:`draw_seed`), so ``torch.manual_seed(s)`` on every rank makes the run
reproducible, and every rank draws the same seed (ranks whose generators differ draw
different seeds: seed them alike). These are not the bits of torch's own dropout.
"""

from __future__ import annotations

import math

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _i64(v: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) from splitmix64 of ``seed + index * golden`` (wrapping int64 math);
    float64, on ``index``'s device."""
    z = index * _i64(_GOLDEN) + _i64(seed % (1 << 64))
    z = (z ^ _shr(z, 30)) * _i64(_M1)
    z = (z ^ _shr(z, 27)) * _i64(_M2)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def draw_seed() -> int:
    """One draw from the default (CPU) generator: the same on every rank seeded alike;
    restored with the generator's state (``torch.utils.checkpoint`` recomputation)."""
    return int(torch.randint(0, 2**62, ()))


# elements of the int64 temporaries per step of counter_keep: on the CPU 512 KiB, so the
# dozen passes over them stay in cache (4x faster than 32 MiB steps, measured); on a GPU
# large steps (few kernel launches)
_CHUNK = {"cpu": 1 << 16}
_CHUNK_DEVICE = 1 << 24


def counter_keep(seed: int, rows: torch.Tensor, cols: torch.Tensor, p: float) -> torch.Tensor:
    """``counter_uniform(seed, rows[:, None] + cols[None, :]) >= p``: bool of shape
    (len(rows), len(cols)) on their device, the same bits without float temporaries
    (u = n / 2^53 with n the top 53 bits, so u >= p <=> n >= ceil(p 2^53), exact: p 2^53
    is a float64 times a power of two). Drawn a few rows at a time: besides the result,
    at most two int64 temporaries of ``_CHUNK`` elements."""
    out = torch.empty((len(rows), len(cols)), dtype=torch.bool, device=rows.device)
    step = max(1, _CHUNK.get(rows.device.type, _CHUNK_DEVICE) // max(1, len(cols)))
    threshold = math.ceil(p * (1 << 53))
    for a in range(0, len(rows), step):
        z = (rows[a : a + step, None] + cols).mul_(_i64(_GOLDEN)).add_(_i64(seed % (1 << 64)))
        t = torch.empty_like(z)
        for shift, mult in ((30, _M1), (27, _M2), (31, None)):
            torch.bitwise_right_shift(z, shift, out=t)
            z.bitwise_xor_(t.bitwise_and_((1 << (64 - shift)) - 1))
            if mult is not None:
                z.mul_(_i64(mult))
        top = z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)  # u = top / 2^53
        torch.ge(top, threshold, out=out[a : a + step])
    return out
