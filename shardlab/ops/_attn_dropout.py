"""Attention dropout for sharded SDPA: one global keep mask, whatever the mesh and sizes.

torch drops elements of the normalised attention probabilities P = softmax(S) (over
all keys) and scales the kept ones: ``out = (P * M / (1-p)) @ V``, keep with
probability 1-p. Here element (l, i, j) of the global probabilities (*, H, S_q, S_kv)
keeps iff ``u(seed, e) >= p``, u the counter of ``_counter.py`` (the one sharded
``F.dropout`` uses) and::

    e = (l * S_q + i) * S_kv + j      l: global row-major index of the leading dims
                                         (batch, head), also where they are sharded
                                      i, j: TRUE sequence positions of the query and
                                         the key (head-tail storage: the same mask)

so every rank draws its own block of one mask: the result is the same for any world
size and shard sizes (1 rank = the definition on one device). ``seed`` is one
``torch.randint`` draw per call (:func:`shardlab.ops._counter.draw_seed`): after the
same ``torch.manual_seed`` every rank draws the same one. It is NOT torch's own mask:
torch's fused kernels draw Philox bits per kernel tile (CUDA) or Bernoulli noise of the
whole (*, H, S_q, S_kv) tensor (CPU math), which no cut of the sequence can reproduce;
outputs match torch's in distribution, not bit for bit.

In the ring (``_ring.py``) the online-softmax normaliser z and the logsumexp see every
key WITHOUT the mask; only the P @ V product uses the dropped P, and merging blocks by
logsumexp stays exact (dropout is linear after normalisation)::

    forward   o_j = ((p_j * M_j) @ v_j) / z_j / (1-p),   lse_j = m_j + log z_j
    backward  P' = P * M / (1-p),  O the dropped output:
              dV = P'^T dO,   dP = (dO V^T) * M / (1-p),   dS = P * (dP - rowsum(dO * O))

The seed lives in the plan saved with the autograd context, so backward redraws the
same mask; a recomputation under ``torch.utils.checkpoint`` restores the generator and
draws the same seed. Cost: a block with dropout runs in the explicit path (no fused
kernel): scores of (S_q_local x S_kv_block) per ring step, forward and backward, plus a
boolean mask of the same size (backward also one more score-sized product P * M), and
the counter's int64 temporaries (2 x 64K elements at a time on the CPU, 2 x 16M on a
GPU). Drawing the mask is a dozen integer passes per element, twice (forward and
backward): on the CPU it costs about as much as the explicit attention itself.
``dropout_p = 0``: nothing here runs, no random number is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlab.ops._counter import counter_keep


def check_p(p: float, error: type[Exception] = RuntimeError) -> None:
    """torch's check and words (SDPA raises RuntimeError, ``F.dropout`` ValueError)."""
    if p < 0.0 or p > 1.0:
        raise error(f"dropout probability has to be between 0 and 1, but got {p}")


def lead_index(layout, coord) -> torch.Tensor:
    """Global row-major index of the leading (batch, head, ...) rows held at ``coord``,
    shaped to broadcast to the local leading shape (a 0-d tensor without leading dims)."""
    nlead = len(layout.global_shape) - 2
    idx = torch.zeros((), dtype=torch.long)
    for d in range(nlead):
        view = [1] * nlead
        view[d] = -1
        mine = torch.as_tensor(layout.dim_indices(d, coord), dtype=torch.long).view(view)
        idx = idx * layout.global_shape[d] + mine
    return idx


@dataclass
class AttnDropout:
    """What every block needs to draw its part of the keep mask (see the module)."""

    p: float
    seed: int
    lead: torch.Tensor  # global leading index of the local rows (lead_index)
    q_pos: torch.Tensor  # true positions of the local query rows (S_q_local,)
    kv_pos: torch.Tensor  # true positions of every stored K/V row (S_kv,)
    sq: int  # global query length
    skv: int  # global key length

    @property
    def factor(self) -> float:
        """The kept probabilities' scale: 1/(1-p); 0 for p = 1 (everything dropped)."""
        return 0.0 if self.p >= 1.0 else 1.0 / (1.0 - self.p)

    def keep(self, start: int, size: int, like: torch.Tensor) -> torch.Tensor:
        """Boolean keep mask of the local queries against stored K/V rows
        ``start:start+size``, shape (*like.shape[:-2], S_q_local, size), on like's device."""
        dev, lead = like.device, like.shape[:-2]
        rows = (self.lead.to(dev) * self.sq)[..., None] + self.q_pos.to(dev)  # (*, S_q)
        rows = rows.expand(*lead, len(self.q_pos)).reshape(-1) * self.skv
        cols = self.kv_pos[start : start + size].to(dev)
        return counter_keep(self.seed, rows, cols, self.p).view(*lead, len(self.q_pos), size)
