"""Which ops of torch's op database compute on their shards, and which gather the tensor.

Run: ``python benchmarks/census.py [--worlds 3 4] [--list]``

Each op of ``op_db`` with a float64 sample whose input has at least two entries along the
swept dim (dim 0, then the last dim) runs once on a ShardTensor cut there in random
uneven sizes (zeros included), forward only, on 3 and 4 gloo ranks. Verdict per op:

- ``shards``: no whole-tensor gather (:class:`shardlab.GatherWarning` not raised);
- ``gathered``: some input was gathered whole onto every rank (a rule is missing);
- ``error``: the call raised (on every rank: torch's own refusal of the sample, mostly).

Bytes: what rank 0 moved for the call (sent, received and collective payloads), over the
input's size. ``--list`` prints the ops that gather, with the op the warning named.
"""

from __future__ import annotations

import argparse
import random


def _cases(dim: int) -> list:
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    skip = {"bernoulli", "normal", "uniform", "log_normal", "multinomial", "exponential",
            "geometric", "cauchy", "empty", "empty_like", "new_empty", "new_empty_strided",
            "empty_strided", "empty_permuted"}  # fmt: skip
    torch.manual_seed(0)
    out = []
    for i, op in enumerate(op_db):
        if op.name in skip or op.name.startswith("jiterator"):
            continue
        if torch.float64 not in op.supported_dtypes("cpu"):
            continue
        try:
            for n, s in enumerate(op.sample_inputs("cpu", torch.float64)):
                if n > 8:
                    break
                x = s.input
                if isinstance(x, torch.Tensor) and x.ndim and x.shape[dim % x.ndim] >= 2:
                    out.append((i, x, tuple(s.args), dict(s.kwargs)))
                    break
        except Exception:  # noqa: BLE001  (a sample torch cannot make here)
            continue
    return out


def body(cases, dim: int, seed: int):
    import warnings

    from torch.distributed.tensor import Shard
    from torch.testing._internal.common_methods_invocations import op_db

    import shardlab
    from shardlab.comm import gathers

    mesh = shardlab.this_rank().mesh
    rng = random.Random(seed)
    rows = []
    for i, inp, args, kwargs in cases:
        op = op_db[i]
        d = dim % inp.ndim
        cuts = sorted(rng.randint(0, inp.shape[d]) for _ in range(mesh.size() - 1))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, inp.shape[d]])]
        gathers._SEEN.clear()  # (each op's first gather is said)
        with warnings.catch_warnings(record=True) as w, shardlab.trace() as t:
            warnings.simplefilter("always")
            try:
                x = shardlab.distribute(inp, mesh, [Shard(d)], [sizes])
                op.op(x, *args, **kwargs)
                verdict = "shards"
            except Exception:  # noqa: BLE001  (the same on every rank)
                verdict = "error"
        said = [str(m.message) for m in w if issubclass(m.category, shardlab.GatherWarning)]
        if said and verdict == "shards":
            verdict = "gathered"
        moved = sum(e.bytes for e in t.events)
        size = inp.numel() * inp.element_size()
        what = said[0].split(" has no rule")[0].removeprefix("shardlab: ") if said else ""
        rows.append((op.full_name, verdict, moved / max(size, 1), what))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[3, 4])
    p.add_argument("--list", action="store_true", help="the ops that gather, and why")
    a = p.parse_args()
    import shardlab

    print("| ranks | cut | ops | on shards | gathered | error | median bytes / input |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    listed = {}
    for n in a.worlds:
        with shardlab.Ranks(n) as ranks:
            for dim, name in ((0, "dim 0"), (-1, "last dim")):
                rows = ranks.run(body, _cases(dim), dim, n)[0]
                count = {v: sum(r[1] == v for r in rows) for v in ("shards", "gathered", "error")}
                ratios = sorted(r[2] for r in rows if r[1] != "error")
                med = ratios[len(ratios) // 2] if ratios else 0.0
                print(f"| {n} | {name} | {len(rows)} | {count['shards']} | {count['gathered']} "
                      f"| {count['error']} | {med:.2f} |")  # fmt: skip
                for op, verdict, _, what in rows:
                    if verdict == "gathered":
                        listed.setdefault(op, set()).add(what)
    if a.list:
        print(f"\n{len(listed)} ops gather in some configuration (the op the warning names):")
        for op in sorted(listed):
            print(f"- {op}: {', '.join(sorted(listed[op]))}")


if __name__ == "__main__":
    main()
