"""Figures of layouts, halos and messages, for learning what sharding does.

* :func:`plot_placements`   which rank holds which block of a global tensor
* :func:`plot_halos`        what each rank owns, receives and pads for a sharded conv / pool
* :func:`plot_collectives`  a sequence diagram of a :class:`shardlab.trace.Trace`
* :func:`halo_explorer`, :func:`placement_explorer`  the same with live controls (ipywidgets)
* :func:`plot_routing`, :func:`plot_expert_load`, :func:`plot_token_flow`, :func:`token_flow`,
  :func:`expert_explorer`  expert parallelism: the router's choices, the load per expert and
  the tokens each rank sends each (``experts.py``)

Importing this package imports neither matplotlib nor ipywidgets: each function imports what it
needs (ImportError with the pip command if missing). Figures are plain matplotlib Figures, not
registered with pyplot (nothing to close; Jupyter shows a returned figure once). The drawn
shapes are also stored on the figure (``fig.shardlab_blocks``, ``fig.shardlab_halos``,
``fig.shardlab_arrows``, ...) so that they can be checked against the layout math.
"""

from ._common import human_bytes
from .collectives import match_messages, plot_collectives
from .experts import (
    ExpertExplorer,
    expert_explorer,
    expert_load,
    plot_expert_load,
    plot_routing,
    plot_token_flow,
    simulate_routing,
    token_flow,
)
from .explorers import HaloExplorer, PlacementExplorer, halo_explorer, placement_explorer
from .halos import plot_halos
from .placements import as_layout, plot_placements

__all__ = [
    "ExpertExplorer",
    "HaloExplorer",
    "PlacementExplorer",
    "as_layout",
    "expert_explorer",
    "expert_load",
    "halo_explorer",
    "human_bytes",
    "match_messages",
    "placement_explorer",
    "plot_collectives",
    "plot_expert_load",
    "plot_halos",
    "plot_placements",
    "plot_routing",
    "plot_token_flow",
    "simulate_routing",
    "token_flow",
]
