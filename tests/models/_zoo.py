"""Models nobody here wrote: ``transformers`` configs, small, random weights, nothing
downloaded. Shared by the zoo tests and ``benchmarks/bench_zoo.py``."""

from __future__ import annotations

import torch

IMAGE = (2, 3, 32, 32)  # pixel values (B, C, H, W); H is cut over the ranks
TOKENS = (2, 13)  # input ids (B, S); S is cut over the ranks
VOCAB = 64


def _no_randomness(model):
    """Dropout and stochastic depth off (random draws differ between the one-device run
    and the sharded one); the model stays in training mode (batch norm statistics)."""
    for k, v in vars(model.config).items():
        if ("dropout" in k or "drop_path" in k) and isinstance(v, float):
            setattr(model.config, k, 0.0)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):  # read from the config at construction
            if ("dropout" in name or name == "drop_prob") and isinstance(value, float):
                setattr(m, name, 0.0)
    return model


def vision(name: str):
    """``(model, kind)``: kind "cls" (labels (B,)) or "seg" (labels (B, H, W))."""
    model, kind = _vision(name)
    return _no_randomness(model), kind


def _vision(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "resnet":
        cfg = tf.ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=5,
        )
        return tf.ResNetForImageClassification(cfg), "cls"
    if name == "convnext":
        cfg = tf.ConvNextConfig(
            num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2, num_labels=5
        )
        return tf.ConvNextForImageClassification(cfg), "cls"
    if name == "vit":
        cfg = tf.ViTConfig(
            image_size=32,
            patch_size=4,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=5,
        )
        return tf.ViTForImageClassification(cfg), "cls"
    if name == "swin":
        cfg = tf.SwinConfig(
            image_size=32,
            patch_size=2,
            embed_dim=8,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            num_labels=5,
        )
        return tf.SwinForImageClassification(cfg), "cls"
    if name == "segformer":
        cfg = tf.SegformerConfig(
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[8, 16],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            decoder_hidden_size=16,
            num_labels=3,
        )
        return tf.SegformerForSemanticSegmentation(cfg), "seg"
    if name == "beit":  # a learned relative position bias: SDPA's attn_mask needs a gradient
        cfg = tf.BeitConfig(
            image_size=32,
            patch_size=4,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            use_relative_position_bias=True,
            num_labels=5,
        )
        model = tf.BeitForImageClassification(cfg)
        model.config._attn_implementation = "sdpa"
        return model, "cls"
    if name == "siglip":  # its head: one learned query attends to every (cut) patch
        cfg = tf.SiglipConfig(
            vision_config=dict(image_size=32, patch_size=4, hidden_size=16, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=32),
            text_config=dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                             num_attention_heads=2, intermediate_size=32),
            num_labels=5,
        )  # fmt: skip
        model = tf.SiglipForImageClassification(cfg)
        model.config._attn_implementation = "sdpa"
        return model, "cls"
    if name == "mobilevit":
        cfg = tf.MobileViTConfig(
            image_size=32,
            patch_size=2,
            hidden_sizes=[16, 16, 16],
            neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16],
            num_attention_heads=2,
            num_labels=5,
        )
        return tf.MobileViTForImageClassification(cfg), "cls"
    if name == "mobilenet_v2":  # depthwise 3x3 convs (groups = channels), ReLU6, stride 2
        cfg = tf.MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=5)
        return tf.MobileNetV2ForImageClassification(cfg), "cls"
    if name == "efficientnet":  # squeeze-excite: a global mean of the cut image scales it
        cfg = tf.EfficientNetConfig(
            image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128,
            num_labels=5,
        )  # fmt: skip
        model = tf.EfficientNetForImageClassification(cfg)
        for m in model.modules():  # transformers draws batch norm scales ~0.02: 1e-38 logits
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_parameters()  # torch's default (scale 1), a signal that survives
        return model, "cls"
    raise KeyError(name)


# the sizes of every small decoder here (RoPE, GQA: 4 query heads, 2 key/value heads)
SMALL_DECODER = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def decoder(name: str, **sizes):
    """A causal LM (RoPE, GQA, RMSNorm, SDPA attention); ``sizes`` override the config's."""
    import transformers as tf

    torch.manual_seed(0)
    config, model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[name]
    cfg = config(
        **{
            **SMALL_DECODER,
            **sizes,
        }
    )
    cfg._attn_implementation = "sdpa"
    return _no_randomness(model(cfg))


def seq2seq(name: str):
    """An encoder-decoder: T5 (a learned relative position bias in every attention) or
    BART (learned positions); ``labels`` give the decoder its shifted inputs."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0,
            pad_token_id=0,
        )  # fmt: skip
        model = tf.T5ForConditionalGeneration(cfg)
    else:
        cfg = tf.BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=64,
        )  # fmt: skip
        model = tf.BartForConditionalGeneration(cfg)
    model.config._attn_implementation = "sdpa"
    return _no_randomness(model)


SEQ2SEQ = ["t5", "bart"]


def eager_attention(name: str = "gemma2"):
    """A decoder whose attention is transformers' own eager code, not SDPA: Gemma 2 (its
    scores capped by a tanh, a sliding window on every other layer, a softmax taken in
    float32 whatever the model's dtype)."""
    import transformers as tf

    torch.manual_seed(0)
    sizes = {**SMALL_DECODER, "num_hidden_layers": 2}  # a sliding layer and a full one
    cfg = tf.Gemma2Config(**sizes, head_dim=4, sliding_window=4)
    cfg._attn_implementation = "eager"
    return _no_randomness(tf.Gemma2ForCausalLM(cfg))


def audio(name: str = "wav2vec2"):
    """A speech model on the raw waveform (B, T), T cut over the ranks: strided conv1d
    feature extraction with group norm, a grouped conv1d position embedding, then
    attention; SpecAugment's random masks off (they are random draws)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, num_labels=3, classifier_proj_size=8,
        mask_time_prob=0.0, layerdrop=0.0,
    )  # fmt: skip
    model = tf.Wav2Vec2ForSequenceClassification(cfg)
    model.config._attn_implementation = "sdpa"
    return _no_randomness(model)


WAVEFORM = (2, 400)  # raw audio samples (B, T); T is cut over the ranks


def moe(name: str = "mixtral"):
    """A mixture-of-experts decoder (top-2 of 4 experts; transformers runs the experts in
    ``torch._grouped_mm``, float32 and bfloat16 only on CPU)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(**SMALL_DECODER, num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    return _no_randomness(tf.MixtralForCausalLM(cfg))


def text(name: str):
    """A text model that is not a RoPE decoder: bidirectional encoders (BERT), positions
    counted from the padding (RoBERTa, OPT), ALiBi built from the padding mask (BLOOM),
    multi-query attention (Falcon), learned absolute positions (GPT-2). Its loss is the
    model's own (``labels``)."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, num_hidden_layers=1, num_attention_heads=2)
    models = {
        "bert": lambda: tf.BertForMaskedLM(
            tf.BertConfig(hidden_size=16, intermediate_size=32, max_position_embeddings=64, **small)
        ),
        "roberta": lambda: tf.RobertaForMaskedLM(
            tf.RobertaConfig(
                hidden_size=16, intermediate_size=32, max_position_embeddings=70, **small
            )
        ),
        "opt": lambda: tf.OPTForCausalLM(
            tf.OPTConfig(
                hidden_size=16,
                ffn_dim=32,
                max_position_embeddings=64,
                word_embed_proj_dim=16,
                **small,
            )
        ),  # fmt: skip
        "bloom": lambda: tf.BloomForCausalLM(
            tf.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2)
        ),
        "falcon": lambda: tf.FalconForCausalLM(  # multi-query: one K/V head
            tf.FalconConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=4,
                multi_query=True,
            )
        ),  # fmt: skip
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=1, n_head=2)
        ),
    }
    model = models[name]()
    model.config._attn_implementation = "sdpa"
    return _no_randomness(model)


TEXT = ["bert", "roberta", "opt", "bloom", "falcon", "gpt2"]
VISION = ["resnet", "convnext", "vit", "swin", "segformer", "mobilevit", "beit", "siglip"]
DECODERS = ["llama", "qwen2"]
CONV_NETS = ["mobilenet_v2", "efficientnet"]  # more vision models, tested on 3 ranks


def uneven(n: int, parts: int) -> list[int]:
    """Uneven sizes summing to n: a big first block, then alternating short/long."""
    base = [max(0, n // parts + (3 if i == 0 else -2 if i % 2 else 1)) for i in range(parts)]
    base[-1] += n - sum(base)
    if base[-1] < 0:
        base = [n // parts] * parts
        base[-1] += n - sum(base)
    return base
