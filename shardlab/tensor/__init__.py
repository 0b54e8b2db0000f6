"""ShardTensor: DTensor with exact, arbitrary shard sizes (see ``api.py``).

Layer 3 (``layout`` → ``comm`` → **tensor** → ``engine`` → ``ops`` → ``patch``): the
class, its constructors, its autograd Functions, pickling and checkpoint hooks. It may
import :mod:`shardlab.comm` and what is below it; nothing above it. The engine and the
ops install themselves on the class (:func:`shardlab.tensor.entry.install`) once this
package is loaded (:mod:`shardlab._layers`).
"""

from shardlab import _layers
from shardlab.tensor.api import ShardTensor
from shardlab.tensor.create import distribute, scatter_tensor

__all__ = ["ShardTensor", "distribute", "scatter_tensor"]

_layers.loaded(__name__)  # the engine and the ops, installed from above
