"""``shardlab.explain(model)``: every module of a model in call order, with the messages
and bytes each sends, forward and backward (:mod:`.explain`), and its tables and figures
(:mod:`.explanation`).

The top layer: it reads whole models, so it may import everything (the tracer, the class,
the ranks, the figures of :mod:`shardlab.viz`).
"""
