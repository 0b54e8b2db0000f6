"""Measuring helpers shared by the benchmark scripts (not part of the library)."""

from __future__ import annotations


def fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold after large frees (up to 32 MiB), after which big
    tensors live on the heap and RSS stops following live memory: pin it at 128 KiB."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def received_bytes(events, rank: int) -> float:
    """Bytes ``rank`` receives: a ``recv`` counts its size; collectives count what a ring
    algorithm delivers to each rank (all_gather (n-1) x input, all_reduce 2 (n-1)/n x
    input, reduce_scatter and all_to_all (n-1)/n x input, broadcast and scatter the
    tensor or chunk on non-root ranks)."""
    total = 0.0
    for e in events:
        if e.rank != rank:
            continue
        g = len(e.group)
        if e.kind == "recv":
            total += e.bytes
        elif e.kind == "all_gather":
            total += e.bytes * (g - 1)
        elif e.kind == "all_reduce":
            total += 2 * e.bytes * (g - 1) / g
        elif e.kind in ("reduce_scatter", "all_to_all"):
            total += e.bytes * (g - 1) / g
        elif e.kind in ("broadcast", "scatter") and e.peer != rank:
            total += e.bytes
    return total


def ranks_on(world: int, device: str = "cpu", timeout: float = 120.0):
    """``world`` ranks with their tensors on ``device``: gloo on the CPU; on CUDA nccl with
    a GPU per rank where there are enough, else gloo ranks sharing the GPUs (messages
    staged through host memory), as ``shardlab.testing.cuda_ranks_for`` chooses."""
    import torch

    import shardlab

    if device == "cpu":
        return shardlab.Ranks(world, timeout=timeout)
    backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    return shardlab.Ranks(world, backend=backend, device="cuda", timeout=timeout)


def synchronize(device) -> None:
    """Wait for the device's queued kernels (CUDA), so that a timer sees them."""
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def where(device: str) -> str:
    """The machine in words: ``"<cores> CPU cores"`` or the GPU's name."""
    import os

    import torch

    if device == "cuda":
        return f"on one {torch.cuda.get_device_name(0)}"
    return f"on {os.cpu_count()} CPU cores"


def tutorial_unet_source() -> str:
    """Tutorial 09's ``block`` and ``UNet`` as the notebook defines them (source text, to
    ``exec`` where ``nn``, ``F`` and ``torch`` are defined: a benchmark measures the
    tutorial's own model, not a copy)."""
    import ast
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "tutorials" / "09_capstone_unet.py"
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if getattr(n, "name", None) in ("block", "UNet")]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))
