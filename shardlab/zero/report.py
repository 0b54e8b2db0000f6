"""The formula beside the measurement, for every stage: :func:`compare` and :func:`table`.

::

    with shardlab.Ranks(4) as ranks:
        rows = shardlab.zero.compare(ranks, functools.partial(shardlab.zero.llama, layers=6))
    print(shardlab.zero.table(rows))
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.zero.formula import Prediction, predict
from shardlab.zero.stages import Measured, measure, tokens

__all__ = ["Row", "compare", "table"]

_FIELDS = ("params", "grads", "optim", "peak")


@dataclass
class Row:
    """One stage on one number of ranks: ``predicted`` (:class:`Prediction`, one rank's)
    and ``measured`` (:class:`Measured`, one per rank)."""

    predicted: Prediction
    measured: list[Measured]

    @property
    def stage(self) -> int:
        """The ZeRO stage (0-3) of this row."""
        return self.predicted.stage

    @property
    def ranks(self) -> int:
        """How many ranks the stage ran on."""
        return self.predicted.ranks

    def worst(self, name: str) -> int:
        """The most bytes of ``name`` (params, grads, optim, peak, states) on any rank."""
        return max(getattr(m, name) for m in self.measured)

    def ratio(self, name: str) -> float:
        """Measured over predicted for ``name``, on the rank that holds the most."""
        return self.worst(name) / getattr(self.predicted, name)


def _on_rank(model_fn, batch_fn, stage, kwargs):
    from shardlab.runtime import this_rank

    return measure(model_fn, batch_fn(this_rank().rank), stage, **kwargs)


def compare(ranks, model_fn, batch_fn=tokens, stages=(0, 1, 2, 3), **kwargs) -> list[Row]:
    """Run each of ``stages`` on the pool ``ranks`` (:func:`measure`, ``kwargs`` passed on)
    and predict it (:func:`predict`, float32 Adam, the measured model's Ψ, FSDP units
    and activations): one :class:`Row` per stage.

    Args:
        ranks: a :class:`shardlab.Ranks` pool.
        model_fn: makes the model on each rank (picklable: a module's function or a
            ``functools.partial`` of one, such as :func:`llama`).
        batch_fn: ``batch_fn(rank)`` -> that rank's inputs (default :func:`tokens`).
        stages: which of 0-3.
    """
    rows = []
    for stage in stages:
        measured = ranks.run(_on_rank, model_fn, batch_fn, stage, kwargs)
        m = measured[0]
        predicted = predict(m.psi, ranks.world_size, stage, units=m.units,
                            activations=m.activations)  # fmt: skip
        rows.append(Row(predicted, measured))
    return rows


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.0f}"


def _messages(m: Measured) -> str:
    return ", ".join(f"{k} {c} x = {_kib(b)}" for k, (c, b) in sorted(m.messages.items()))


def table(rows: list[Row]) -> str:
    """A markdown table: per stage and number of ranks, predicted / measured KiB on the
    rank holding the most, measured over predicted, and rank 0's messages of a step
    (kind, count, KiB it handed in)."""
    head = ["stage", "N"] + [f"{f} KiB pred / meas" for f in _FIELDS]
    head += ["states ratio", "peak ratio", "messages (rank 0: count x = KiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r.stage), str(r.ranks)]
        cells += [f"{_kib(getattr(r.predicted, f))} / {_kib(r.worst(f))}" for f in _FIELDS]
        cells += [f"{r.ratio('states'):.3f}", f"{r.ratio('peak'):.3f}", _messages(r.measured[0])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
