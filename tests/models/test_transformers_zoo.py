"""Models from a library nobody here wrote run sharded, unchanged, and equal one device.

``transformers`` vision models take pixel values cut along H with uneven sizes;
decoders take input ids and labels cut along the sequence. float64 throughout: logits,
loss, the input gradient and every parameter gradient are compared with one device.
(The decoders' own loss upcasts the logits to float32 -- ``logits.float()`` inside
transformers -- so their loss and gradients are compared at float32 tolerance, and the
same loss is also computed in float64 from the sharded logits, tightly.)
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.models import _zoo

pytest.importorskip("transformers")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _bad_params(want, got, rtol, atol):
    """Names of the parameters whose gradient is missing, not a plain tensor, or off."""
    return sorted(
        n
        for n, v in want.items()
        if type(got.get(n)) is not torch.Tensor
        or not torch.allclose(got[n], v, rtol=rtol, atol=atol)
    )


# The vision models that still gather a whole tensor (each warns, naming it); every other
# one runs under ``gathers("raise")``: a gather that appears there fails the test.
GATHERING = {
    ("siglip", False): "its pooling head's attention: one learned query, the keys cut",
    ("siglip", True): "its pooling head's attention: one learned query, the keys cut",
    ("swin", True): "a window view of a dim cut by both mesh dims (nested)",
}


def _vision_body(name: str, mesh_2d: bool = False, atol: float = 1e-12):
    def body():
        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh_for((2, 2)) if mesh_2d else this_rank().mesh
        model, kind = _zoo.vision(name)
        model = model.double()
        g = torch.randn(_zoo.IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        b, _, h, w = _zoo.IMAGE
        labels = torch.randint(0, 3, (b, h, w)) if kind == "seg" else torch.tensor([1] * b)
        xr = g.clone().requires_grad_()
        ref = model(pixel_values=xr, labels=labels)
        ref.loss.backward()
        want = _grads(model)
        model.zero_grad(set_to_none=True)

        x = g.clone().requires_grad_()
        if mesh_2d:  # H over mesh dim 0, W over mesh dim 1, both uneven
            places, sizes = [Shard(2), Shard(3)], [_zoo.uneven(h, 2), _zoo.uneven(w, 2)[::-1]]
        else:
            places, sizes = [Shard(2)], _zoo.uneven(h, mesh.size())
        gathers = "warn" if (name, mesh_2d) in GATHERING else "raise"
        with shardlab.patched(), shardlab.trace() as t, shardlab.gathers(gathers):
            out = model(pixel_values=distribute(x, mesh, places, sizes), labels=labels)
            out.loss.backward()
        got = _grads(model)
        logits = out.logits.full_tensor()
        return {
            "logits": torch.allclose(logits, ref.logits, rtol=1e-10, atol=1e-12),
            "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=1e-10, atol=1e-12),
            "input grad": torch.allclose(x.grad, xr.grad, rtol=1e-10, atol=atol),
            "params": _bad_params(want, got, rtol=1e-9, atol=atol),
            "fallbacks": sorted({e.label for e in t.events if "whole-tensor" in e.label}),
        }

    return body


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("name", _zoo.VISION)
def test_vision_models_sharded_along_h_equal_one_device(ranks_for, name, world):
    for res in ranks_for(world).run(_vision_body(name)):
        assert res["logits"] and res["loss"] and res["input grad"], res
        assert res["params"] == [], res
        # whole-tensor fallbacks would be exact too, but these models need none
        assert res["fallbacks"] == [], res


@pytest.mark.parametrize("name", _zoo.VISION)
def test_vision_models_on_a_2d_mesh_cutting_h_and_w(ranks_for, name):
    """The same models on a 2 x 2 mesh, H and W both cut unevenly: the flattened patch
    tokens are then cut by both mesh dims (one ring over both for attention; windows and
    pooling read them cut by one, gathered along the other: labelled moves)."""
    for res in ranks_for(4).run(_vision_body(name, mesh_2d=True)):
        assert res["logits"] and res["loss"] and res["input grad"], res
        assert res["params"] == [] and res["fallbacks"] == [], res


def _decoder_body(name: str):
    def body():
        import torch.nn.functional as F

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        model = _zoo.decoder(name).double()
        ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
        ref = model(input_ids=ids, labels=ids)
        ref.loss.backward()
        want = _grads(model)
        model.zero_grad(set_to_none=True)

        sizes = _zoo.uneven(_zoo.TOKENS[1], mesh.size())
        with shardlab.patched():
            sid = distribute(ids, mesh, [Shard(1)], sizes)
            out = model(input_ids=sid, labels=sid)  # the label shift crosses shards
            out.loss.backward()
            # the same loss in float64, from the sharded logits: exact
            lg = out.logits.detach()
            exact = F.cross_entropy(lg[:, :-1].flatten(0, 1), sid[:, 1:].flatten()).full_tensor()
        ref64 = F.cross_entropy(ref.logits[:, :-1].flatten(0, 1).detach(), ids[:, 1:].flatten())
        got = _grads(model)
        return {
            "logits": torch.allclose(out.logits.full_tensor(), ref.logits, rtol=1e-10, atol=1e-12),
            "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=1e-6),
            "float64 loss": torch.allclose(exact, ref64, rtol=1e-12),
            "params": _bad_params(want, got, rtol=1e-5, atol=1e-7),
            "sequence": out.logits.sharding.placements == (Shard(1),),
        }

    return body


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("name", _zoo.DECODERS)
def test_decoders_sharded_along_the_sequence_with_labels(ranks_for, name, world):
    for res in ranks_for(world).run(_decoder_body(name)):
        assert res["logits"] and res["loss"] and res["float64 loss"], res
        assert res["params"] == [] and res["sequence"], res


def _lm_step_equals_one_device(model, logits_tol, loss_rtol, params_tol):
    """One step of a causal LM (its own loss) with ids and labels cut along the sequence,
    against the same step on one device."""
    import shardlab
    from shardlab import distribute, this_rank

    mesh = this_rank().mesh
    ids = torch.randint(0, _zoo.VOCAB, _zoo.TOKENS, generator=torch.Generator().manual_seed(3))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with shardlab.patched():
        sid = distribute(ids, mesh, [Shard(1)], _zoo.uneven(_zoo.TOKENS[1], mesh.size()))
        out = model(input_ids=sid, labels=sid)
        out.loss.backward()
    got = _grads(model)
    rtol, atol = logits_tol
    return {
        "logits": torch.allclose(out.logits.full_tensor(), ref.logits, rtol=rtol, atol=atol),
        "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=loss_rtol),
        "params": _bad_params(want, got, rtol=params_tol[0], atol=params_tol[1]),
        "sequence": out.logits.sharding.placements == (Shard(1),),
    }


def _moe_body():
    return _lm_step_equals_one_device(_zoo.moe(), (1e-5, 1e-6), 1e-5, (1e-4, 1e-6))


def test_mixture_of_experts_decoder_float32(ranks_for):
    """Mixtral (top-2 of 4 experts) with its sequence cut: float32 (its experts' grouped
    matmul takes no float64 on CPU), logits, loss and every gradient against one device.
    The routing (a sort over every token) moves whole tensors: exact, not lean."""
    for res in ranks_for(3).run(_moe_body):
        assert res["logits"] and res["loss"] and res["params"] == [], res


def _seq2seq_body(name: str):
    def body():
        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        model = _zoo.seq2seq(name).double()
        gen = torch.Generator().manual_seed(4)
        ids = torch.randint(1, _zoo.VOCAB, _zoo.TOKENS, generator=gen)
        labels = torch.randint(1, _zoo.VOCAB, (2, 9), generator=gen)
        ref = model(input_ids=ids, labels=labels)
        ref.loss.backward()
        want = _grads(model)
        model.zero_grad(set_to_none=True)
        with shardlab.patched():
            sid = distribute(ids, mesh, [Shard(1)], _zoo.uneven(_zoo.TOKENS[1], mesh.size()))
            slab = distribute(labels, mesh, [Shard(1)], _zoo.uneven(9, mesh.size()))
            out = model(input_ids=sid, labels=slab)
            out.loss.backward()
        got = _grads(model)
        return {
            "logits": torch.allclose(out.logits.full_tensor(), ref.logits, rtol=1e-10, atol=1e-12),
            "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=1e-6),
            "params": _bad_params(want, got, rtol=1e-5, atol=1e-7),
        }

    return body


@pytest.mark.parametrize("name", _zoo.SEQ2SEQ)
def test_encoder_decoders_with_both_sequences_cut(ranks_for, name):
    """T5 and BART with the source and the target cut unevenly over 3 ranks: the decoder's
    queries meet the encoder's cut keys (cross-attention gathers them), T5's learned
    relative position bias gets its gradient; float64 against one device."""
    for res in ranks_for(3).run(_seq2seq_body(name)):
        assert res["logits"] and res["loss"] and res["params"] == [], res


@pytest.mark.parametrize("name", _zoo.CONV_NETS)
def test_more_conv_nets_sharded_along_h_equal_one_device(ranks_for, name):
    """MobileNetV2 (depthwise convs, stride 2 on uneven blocks) and EfficientNet
    (squeeze-excite: a global mean over the cut image), 3 ranks, float64. Their gradients
    reach ~70 through 17 batch norms, which magnify float64 rounding (sums over the cut
    image add in another order): 1e-10 absolute, still ~1e-12 of their scale."""
    for res in ranks_for(3).run(_vision_body(name, atol=1e-10)):
        assert res["logits"] and res["loss"] and res["input grad"], res
        assert res["params"] == [] and res["fallbacks"] == [], res


def _eager_attention_body():
    # the model takes its softmax in float32 (transformers' eager attention): a sum over
    # cut keys adds in another order, so float32 tolerance on a float64 model
    model = _zoo.eager_attention().double()
    return _lm_step_equals_one_device(model, (1e-6, 1e-6), 1e-6, (1e-4, 1e-6))


def test_decoder_with_eager_attention_capped_scores_and_a_sliding_window(ranks_for):
    """Gemma 2 running transformers' own attention code (matmul, tanh cap, sliding-window
    mask, softmax; no SDPA) with the sequence cut over 3 ranks, against one device."""
    for res in ranks_for(3).run(_eager_attention_body):
        assert res["logits"] and res["loss"] and res["params"] == [], res
        assert res["sequence"], res


def _audio_body():
    import shardlab
    from shardlab import distribute, this_rank

    mesh = this_rank().mesh
    model = _zoo.audio().double()
    wave = torch.randn(
        _zoo.WAVEFORM, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    labels = torch.tensor([1, 2])
    ref = model(input_values=wave, labels=labels)
    ref.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    sizes = _zoo.uneven(_zoo.WAVEFORM[1], mesh.size())
    with shardlab.patched(), shardlab.trace() as t:
        out = model(input_values=distribute(wave, mesh, [Shard(1)], sizes), labels=labels)
        out.loss.backward()
    got = _grads(model)
    return {
        "logits": torch.allclose(out.logits.full_tensor(), ref.logits, rtol=1e-10, atol=1e-12),
        "loss": torch.allclose(out.loss.full_tensor(), ref.loss, rtol=1e-10, atol=1e-12),
        "params": _bad_params(want, got, rtol=1e-9, atol=1e-12),
        "fallbacks": sorted({e.label for e in t.events if "whole-tensor" in e.label}),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_speech_model_on_a_cut_waveform_equals_one_device(ranks_for, world):
    """wav2vec2 on raw audio cut unevenly along time (its feature extractor's wave gets
    ``requires_grad`` set inside the model), float64 against one device."""
    for res in ranks_for(world).run(_audio_body):
        assert res["logits"] and res["loss"] and res["params"] == [], res
        assert res["fallbacks"] == [], res
