"""ZeRO's stages, by formula and measured: what each keeps per rank of the parameters,
gradients and optimizer state, and what it sends.

* :func:`predict`: the ZeRO paper's table (Ψ parameters, K bytes of optimizer state per
  parameter, N ranks), the peak of a step and its messages;
* :func:`measure`: the stage built from torch's own pieces (DDP,
  ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``), trained on the ranks, its memory
  counted and its messages traced;
* :func:`compare` and :func:`table`: both, stage by stage;
* :func:`plot` and :func:`explorer`: the bars, predicted and measured.
"""

from shardlab.zero.explore import ZeroExplorer, explorer, llama_sizes, plot
from shardlab.zero.formula import ADAM_FP32, ADAM_MIXED, Prediction, predict
from shardlab.zero.report import Row, compare, table
from shardlab.zero.stages import Measured, activation_bytes, blocks, llama, measure, tokens

__all__ = ["ADAM_FP32", "ADAM_MIXED", "Measured", "Prediction", "Row", "activation_bytes"]
__all__ += ["ZeroExplorer", "blocks", "compare", "explorer", "llama", "llama_sizes", "measure"]
__all__ += ["plot", "predict", "table", "tokens"]
