"""A cost model: one :class:`~shardlab.cost.Link` per kind of message, and the
least-squares fit that calibrates it from measured times."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardlab.cost.formulas import ALGORITHMS, Link, coefficients, family, formula_bytes

__all__ = ["CostModel", "fit_link"]


@dataclass
class CostModel:
    """What a message costs: ``links[family]`` (``"p2p"``, ``"all_reduce"``, …) gives the
    ``α`` and ``β`` that family's formula (``shardlab/cost/formulas.py``) is evaluated
    with; a family without a link of its own uses ``links["p2p"]``.

    Attributes:
        links: family -> :class:`~shardlab.cost.Link`; ``"p2p"`` is required.
        algorithms: family -> algorithm (``{"all_reduce": "tree"}``); the rest use the
            first of ``shardlab.cost.formulas.ALGORITHMS``.
        where: what it describes, in words (``"2 gloo ranks on 2 CPU cores"``).
        samples: family -> ``[(Event.bytes, group size, seconds), ...]`` it was fitted
            to (empty for a model written by hand).

    Calibrated per family, the model absorbs what one formula cannot say of a library (gloo
    runs its own all-reduce, not exactly the ring of the table); with one link for every
    family (:meth:`uniform`) it is the textbook model of one network.

    Example::

        model = CostModel.uniform(Link(alpha=5e-6, beta=1 / 100e9))
        model.time("all_reduce", 4 << 20, p=8)   # seconds for 4 MiB over 8 ranks, ring
    """

    links: dict[str, Link]
    algorithms: dict[str, str] = field(default_factory=dict)
    where: str = ""
    samples: dict[str, list] = field(default_factory=dict)

    def __post_init__(self):
        if "p2p" not in self.links:
            raise ValueError("links: a cost model needs a 'p2p' link (the default of every kind)")
        for fam, algorithm in self.algorithms.items():
            coefficients(fam if fam != "p2p" else "send", 0, 2, algorithm)  # names checked

    @classmethod
    def uniform(cls, link: Link, where: str = "", **algorithms: str) -> CostModel:
        """Every kind over the one ``link``."""
        return cls({"p2p": link}, dict(algorithms), where)

    def link(self, kind: str) -> Link:
        """The link ``kind``'s formula is evaluated with."""
        return self.links.get(family(kind), self.links["p2p"])

    def algorithm(self, kind: str) -> str:
        """The algorithm ``kind`` is costed with (``"ring"``, ``"tree"``, ...)."""
        fam = family(kind)
        return self.algorithms.get(fam, ALGORITHMS[fam][0])

    def time(self, kind: str, nbytes: int, p: int) -> float:
        """Seconds of one message of ``kind`` whose ``Event.bytes`` is ``nbytes`` (what one
        rank hands over: its shard for an all-gather) in a group of ``p`` ranks."""
        a, b = coefficients(kind, formula_bytes(kind, nbytes, p), p, self.algorithm(kind))
        return self.link(kind).time(a, b)

    def fit_error(self) -> dict[str, float]:
        """family -> the largest relative error of the model on its own samples."""
        worst = {}
        for fam, rows in self.samples.items():
            kind = "send" if fam == "p2p" else fam
            errs = [abs(self.time(kind, n, p) - t) / t for n, p, t in rows if t > 0]
            worst[fam] = max(errs, default=0.0)
        return worst

    def __str__(self) -> str:
        fits = self.fit_error()
        head = f"CostModel{' (' + self.where + ')' if self.where else ''}"
        lines = [head, f"{'kind':<16}{'algorithm':<15}{'α µs':>9}{'MB/s':>10}{'worst fit':>11}"]
        for fam, link in self.links.items():
            kind = "send" if fam == "p2p" else fam
            worst = f"{fits[fam]:.0%}" if fam in fits else ""
            lines.append(f"{fam:<16}{self.algorithm(kind):<15}{link.alpha * 1e6:>9.1f}"
                         f"{link.bandwidth / 1e6:>10.0f}{worst:>11}")  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain data (JSON-able); :meth:`from_dict` reads it back."""
        return {
            "links": {k: [v.alpha, v.beta] for k, v in self.links.items()},
            "algorithms": dict(self.algorithms),
            "where": self.where,
            "samples": {k: [list(r) for r in v] for k, v in self.samples.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """The model :meth:`to_dict` wrote."""
        links = {k: Link(*v) for k, v in d["links"].items()}
        samples = {k: [tuple(r) for r in v] for k, v in d.get("samples", {}).items()}
        return cls(links, d.get("algorithms", {}), d.get("where", ""), samples)


def fit_link(rows) -> Link:
    """The :class:`Link` whose ``a·α + b·β`` best matches the measured ``t`` of ``rows``
    (``[(a, b, t), ...]``), in relative terms (a 10 µs message counts as much as a 10 ms
    one), with ``α, β >= 0``.

    1. Weighted least squares, weight ``1 / t²``: minimise ``Σ ((a·α + b·β - t) / t)²``;
       the two normal equations give ``α`` and ``β``.
    2. Where that makes one of them negative (or the rows cannot tell them apart), fit
       each alone (``β = 0``, then ``α = 0``) and keep the better of the two.
    """
    rows = [(float(a), float(b), float(t)) for a, b, t in rows if t > 0 and (a or b)]
    if not rows:
        raise ValueError("rows: no measured time > 0 to fit a link to")
    saa = sum(a * a / t**2 for a, b, t in rows)
    sbb = sum(b * b / t**2 for a, b, t in rows)
    sab = sum(a * b / t**2 for a, b, t in rows)
    sat = sum(a / t for a, b, t in rows)
    sbt = sum(b / t for a, b, t in rows)
    det = saa * sbb - sab * sab
    if det > 1e-12 * max(saa * sbb, 1e-300):  # 1. both
        alpha, beta = (sat * sbb - sbt * sab) / det, (sbt * saa - sat * sab) / det
        if alpha >= 0 and beta >= 0:
            return Link(alpha, beta)

    def loss(link):
        return sum(((link.time(a, b) - t) / t) ** 2 for a, b, t in rows)

    one = [Link(sat / saa, 0.0)] if saa > 0 else []  # 2. each alone
    one += [Link(0.0, sbt / sbb)] if sbb > 0 else []
    return min(one, key=loss)


def _median(values) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def fit_model(samples: dict, algorithms: dict | None = None, where: str = "") -> CostModel:
    """The model fitted to ``samples`` (family -> ``[(Event.bytes, p, seconds), ...]``, every
    repeat): per family and size the median of the repeats, then :func:`fit_link`."""
    algorithms = dict(algorithms or {})
    links, kept = {}, {}
    for fam, rows in samples.items():
        by_size: dict = {}
        for n, p, t in rows:
            by_size.setdefault((n, p), []).append(t)
        kept[fam] = [(n, p, _median(ts)) for (n, p), ts in sorted(by_size.items())]
        kind = "send" if fam == "p2p" else fam
        algorithm = algorithms.get(fam, ALGORITHMS[family(kind)][0])
        coef = [
            (*coefficients(kind, formula_bytes(kind, n, p), p, algorithm), t)
            for n, p, t in kept[fam]
        ]
        if any(math.isfinite(t) and t > 0 for *_, t in coef):
            links[fam] = fit_link(coef)
    return CostModel(links, algorithms, where, kept)
