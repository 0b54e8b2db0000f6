"""The kernels of ring-attention blocks, on CPU: the choice (a pure function), the CUDA
kernels' contracts (their meta implementations: shapes, the padded logsumexp), and the
whole ring through them (an emulation that keeps each CUDA op's contract) against
single-device SDPA, forward and backward."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardlab.ops import _ring_kernels as kernels

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
H100, T4 = (9, 0), (7, 5)


@pytest.mark.parametrize(
    "args, kw, expected",
    [
        (("cpu", f64, 16, 16), {}, "cpu-flash"),
        (("cpu", bf16, 3, 3), {}, "cpu-flash"),  # the CPU kernel takes any head dim
        (("cpu", f32, 16, 8), {}, "explicit"),  # D != D_v: the CPU kernel needs them equal
        (("cuda", bf16, 128, 128), {"capability": H100}, "flash"),
        (("cuda", f16, 64, 64), {"capability": H100}, "flash"),
        (("cuda", bf16, 128, 128), {"capability": T4}, "efficient"),  # no flash before sm80
        (("cuda", bf16, 128, 64), {"capability": H100}, "efficient"),  # flash: D == D_v
        (("cuda", bf16, 512, 512), {"capability": H100}, "efficient"),  # flash: D <= 256
        (("cuda", f32, 128, 128), {"capability": H100}, "efficient"),  # flash: half only
        (("cuda", f64, 128, 128), {"capability": H100}, "explicit"),  # no fused float64
        (("cuda", bf16, 100, 100), {"capability": H100}, "explicit"),  # D % 8
        (("cuda", bf16, 128, 128), {"capability": H100, "flash": False}, "efficient"),
        (
            ("cuda", bf16, 128, 128),
            {"capability": H100, "flash": False, "efficient": False},
            "explicit",
        ),  # fmt: skip
        (("cuda", f32, 128, 128), {"capability": H100, "efficient": False}, "explicit"),
        (("mps", f32, 64, 64), {}, "explicit"),
        (("cpu", f32, 0, 0), {}, "explicit"),
    ],
)
def test_choose(args, kw, expected):
    assert kernels.choose(*args, **kw) == expected


def test_choose_for_follows_torch_switches():
    """On this machine (CPU): what the tensors are; on CUDA it would read
    ``torch.backends.cuda.*_sdp_enabled()`` and the device's capability."""
    q = torch.zeros(1, 2, 4, 8)
    assert kernels.choose_for(q, q) == "cpu-flash"
    assert kernels.choose_for(q, torch.zeros(1, 2, 4, 3)) == "explicit"


@pytest.mark.parametrize("kind, dtype", [("flash", bf16), ("efficient", f32), ("efficient", bf16)])
@pytest.mark.parametrize("shape", [(2, 4, 37, 64), (4, 37, 64), (2, 3, 2, 37, 64), (37, 64)])
def test_cuda_kernel_contracts_on_meta(kind, dtype, shape):
    """torch's meta implementations of the CUDA ops: the wrappers give out (*, S_q, D_v)
    and logsumexp (*, S_q) in float32 (the memory-efficient kernel pads it to 64 rows
    here), and gradients shaped like q, k, v; any number of leading dims."""
    q = torch.empty(shape, dtype=dtype, device="meta")
    k = torch.empty((*shape[:-2], 21, shape[-1]), dtype=dtype, device="meta")
    rng: dict = {}
    o, lse = kernels.forward(kind, q, k, k, False, 0.125, rng)
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == f32
    assert kind in rng  # the random-number state, for backward
    g = kernels.backward(kind, o, q, k, k, o, lse, False, 0.125, rng)
    assert [x.shape for x in g] == [q.shape, k.shape, k.shape]


def test_padded_logsumexp():
    lse = torch.arange(6.0).reshape(1, 2, 3)
    padded = kernels._pad_rows(lse, 3)
    assert padded.shape == (1, 2, 32) and torch.equal(padded[..., :3], lse)
    assert kernels._pad_rows(torch.zeros(1, 1, 64), 40).shape == (1, 1, 64)


class _Emulated:
    """The CUDA ops as CPU functions that keep their contracts, so the ring's use of
    them runs here: inputs must be 4-D and contiguous; the memory-efficient kernel's
    logsumexp comes padded to a multiple of 32 rows with NaN after the real ones, and
    its backward wants it padded again; backward gets the random-number state objects
    forward returned. The numbers come from torch's CPU flash kernel."""

    def __init__(self):
        self.calls = {"flash": 0, "efficient": 0}
        self.states: list = []

    @staticmethod
    def _check(*xs):
        for x in xs:
            assert x.ndim == 4 and x.is_contiguous(), (x.shape, x.stride())

    def _state(self):
        st = (torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64))
        self.states.append(st)
        return st

    def _cpu(self, q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )

    def _scaled_dot_product_flash_attention(self, q, k, v, p, causal, debug, *, scale):
        self._check(q, k, v)
        self.calls["flash"] += 1
        o, lse = self._cpu(q, k, v, causal, scale)
        seed, offset = self._state()
        return o, lse, None, None, q.shape[-2], k.shape[-2], seed, offset, None

    def _scaled_dot_product_flash_attention_backward(
        self, d, q, k, v, o, lse, cq, ck, mq, mk, p, causal, seed, offset, *, scale
    ):
        self._check(d, q, k, v, o)
        assert lse.shape == q.shape[:-1] and (mq, mk) == (q.shape[-2], k.shape[-2])
        assert any(seed is s and offset is f for s, f in self.states)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d, q, k, v, o, lse, 0.0, causal, scale=scale
        )

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, lse_wanted, p, causal, *,
                                                scale):  # fmt: skip
        self._check(q, k, v)
        assert bias is None and lse_wanted
        self.calls["efficient"] += 1
        o, lse = self._cpu(q, k, v, causal, scale)
        rows = -(-q.shape[-2] // 32) * 32
        padded = lse.new_full((*lse.shape[:-1], rows), float("nan"))
        padded[..., : q.shape[-2]] = lse
        seed, offset = self._state()
        return o, padded, seed, offset

    def _scaled_dot_product_efficient_attention_backward(
        self, d, q, k, v, bias, o, lse, seed, offset, p, mask, causal, *, scale
    ):
        self._check(d, q, k, v, o)
        assert lse.shape[-1] == -(-q.shape[-2] // 32) * 32 and lse.is_contiguous()
        assert any(seed is s and offset is f for s, f in self.states)
        g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d, q, k, v, o, lse[..., : q.shape[-2]].contiguous(), 0.0, causal, scale=scale
        )
        return (*g, None)


def _ring_cases(kind, seed):
    def body():
        import shardlab
        from shardlab import distribute, this_rank
        from shardlab.ops import _ring_kernels, attention
        from shardlab.trace import trace

        mesh, n = this_rank().mesh, this_rank().world_size
        emulated = _Emulated()
        saved = _ring_kernels.aten, _ring_kernels.choose_for
        _ring_kernels.aten, _ring_kernels.choose_for = emulated, lambda q, v: kind
        rng, worst, labels = random.Random(seed), 0.0, set()
        try:
            for case in range(6):
                b, hk, rep = rng.randint(1, 2), rng.randint(1, 2), rng.choice([1, 2])
                s, d = rng.randint(n, 40), rng.choice([4, 8])
                causal, balanced = rng.random() < 0.7, rng.random() < 0.4 and s >= 2 * n
                gen = torch.Generator().manual_seed(case)
                q = torch.randn(b, hk * rep, s, d, generator=gen, dtype=f64, requires_grad=True)
                k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=f64, requires_grad=True)
                        for _ in range(2))  # fmt: skip
                kw = dict(is_causal=causal, enable_gqa=rep > 1)
                ref = F.scaled_dot_product_attention(q, k, v, **kw)
                w = torch.randn(ref.shape, generator=gen, dtype=f64)
                ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
                with shardlab.patched(), trace() as t:
                    if balanced:
                        with attention.head_tail():
                            qs, ks, vs = (attention.balance(x, mesh, [Shard(2)], dims=(2,))
                                          for x in (q, k, v))  # fmt: skip
                            y = F.scaled_dot_product_attention(qs, ks, vs, **kw)
                        y_full = attention.unbalance(y.full_tensor(), n, dims=(2,))
                    else:
                        cuts = sorted(rng.sample(range(s + 1), n - 1))
                        sizes = [b_ - a for a, b_ in zip([0, *cuts], [*cuts, s])]
                        qs, ks, vs = (distribute(x, mesh, [Shard(2)], [sizes]) for x in (q, k, v))
                        y_full = F.scaled_dot_product_attention(qs, ks, vs, **kw).full_tensor()
                    grads = torch.autograd.grad((y_full * w).sum(), (q, k, v))
                labels |= {e.label for e in t.events if e.label.startswith("sdpa.ring ")}
                worst = max(worst, (y_full - ref).abs().max().item())
                for g_, r_ in zip(grads, ref_grads):
                    worst = max(worst, (g_ - r_).abs().max().item())
        finally:
            _ring_kernels.aten, _ring_kernels.choose_for = saved
        return worst, emulated.calls[kind], sorted(labels)

    return body


@pytest.mark.parametrize("kind", ["flash", "efficient"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_through_cuda_kernels(ranks_for, world, kind):
    """Ring attention with its blocks in the (emulated) CUDA kernels equals torch's SDPA
    on one device, forward and backward (float64: 1e-12); contiguous and head-tail,
    uneven sizes (empty blocks too), GQA; the messages' labels name the kernel. On one
    rank the sequence is whole: torch's own kernel runs, not the ring's."""
    for worst, calls, labels in ranks_for(world).run(_ring_cases(kind, seed=world)):
        assert worst < 1e-12 and (calls > 0 if world > 1 else calls == 0), (worst, calls)
        if world > 1:
            assert any(f"[{kind}]" in lab for lab in labels), labels
            assert all(lab.endswith(("]",)) for lab in labels), labels


def _fake_ring(kind, dtype, n, me, causal, head_tail, rep, monkeypatch):
    """The whole ring on fake CUDA tensors (no GPU: torch's fake tensors run each op's meta
    implementation, the CUDA kernels' shape, dtype and device rules, and refuse a CPU tensor
    mixed into a CUDA op), messages left out: every step, piece and merge of rank ``me``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlab.ops import _ring
    from shardlab.ops.attention import head_tail_order

    monkeypatch.setattr(_ring, "_post", lambda plan, send, shapes, like, cause: (
        [like.new_empty(s) for s in shapes], []))  # fmt: skip
    s_total, hk = 8 * n, 2
    sizes = [8] * n
    starts = [8 * j for j in range(n)]
    order = head_tail_order(s_total, n) if head_tail else torch.arange(s_total)
    pos = [order[a : a + b] for a, b in zip(starts, sizes)]
    plan = _ring.RingPlan(
        peers=list(range(n)), me=me, group=None, kv_sizes=sizes, kv_starts=starts,
        q_pos=pos[me] if causal else None, kv_pos=pos if causal else None, mask=None,
        scale=0.125, rep=rep, kernel=kind,
    )  # fmt: skip
    # what each block runs in reads the true positions, CPU tensors with values: decided
    # here, as every rank does before it computes
    meta_q, meta_v = torch.empty(2, hk * rep, 8, 64, device="meta"), torch.empty(1, 1, 8, 64)
    hows = {j: plan.how(j, meta_q, meta_v) for j in range(n)}
    monkeypatch.setattr(plan, "how", lambda j, q, v: hows[j])
    with FakeTensorMode(allow_non_fake_inputs=True):  # the positions: CPU tensors
        dev = torch.device("cuda")
        q = torch.randn(2, hk * rep, 8, 64, dtype=dtype, device=dev)
        k, v = (torch.randn(2, hk, 8, 64, dtype=dtype, device=dev) for _ in range(2))
        rng: dict = {}  # (the autograd engine would want a real device: called directly)
        out, lse = _ring.ring_forward(q, k, v, plan, rng)
        *grads, _ = _ring.ring_backward(torch.randn_like(out), q, k, v, out, lse, plan, rng)
        return (out, *grads), (q, k, v), {h[0] for h in hows.values()}


@pytest.mark.parametrize(
    "kind, dtype",
    [("flash", bf16), ("flash", f16), ("efficient", f32), ("efficient", bf16),
     ("explicit", f64)],
)  # fmt: skip
@pytest.mark.parametrize("causal, head_tail", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rep", [1, 2])
def test_ring_on_fake_cuda_tensors(monkeypatch, kind, dtype, causal, head_tail, rep):
    """The ring's CUDA path, every rank position of a ring of 3 and a ring of 1: outputs and
    gradients on the device, in the inputs' dtypes and shapes, through the kernel chosen
    (torch's fake CUDA tensors: the fused ops' meta rules, no GPU needed; they need a torch
    built with CUDA, which the registry's torch for Linux is, not the CPU wheel)."""
    if not torch.backends.cuda.is_built():
        pytest.skip("this torch is built without CUDA (the CPU wheel): no fake CUDA tensors")
    for n, me in ((1, 0), (3, 0), (3, 1), (3, 2)):
        (out, *grads), (q, k, v), hows = _fake_ring(
            kind, dtype, n, me, causal, head_tail, rep, monkeypatch
        )
        assert out.device.type == "cuda" and out.dtype == dtype and out.shape == q.shape
        for g, x in zip(grads, (q, k, v)):
            assert g.device.type == "cuda" and g.dtype == dtype and g.shape == x.shape
        assert hows <= {kind, "skipped"} and kind in hows, hows
