"""``python -m shardlab.demo NAME``: run one workshop demo on N ranks.

Under torchrun (``RANK``/``WORLD_SIZE`` set) this process is one rank: ``shardlab.Ranks()``
attaches to the job (process group from torchrun's env, device from ``LOCAL_RANK``) and
runs the demo in place. Without torchrun, ``-n N`` starts a ``shardlab.Ranks(N)`` pool
and runs the same function on it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shardlab.demo import DEMOS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardlab.demo",
        description="shardlab workshop demos: a scaling table and a plot, checked against "
        "one device. Start with torchrun --nproc-per-node N -m shardlab.demo NAME.",
    )
    p.add_argument("name", choices=DEMOS, help="which demo: " + ", ".join(DEMOS))
    p.add_argument("--out", default="shardlab-demo", help="folder for the plot (rank 0)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl"],
        help="auto: nccl with a GPU per rank, else gloo",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when torch sees a GPU (gloo ranks may share one), else cpu",
    )
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        metavar="SIZE",
        help="image sizes (conv), sequence lengths (attention) or vocabulary "
        "sizes (loss) instead of the defaults",
    )
    p.add_argument("--reps", type=int, default=None, help="timed steps per size (median)")
    p.add_argument(
        "-n",
        "--ranks",
        type=int,
        default=2,
        help="without torchrun: number of ranks to start (default 2)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective may wait (default 300)"
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.out = os.path.abspath(args.out)  # the ranks may run in another directory
    return args


def resolve_backend(backend: str, device: str, devices_needed: int) -> tuple[str, str]:
    """(backend, device) for ``auto``: nccl on CUDA with a GPU per rank; gloo on CUDA with
    fewer (ranks share a GPU, messages staged through the host: for learning); gloo on
    the CPU without one. (``torch.cuda.is_available`` does not initialise CUDA.)"""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if backend == "nccl" or gpus else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" and gpus >= devices_needed else "gloo"
    return backend, device


def main(argv: list[str] | None = None) -> int:
    from shardlab.runtime import RankError, Ranks
    from shardlab.runtime.context import env_rank
    from shardlab.runtime.replies import print_outputs

    args = parse_args(argv)
    run = importlib.import_module(f"shardlab.demo.{args.name}").run
    env = env_rank()  # (rank, world size, local rank) under torchrun, else None
    try:
        if env is not None:  # torchrun: attach, run here on every rank
            backend, device = resolve_backend(args.backend, args.device, env[2] + 1)
            with Ranks(backend=backend, device=device, timeout=args.timeout) as ranks:
                ranks.run(run, args)
            return 0
        backend, device = resolve_backend(args.backend, args.device, args.ranks)
        with Ranks(args.ranks, backend=backend, device=device, timeout=args.timeout) as ranks:
            _, outputs = ranks._call(run, (args,), {})
        sys.stdout.write(outputs[0])  # rank 0's table, as under torchrun
        print_outputs(["", *outputs[1:]])  # anything else, prefixed [rank i]
        return 0
    except (RankError, RuntimeError, ValueError) as exc:  # a failed check, no GPUs, ...
        if env is None or env[0] == 0:
            print(f"shardlab.demo {args.name} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
