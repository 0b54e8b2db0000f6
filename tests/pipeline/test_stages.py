"""``shardlab.pipeline.step`` on the session's ranks: one device's loss and gradients, and
every (rank, stage, micro-batch, kind) recorded once; the cuts; the figure and explorer."""

from __future__ import annotations

import pytest

from shardlab.pipeline import (
    explorer,
    layer_ranges,
    plot,
    replay,
    stage_indices,
)

transformers = pytest.importorskip("transformers")


def test_layer_ranges_and_stage_indices():
    assert layer_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_indices(1, 4, 2) == [1, 5]
    assert stage_indices(1, 4, 2, "v") == [1, 6]
    with pytest.raises(ValueError):
        stage_indices(0, 4, 3, "v")


def _llama(layers=4):
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).double()


def _body(schedule, m):
    import torch

    from shardlab import pipeline

    ids = torch.randint(0, 32, (m, 8), generator=torch.Generator().manual_seed(1))
    ref = _llama()
    want = pipeline.lm_loss(ref(input_ids=ids).logits, ids)
    want.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    model = _llama()
    out = pipeline.step(model, ids, ids, schedule=schedule, microbatches=m)
    err = {n: float((p.grad - grads[n]).abs().max()) for n, p in model.named_parameters()
           if p.grad is not None}  # fmt: skip
    return out, err, want.item()


@pytest.mark.parametrize("schedule, kinds", [("1F1B", "FB"), ("ZeroBubble", "FIW")])
def test_step_is_one_device_and_records_every_action_once(ranks_for, schedule, kinds):
    m = 4
    res = ranks_for(2).run(_body, schedule, m)
    owned = [set(err) for _, err, _ in res]
    assert sum(map(len, owned)) == len(set().union(*owned)) == len(list(_llama().parameters()))
    assert max(max(err.values()) for _, err, _ in res) < 1e-12
    losses = [(out.loss, want) for out, _, want in res if out.loss is not None]
    assert len(losses) == 1 and losses[0][0] == pytest.approx(losses[0][1], abs=1e-12)
    actions = [a for out, *_ in res for a in out.actions]
    stages = {(out.stages[0], s) for out, *_ in res for s in out.stages}
    keys = [(a.rank, a.stage, a.microbatch, a.kind) for a in actions]
    assert len(keys) == len(set(keys))
    want_keys = {(r, s, i, k) for r, s in stages for i in range(m) for k in kinds}
    assert set(keys) == want_keys
    events = [e for out, *_ in res for e in out.events]
    assert {"send", "recv"} <= {e.kind for e in events}  # (2.15 adds an all-reduce)
    ideal = replay(actions, events)
    fig = plot(ideal, title=schedule)
    assert len(fig.shardlab_boxes) == len(actions)
    assert all(a.duration == pytest.approx(a.cpu) for a in ideal)


@pytest.mark.parametrize("schedule, m", [("1F1B", 6), ("GPipe", 3)])
def test_step_is_one_device_for_m_not_a_power_of_two(ranks_for, schedule, m):
    # transformers' RMSNorm rounds the gradient through it to float32: the 1/m must be in
    # the loss before backward, as on one device, not divided out of the gradients after
    # (torch's default), or the gradients differ by ~1e-7 relative unless m is 2**k
    res = ranks_for(2).run(_body, schedule, m)
    assert max(max(err.values()) for _, err, _ in res) < 1e-12
    losses = [(out.loss, want) for out, _, want in res if out.loss is not None]
    assert len(losses) == 1 and losses[0][0] == pytest.approx(losses[0][1], abs=1e-12)


def test_explorer_runs_each_choice_once():
    pytest.importorskip("ipywidgets")
    from tests.pipeline.test_timeline import gpipe, messages

    calls = []

    def run(schedule, m):
        calls.append((schedule, m))
        acts = gpipe(4, m)
        return acts, messages(acts)

    ex = explorer(run, schedule="GPipe", microbatches=8, static=False)
    assert ex.bubbles[("GPipe", 8)] == pytest.approx(3 / 11)
    ex.controls["microbatches"].value = 12
    ex.controls["microbatches"].value = 8  # cached: not run again
    assert calls == [("GPipe", 8), ("GPipe", 12)]
    assert ex.bubbles[("GPipe", 12)] == pytest.approx(3 / 15)
    html = ex._repr_mimebundle_()["text/html"]
    assert "shardlab-explorer" in html and "data:image/png;base64," in html
