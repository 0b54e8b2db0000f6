"""Pipeline parallelism with torch's own ``torch.distributed.pipelining``, as it ran.

* :func:`step`: one training step of an unchanged ``transformers`` decoder cut into
  :class:`DecoderStage` s, with a schedule of :data:`SCHEDULES` (GPipe, 1F1B, interleaved
  1F1B, zero bubble);
* :func:`record`: each rank's :class:`Action` s (forward, backward, or its input and
  weight parts) with their wall-clock and CPU times;
* :func:`replay`: the timeline with one core per rank, from the actions and the traced
  messages; :func:`bubble`: its idle share, beside :func:`formula`, ``(p-1)/(m+p-1)``;
* :func:`plot` and :func:`explorer`: the timeline drawn, with live controls.
"""

from shardlab.pipeline.explore import COLOURS, PipelineExplorer, explorer, plot
from shardlab.pipeline.stages import (
    SCHEDULES,
    DecoderStage,
    Step,
    layer_ranges,
    lm_loss,
    stage_indices,
    step,
)
from shardlab.pipeline.timeline import KINDS, Action, bubble, formula, record, replay

__all__ = ["KINDS", "SCHEDULES", "Action", "DecoderStage", "Step", "bubble", "formula"]
__all__ += ["COLOURS", "PipelineExplorer", "explorer", "layer_ranges", "plot", "record"]
__all__ += ["lm_loss", "replay", "stage_indices", "step"]
