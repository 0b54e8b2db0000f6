"""Errors raised by the rank runtime."""

from __future__ import annotations

__all__ = ["RankError"]


class RankError(RuntimeError):
    """Code on one or more ranks failed.

    ``rank`` is the rank whose failure is reported (the first one that failed
    for a reason of its own, not because another rank had failed), ``exc_type``
    the name of its exception, ``remote_traceback`` its traceback as printed on
    that rank, and ``failures`` maps every failed rank to ``(exc_type, message)``.
    ``restarted`` is true when the pool had to be rebuilt (per-rank state lost).

    Example::

        def fail():
            if shardlab.this_rank().rank == 2:
                raise ValueError("bad input")

        try:
            ranks.run(fail)
        except shardlab.RankError as err:
            err.rank, err.exc_type      # (2, 'ValueError')
    """

    def __init__(
        self,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str = "",
        failures: dict[int, tuple[str, str]] | None = None,
        restarted: bool = False,
        note: str = "",
    ):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.failures = dict(failures or {rank: (exc_type, message)})
        self.restarted = restarted
        self.note = note
        super().__init__(self._text())

    def _text(self) -> str:
        lines = [f"rank {self.rank} raised {self.exc_type}: {self.message}"]
        others = [r for r in sorted(self.failures) if r != self.rank]
        if others:
            lines.append(
                "other failed ranks: " + ", ".join(f"{r} ({self.failures[r][0]})" for r in others)
            )
        if self.note:
            lines.append(self.note)
        if self.restarted:
            lines.append("the ranks will be restarted on the next call (their state is reset)")
        if self.remote_traceback:
            lines.append(f"--- traceback on rank {self.rank} ---")
            lines.append(self.remote_traceback.rstrip())
        return "\n".join(lines)

    def __reduce__(self):
        return (
            RankError,
            (
                self.rank,
                self.exc_type,
                self.message,
                self.remote_traceback,
                self.failures,
                self.restarted,
                self.note,
            ),
        )
