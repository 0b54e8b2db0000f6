"""Global strides: dense, or in the dim order of another tensor's (pure arithmetic)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["contiguous_stride", "stride_like"]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def stride_like(template: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` in the dim order of the strides ``template`` (a global
    tensor's, the same on every rank): how torch lays out the result of an op that
    follows its input's layout (SDPA's output follows the query's)."""
    if len(template) != len(shape):
        return contiguous_stride(shape)
    order = sorted(range(len(shape)), key=lambda d: (-template[d], d))  # outer -> inner
    stride, acc = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)
