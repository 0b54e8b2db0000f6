"""ShardTensor: DTensor with exact, arbitrary shard sizes (see ``api.py``)."""

from shardlab.tensor.api import ShardTensor, distribute, scatter_tensor

__all__ = ["ShardTensor", "distribute", "scatter_tensor"]
