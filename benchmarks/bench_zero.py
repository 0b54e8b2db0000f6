"""ZeRO stages 0-3: each one's per-rank memory, predicted by formula and measured on ranks.

``python benchmarks/bench_zero.py [--ranks 2 4] [--layers 6] [--hidden 64] [--seq 8]``
prints one markdown row per stage and number of ranks (``shardlab.zero.compare``): a
``transformers`` Llama of ``--layers`` blocks of width ``--hidden`` (random weights,
float32), Adam, each rank its own ``--batch`` x ``--seq`` tokens; two steps, the second
measured.

* params / grads / optim: bytes of the distinct storages under the parameters (a DTensor's
  local shard), their gradients and Adam's state after the step (KiB), on the rank holding
  the most; predicted: ``shardlab.zero.predict`` (Ψ float32 parameters, K = 8 bytes of
  Adam state per parameter, N ranks; torch's stage 2 keeps its parameters cut between
  steps);
* peak: the most live bytes at once during the step, everything included (storages made
  since the model was built, counted by a dispatch mode that also follows FSDP2's storage
  resizes); predicted: the states, the parameters gathered whole, FSDP's flat all-gather
  buffer and the activations of one forward and backward on one device (measured);
* ratios: measured over predicted (the states: params + grads + optim);
* messages: rank 0's collectives in the step, with the bytes it handed in (its shard for
  an all-gather, its whole input for an all-reduce or a reduce-scatter).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import shardlab  # noqa: E402
from benchmarks._common import where  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8)
    a = parser.parse_args()
    from shardlab import zero

    model_fn = functools.partial(zero.llama, layers=a.layers, hidden=a.hidden, vocab=a.vocab)
    batch_fn = functools.partial(zero.tokens, batch=a.batch, seq=a.seq, vocab=a.vocab)
    psi = sum(p.numel() for p in model_fn().parameters())
    print(
        f"Llama: {a.layers} blocks, width {a.hidden}, vocab {a.vocab}: Ψ = {psi:,} float32 "
        f"parameters; Adam; {a.batch} x {a.seq} tokens per rank; {where('cpu')}"
    )
    rows = []
    for n in a.ranks:
        start = time.perf_counter()
        with shardlab.Ranks(n, timeout=600) as ranks:
            rows += zero.compare(ranks, model_fn, batch_fn)
        print(f"({n} ranks: {time.perf_counter() - start:.1f} s)")
    print(zero.table(rows))


if __name__ == "__main__":
    main()
