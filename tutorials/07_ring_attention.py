# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Attention over a sharded sequence: ring attention
#
# With the sequence cut into blocks, each rank holds its queries, keys and
# values. Every query needs *every* key and value, so the K/V blocks travel
# around a ring: at each step a rank computes attention of its queries against
# the block it holds, passes the block on, and merges the partial results with
# a running log-sum-exp. After N-1 steps each rank has seen every block once and
# its output equals single-device attention.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab import viz
from shardlab.trace import Trace

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)
SEQ = [2 + r for r in range(WORLD)]  # uneven sequence blocks, e.g. [2, 3, 4, 5]
print("sequence positions per rank:", SEQ)

# %% [markdown]
# ## Unchanged `F.scaled_dot_product_attention`
#
# Causal attention on (batch, heads, sequence, head_dim) tensors sharded on the
# sequence dim, forward and backward against one device.

# %%
def ring(seq):
    me = shardlab.this_rank()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, sum(seq), 4, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q_ = q.clone().requires_grad_()
    with shardlab.patched():
        qs = shardlab.distribute(q_, me.mesh, [Shard(2)], sizes=[seq])  # (1, 2, S_local, 4)
        ks, vs = (shardlab.distribute(t, me.mesh, [Shard(2)], sizes=[seq]) for t in (k, v))
        with shardlab.trace() as t:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    out.full_tensor().sum().backward()
    q_ref = q.clone().requires_grad_()
    F.scaled_dot_product_attention(q_ref, k, v, is_causal=True).sum().backward()
    same = torch.allclose(out.full_tensor(), ref) and torch.allclose(q_.grad, q_ref.grad)
    return same, t.events


results = ranks.run(ring, SEQ)
assert all(same for same, _ in results)
print("forward and query gradient equal one device")

# %% [markdown]
# ## The ring, as messages
#
# Each arrow is one K/V block moving to the next rank (K and V travel in one message).

# %%
trace = Trace([e for _, events in results for e in events])
print(trace.counts(rank=0))
assert trace.counts(rank=0)["recv"] == WORLD - 1  # K and V of every other rank, once
fig, ax = plt.subplots(figsize=(12, 3.6))  # wide enough for the ring's 12 steps
_ = viz.plot_collectives(trace, ax=ax)

# %%
ranks.close()
