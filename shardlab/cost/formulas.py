"""The standard costs of messages: latency plus bytes over bandwidth.

One link between two ranks costs ``α`` seconds per message (latency: the time to start
one, whatever its size) and ``β`` seconds per byte (1 / bandwidth). A point-to-point
message of ``n`` bytes takes ``α + n·β``. A collective is a schedule of such messages;
counting the steps on the critical path gives its cost as

    t = a·α + b·β        (a: messages in a row, b: bytes one rank sends in a row)

with ``a`` and ``b`` functions of the group size ``p`` and the bytes ``n``
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH", IJHPCA 2005; NCCL's documentation and the JAX scaling book use the same ring
formulas). :func:`coefficients` returns ``(a, b)``:

======================== ============== ================= ===============================
kind (algorithm)         ``a``          ``b``             ``n`` is
======================== ============== ================= ===============================
send, recv               1              n                 the message
all_reduce, ring         2(p-1)         2(p-1)/p · n      the tensor (every rank's)
all_reduce, tree         2⌈log2 p⌉      2⌈log2 p⌉ · n     the tensor
all_gather, ring         p-1            (p-1)/p · n       the gathered tensor (p shards)
reduce_scatter, ring     p-1            (p-1)/p · n       the input (p chunks)
all_to_all, pairwise     p-1            (p-1)/p · n       one rank's input (p chunks)
broadcast, reduce: tree  ⌈log2 p⌉       ⌈log2 p⌉ · n      the tensor
scatter, gather: tree    ⌈log2 p⌉       (p-1)/p · n       the whole (p chunks)
barrier                  ⌈log2 p⌉       0                 (nothing)
======================== ============== ================= ===============================

The ring all-reduce is a reduce-scatter then an all-gather (each ``p-1`` steps of
``n/p`` bytes); the tree all-reduce reduces up a binomial tree and broadcasts down it
(``⌈log2 p⌉`` steps each, the whole tensor every step; not pipelined). The time to add
the numbers of a reduction is not a term of its own: a calibrated ``β`` absorbs it.
``b`` is also the bytes one rank sends on the wire (:func:`wire_bytes`).

**What a trace counts.** :class:`shardlab.trace.Event` ``.bytes`` is one rank's payload:
for ``all_gather`` its own shard, for ``scatter`` (and ``gather``) its own chunk, for every
other kind the whole tensor it hands over. :func:`formula_bytes` turns it into the ``n``
of the table: ``p ×`` the shard for ``all_gather``, ``scatter`` and ``gather``, the bytes
as they are for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ALGORITHMS", "Link", "coefficients", "family", "formula_bytes", "wire_bytes"]

# the algorithms each kind may be costed with; the first is the default
ALGORITHMS = {
    "p2p": ("direct",),
    "all_reduce": ("ring", "tree"),
    "all_gather": ("ring",),
    "reduce_scatter": ("ring",),
    "all_to_all": ("pairwise",),
    "broadcast": ("tree",),
    "reduce": ("tree",),
    "scatter": ("tree",),
    "gather": ("tree",),
    "barrier": ("dissemination",),
}


@dataclass(frozen=True)
class Link:
    """One link's cost: ``alpha`` seconds per message, ``beta`` seconds per byte.

    ``Link(alpha=20e-6, beta=1 / 10e9)``: 20 µs to start a message, 10 GB/s.
    """

    alpha: float
    beta: float

    def __post_init__(self):
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"Link: {name} must be a finite number >= 0, got {value!r}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``1 / beta``; ``inf`` for ``beta == 0``)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def time(self, a: float, b: float) -> float:
        """Seconds of ``a`` messages in a row carrying ``b`` bytes: ``a·α + b·β``."""
        return a * self.alpha + b * self.beta

    def __str__(self) -> str:
        return f"α {self.alpha * 1e6:.1f} µs, {self.bandwidth / 1e6:.0f} MB/s"


def family(kind: str) -> str:
    """The cost family of an event kind: ``"p2p"`` for ``send``/``recv``, else the kind."""
    if kind in ("send", "recv"):
        return "p2p"
    if kind not in ALGORITHMS:
        raise ValueError(f"kind: {kind!r} is no message kind (known: send, recv, "
                         f"{', '.join(k for k in ALGORITHMS if k != 'p2p')})")  # fmt: skip
    return kind


def formula_bytes(kind: str, nbytes: int, p: int) -> int:
    """The ``n`` of :func:`coefficients` for an event of ``kind`` whose ``Event.bytes`` is
    ``nbytes``, in a group of ``p`` ranks: the gathered (scattered) whole for
    ``all_gather``, ``scatter`` and ``gather`` (``p ×`` one rank's piece), ``nbytes`` for
    the rest."""
    return nbytes * p if family(kind) in ("all_gather", "scatter", "gather") else nbytes


def _log2(p: int) -> int:
    return max(p - 1, 0).bit_length()  # ⌈log2 p⌉: 1 -> 0, 2 -> 1, 3 -> 2, 4 -> 2, 5 -> 3


def coefficients(kind: str, n: float, p: int, algorithm: str | None = None):
    """``(a, b)`` of ``t = a·α + b·β`` for ``kind`` moving ``n`` bytes (the formula's ``n``:
    :func:`formula_bytes`) in a group of ``p`` ranks, by ``algorithm`` (default: the
    first of ``ALGORITHMS``). A group of one rank sends nothing: ``(0, 0)``."""
    fam = family(kind)
    algorithm = algorithm or ALGORITHMS[fam][0]
    if algorithm not in ALGORITHMS[fam]:
        raise ValueError(f"algorithm: {algorithm!r} is not one for {kind} "
                         f"(known: {', '.join(ALGORITHMS[fam])})")  # fmt: skip
    if n < 0:
        raise ValueError(f"n: the bytes must be >= 0, got {n}")
    if fam == "p2p":
        return 1, n
    if p < 1:
        raise ValueError(f"p: a group has at least one rank, got {p}")
    if p == 1:
        return 0, 0
    lg = _log2(p)
    if fam == "all_reduce":
        return (2 * (p - 1), 2 * (p - 1) / p * n) if algorithm == "ring" else (2 * lg, 2 * lg * n)
    if fam in ("all_gather", "reduce_scatter", "all_to_all"):
        return p - 1, (p - 1) / p * n
    if fam in ("broadcast", "reduce"):
        return lg, lg * n
    if fam in ("scatter", "gather"):
        return lg, (p - 1) / p * n
    return lg, 0  # barrier


def wire_bytes(kind: str, nbytes: int, p: int, algorithm: str | None = None) -> float:
    """Bytes one rank sends in a row for an event of ``kind`` with ``Event.bytes`` =
    ``nbytes`` in a group of ``p``: the ``b`` of :func:`coefficients` (a ring all-reduce of
    ``n`` bytes sends ``2(p-1)/p · n``)."""
    return coefficients(kind, formula_bytes(kind, nbytes, p), p, algorithm)[1]
