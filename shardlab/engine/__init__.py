"""The dispatch engine: every aten op on a ShardTensor, decided and run.

Layer 4 (``layout`` → ``comm`` → ``tensor`` → **engine** → ``ops`` → ``patch``).
It may import :mod:`shardlab.tensor` and everything below it; nothing above it. It
installs itself on the class when imported (:func:`shardlab.tensor.entry.install`), as
DTensor installs its dispatcher.

- :mod:`.dispatch`: the one entry from ``__torch_dispatch__``: the key, a kept plan or
  the full path;
- :mod:`.registry`: the one registry, keyed by the torch callable (aten ops here, the
  ``torch.nn.functional`` families from :mod:`shardlab.ops`);
- :mod:`.rule`: what a rule returns, a :class:`~.rule.Plan`; :mod:`.plans`: how a plan
  runs; :mod:`.decisions`: the plans kept per signature;
- :mod:`.meta`: torch's checks and shapes on meta tensors, the one meta cache;
- :mod:`.whole`: every argument whole on every rank: torch's op on the blocks;
- :mod:`.nograd`: the replay at ``__torch_function__`` when nothing records autograd;
- :mod:`.lift`: plain tensors and DTensors next to ShardTensors;
- :mod:`.aten`: the rules of torch's tensor ops, one family per file.
"""

from shardlab import _layers
from shardlab.engine import dispatch, lift, nograd
from shardlab.tensor import entry

entry.install(dispatch=dispatch.dispatch, replay=nograd.call, lift=lift._lift_trainable)
_layers.loaded(__name__)  # the ops, if the engine was imported first (shardlab/__init__.py)
