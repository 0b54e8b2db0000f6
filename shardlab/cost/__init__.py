"""A cost model of messages: latency plus bytes over bandwidth.

::

    model = shardlab.cost.calibrate(ranks)        # seconds: a few sizes of each kind
    print(model)                                  # α and bandwidth per kind
    with shardlab.trace() as t:
        ranks.run(train_step)
    p = shardlab.cost.predict(t, model)
    print(p)                                      # per kind, per rank, the step
    p.predicted, p.measured                       # the step's communication, seconds

- ``formulas.py``: ``t = a·α + b·β`` for a point-to-point message and the standard
  algorithms of each collective (ring, tree), and what ``Event.bytes`` means for each;
- ``model.py``: :class:`CostModel`, one ``(α, β)`` link per kind, and the fit;
- ``pairing.py``: a trace's events paired into messages, their measured time;
- ``calibrate.py``: :func:`calibrate`, on the ranks at hand;
- ``predict.py``: :func:`predict`, a trace's messages and step, predicted and measured;
- ``cluster.py``: a recorded step projected onto a :class:`Cluster` described by its
  parameters (NVLink, InfiniBand, GPU FLOP/s) at other :class:`Degrees`: :func:`project`;
- ``explore.py``: :func:`plot_projection` and :func:`projection_explorer`.

The top layer: it reads traces (:mod:`shardlab.trace`) and runs on a pool
(``shardlab.runtime``); nothing below imports it. Guide: ``docs/guides/cost.md``.
"""

from shardlab.cost.calibrate import calibrate
from shardlab.cost.cluster import (
    Cluster,
    Degrees,
    Growth,
    Projection,
    Step,
    Traffic,
    count_flops,
    project,
    recorded_step,
    rule_of,
    scale,
    spans_nodes,
)
from shardlab.cost.explore import ProjectionExplorer, plot_projection, projection_explorer
from shardlab.cost.formulas import Link, coefficients, formula_bytes, wire_bytes
from shardlab.cost.model import CostModel, fit_link
from shardlab.cost.pairing import Message, gaps, messages
from shardlab.cost.predict import MessageCost, Prediction, predict

__all__ = [
    "Cluster",
    "CostModel",
    "Degrees",
    "Growth",
    "Projection",
    "ProjectionExplorer",
    "Step",
    "Traffic",
    "count_flops",
    "plot_projection",
    "project",
    "projection_explorer",
    "recorded_step",
    "rule_of",
    "scale",
    "spans_nodes",
    "Link",
    "Message",
    "MessageCost",
    "Prediction",
    "calibrate",
    "coefficients",
    "fit_link",
    "formula_bytes",
    "gaps",
    "messages",
    "predict",
    "wire_bytes",
]
