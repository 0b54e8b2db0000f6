"""Record and view every message between ranks.

::

    with shardlab.trace() as t:        # on a rank, or in the kernel around ranks.run
        ...
    print(t.table())
    t.counts(rank=0)                   # {'all_reduce': 1, 'send': 2, ...}
    t.bytes(rank=1, kind="send")

Ops label their messages with :func:`label` (``"conv2d.halo forward"``).

The tracer sits below the messages (``shardlab.comm`` records each one here) and imports
only ``shardlab.runtime``; ``shardlab.explain`` (``shardlab.explainer``), which reads whole
models, sits at the top.
"""

from shardlab.trace.events import Event, Trace
from shardlab.trace.record import current_label, label, trace

__all__ = ["Event", "Trace", "current_label", "label", "trace"]


class _CallableModule(__import__("types").ModuleType):
    """``shardlab.trace`` is this package *and* the context manager:
    ``with shardlab.trace() as t`` and ``shardlab.trace.label(...)`` both work."""

    def __call__(self, *args, **kwargs):
        return trace(*args, **kwargs)

    def __reduce__(self):  # pickled by reference, like any module
        return (__import__("importlib").import_module, (self.__name__,))


__import__("sys").modules[__name__].__class__ = _CallableModule
