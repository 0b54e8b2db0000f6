"""Small mixture-of-experts models from ``transformers`` (random weights, nothing
downloaded) for the expert-parallel tests: Mixtral (top-2 of 4 experts) and Qwen2-MoE
(top-2 of 4, plus a shared expert behind a sigmoid gate)."""

from __future__ import annotations

import torch

VOCAB, HIDDEN, K = 64, 16, 2
SMALL = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def config(family: str, experts: int = 4):
    import transformers as tf

    if family == "mixtral":
        cfg = tf.MixtralConfig(
            **SMALL, intermediate_size=32, num_local_experts=experts, num_experts_per_tok=K
        )
    else:
        cfg = tf.Qwen2MoeConfig(
            **SMALL, intermediate_size=32, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_experts=experts, num_experts_per_tok=K,
        )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def model(family: str, dtype=torch.float64):
    """A causal LM, 2 layers, both MoE. float64 runs the experts in transformers' eager
    loop (its grouped matmul takes no float64 on CPU); float32 in ``grouped_mm``."""
    import transformers as tf

    torch.manual_seed(0)
    cls = tf.MixtralForCausalLM if family == "mixtral" else tf.Qwen2MoeForCausalLM
    m = cls(config(family))
    if dtype == torch.float64:
        m.set_experts_implementation("eager")
    return m.to(dtype)


def block(family: str, experts: int = 4):
    """One sparse MoE block, float64 (eager experts), weights drawn wide enough that the
    router's choices are far from ties."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = config(family, experts)
    cfg._experts_implementation = "eager"
    cls = MixtralSparseMoeBlock if family == "mixtral" else Qwen2MoeSparseMoeBlock
    b = cls(cfg).double()
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.3)
    return b


def routed(block, x: torch.Tensor):
    """(top_k_index (T, k), top_k_weights (T, k)) of the block's router on ``x``."""
    _, weights, index = block.gate(x.reshape(-1, x.shape[-1]))
    return index, weights


def cut(sizes: list[int], rank: int) -> slice:
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def close(a, b, tol=1e-12) -> bool:
    return a.shape == b.shape and (a.numel() == 0 or torch.allclose(a, b, rtol=tol, atol=tol))
