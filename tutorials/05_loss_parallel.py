# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Loss parallelism: cross-entropy over sharded classes
#
# A language model's last layer produces logits of shape (tokens, vocabulary).
# With a 128k vocabulary that tensor is large, so tensor parallelism keeps it
# **sharded on the class dim**: each rank holds the logits of some classes.
#
# Cross-entropy needs, per token, `log(sum(exp(logits)))` over *all* classes and
# the logit of the target class. Both are sums over classes, so each rank sums
# its own classes and two small all-reduces finish the job: one for the max
# (numerical safety), one for the sums. Nobody ever holds the full logits.

# %%
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab import viz

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)
CLASSES = [3 + 2 * r for r in range(WORLD)]  # uneven class shards, e.g. [3, 5, 7, 9]
print("classes per rank:", CLASSES)

# %%
viz.plot_placements(mesh_shape=(WORLD,), placements=[Shard(1)],
                    global_shape=(6, sum(CLASSES)), sizes=[CLASSES])

# %% [markdown]
# ## The unchanged `nn.CrossEntropyLoss`
#
# Inside `shardlab.patched()`, `F.cross_entropy` on a class-sharded ShardTensor runs
# the vocab-parallel algorithm. Every argument torch has works; here label
# smoothing and class weights. We compare loss and gradient with one device.

# %%
def loss_parallel(classes):
    me = shardlab.this_rank()
    torch.manual_seed(0)
    logits = torch.randn(6, sum(classes), dtype=torch.float64)  # (tokens, vocabulary)
    target = torch.randint(0, sum(classes), (6,))
    weight = torch.rand(sum(classes), dtype=torch.float64)
    loss_fn = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    ref_logits = logits.clone().requires_grad_()
    loss_fn(ref_logits, target).backward()

    start = sum(classes[: me.rank])
    block = logits[:, start : start + classes[me.rank]].clone().requires_grad_()  # (6, C_local)
    with shardlab.patched():
        sharded = shardlab.ShardTensor.from_local(block, me.mesh, [Shard(1)], [classes])
        with shardlab.trace() as forward:
            loss = loss_fn(sharded, target)
    with shardlab.trace() as backward:
        loss.backward()
    same = abs(float(loss.detach()) - float(loss_fn(logits, target))) < 1e-12
    same_grad = torch.allclose(block.grad, ref_logits.grad[:, start : start + classes[me.rank]])
    return same, same_grad, forward.counts(), backward.counts(), forward.events


results = ranks.run(loss_parallel, CLASSES)
for rank, (same, same_grad, fwd, bwd, _) in enumerate(results):
    print(f"rank {rank}: forward {fwd}, backward {bwd or 'no messages'}")
    assert same and same_grad and fwd == {"all_reduce": 2} and not bwd
viz.plot_collectives(shardlab.trace.Trace([e for *_, events in results for e in events]))

# %% [markdown]
# Two all-reduces of a few numbers per token in forward, none in backward: the
# gradient `softmax - one_hot` of each class lives where its logits live.
#
# ## Segmentation: a mean over uneven shards
#
# For an image sharded over its rows, the loss of each pixel is local, but the
# `mean` must divide by the number of pixels of the *whole* image (minus the
# ignored ones). One all-reduce of (sum, count) gives exactly torch's value.

# %%
def segmentation(rows):
    me = shardlab.this_rank()
    torch.manual_seed(1)
    logits = torch.randn(2, 4, sum(rows), 5, dtype=torch.float64)  # (N, C, H, W)
    target = torch.randint(0, 4, (2, sum(rows), 5))
    target[0, 0] = -100  # ignored pixels
    ref = F.cross_entropy(logits, target)
    with shardlab.patched():
        x = shardlab.distribute(logits, me.mesh, [Shard(2)], sizes=[rows])
        with shardlab.trace() as t:
            loss = F.cross_entropy(x, target)
    return abs(float(loss) - float(ref)) < 1e-12, t.counts()


for same, counts in ranks.run(segmentation, [4] + [2] * (WORLD - 1)):
    assert same and counts == {"all_reduce": 1}  # (sum, count): one all-reduce
print("segmentation mean equals one device; messages per rank:", counts)

# %%
ranks.close()
