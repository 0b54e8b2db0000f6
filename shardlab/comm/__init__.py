"""The messages: everything shardlab sends between ranks, on local tensors.

Layer 2 (``layout`` → **comm** → ``tensor`` → ``engine`` → ``ops`` → ``patch``).
It may import :mod:`shardlab.layout`, :mod:`shardlab.trace` (the tracer that records each
message), :mod:`shardlab.runtime` and :mod:`shardlab._compat`; nothing above it.

- :mod:`.p2p`: a layout change carried out on one rank's block (the plan comes from
  :func:`shardlab.layout.redistribute_plan`); mesh coordinates and ranks;
- :mod:`.collectives`: all-reduce, all-gather and exchanges, differentiable where a rule
  needs them to be;
- :mod:`.halo`: the halo exchange of window ops (post the edges, send the gradient back);
- :mod:`.recompute`: the same message order on every rank under activation checkpointing;
- :mod:`.traced`: ShardTensor under ``torch.compile`` (eager regions, the flatten format);
  :mod:`.traced_ops`: which ops dynamo may trace; :mod:`.graphs`: messages in graphs
  (opt-in) or breaking them;
- :mod:`._once`: backward passes computed on blocks (first order only).
"""
