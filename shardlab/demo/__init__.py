"""Workshop demos: scaling tables and plots on real ranks.

Run one on N ranks with torchrun (gloo on CPU, nccl when CUDA is available)::

    torchrun --nproc-per-node 4 -m shardlab.demo conv        # or: attention, loss
    python -m shardlab.demo conv -n 2                        # no torchrun: a shardlab.Ranks pool

=============  =====================================================================
``conv``       domain-parallel convolution: image size x ranks, halo bytes, speed-up
``attention``  ring attention: sequence length, causal or not, K/V bytes, speed-up
``loss``       vocab-parallel cross-entropy: vocabulary size, bytes, logits memory
``lm``         a decoder trained sequence-sharded (and sequence x tensor with N >= 4)
=============  =====================================================================

Each demo module has ``run(args) -> list[dict]``: it runs on every rank of the current
job (``shardlab.this_rank()``), checks the sharded result against one device, prints a
markdown table on rank 0 and saves ``<name>.png`` into ``args.out`` (rank 0). ``args``
is what ``python -m shardlab.demo`` parses (:func:`shardlab.demo.__main__.parse_args`).
"""

DEMOS = ("conv", "attention", "loss", "lm")

__all__ = ["DEMOS", "attention", "conv", "lm", "loss"]
