"""``shardlab.demo``: each demo's ``run`` on the session's 2 ranks (quick sizes), with the
bytes expected from the shapes alone; one real ``torchrun`` of the conv demo."""

import subprocess
import sys

import pytest
import torch

import shardlab
from shardlab.demo import attention, conv, loss
from shardlab.demo.__main__ import parse_args

WORLD = 2
F32 = 4  # bytes per float32


def _run(ranks_for, module, name, tmp_path):
    per_rank = ranks_for(WORLD).run(
        module.run, parse_args([name, "--quick", "--out", str(tmp_path)])
    )
    rows = per_rank[0]
    assert all(r == rows for r in per_rank)  # every rank returns the same rows
    for r in rows:
        assert {key for key, _, _ in module.COLUMNS} <= set(r)
        assert r["ok"] and 0 <= r["max_rel_err"] <= 1e-3
        assert r["ranks"] == WORLD and r["ms"] > 0 and r["single_ms"] > 0
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    return rows


def _neighbours(r):
    return (r > 0) + (r < WORLD - 1)


def test_conv(ranks_for, tmp_path):
    rows = _run(ranks_for, conv, "conv", tmp_path)
    assert [r["image"] for r in rows] == list(conv.QUICK)
    c, layers = conv.CHANNELS, conv.LAYERS
    for r in rows:
        h = w = r["image"]
        assert r["rows_per_rank"] == [h // WORLD] * WORLD
        row = w * c * F32  # one image row: W pixels x C channels, float32
        # forward: each 3x3 conv reads 1 row from each neighbour; backward: each conv but
        # the first (the image needs no gradient) gets those rows' gradients back
        want = [_neighbours(k) * row * (2 * layers - 1) for k in range(WORLD)]
        assert r["halo_bytes_per_rank"] == want
        # weight (C, C, 3, 3) and bias (C,) gradients of every conv summed over the ranks:
        # a ring all-reduce delivers 2 (N-1)/N x the payload to each rank
        grads = layers * (c * c * 9 + c) * F32
        assert r["reduce_bytes"] == pytest.approx(2 * (WORLD - 1) / WORLD * grads)


def test_conv_compares_numbers_of_ranks(ranks_for, tmp_path):
    """On 3 ranks the table has rows for 2 ranks (the first two; the third waits) and 3."""
    assert conv.rank_counts(1) == [1] and conv.rank_counts(3) == [2, 3]
    assert conv.rank_counts(8) == [2, 4, 8] and conv.rank_counts(6) == [2, 4, 6]
    args = parse_args(["conv", "--quick", "--sizes", "16", "--out", str(tmp_path)])
    per_rank = ranks_for(3).run(conv.run, args)
    rows = per_rank[0]
    assert all(r == rows for r in per_rank) and [r["ranks"] for r in rows] == [2, 3]
    row = 16 * conv.CHANNELS * F32  # one image row
    for r in rows:
        k = r["ranks"]
        assert r["ok"] and r["rows_per_rank"] == [len(c) for c in torch.arange(16).chunk(k)]
        edges = [(i > 0) + (i < k - 1) for i in range(k)]  # neighbours of each rank
        assert r["halo_bytes_per_rank"] == [e * row * (2 * conv.LAYERS - 1) for e in edges]


def test_attention(ranks_for, tmp_path):
    rows = _run(ranks_for, attention, "attention", tmp_path)
    seqs = list(attention.QUICK)
    assert [(r["seq"], r["causal"]) for r in rows] == [(s, c) for c in (False, True) for s in seqs]
    for r in rows:
        # one K (or V) block: (B, H, S/N, D) float32
        block = attention.BATCH * attention.HEADS * r["seq"] // WORLD * attention.DIM * F32
        fwd = (WORLD - 1) * 2 * block  # the K and V blocks of every other rank, once
        assert r["recv_fwd"] == fwd
        assert r["recv_bwd"] == 2 * fwd  # K/V again + the dK/dV accumulators home
        assert r["recv_per_rank"] == [3 * fwd] * WORLD


def test_loss(ranks_for, tmp_path):
    rows = _run(ranks_for, loss, "loss", tmp_path)
    assert [r["vocab"] for r in rows] == list(loss.QUICK)
    t = loss.QUICK_TOKENS
    for r in rows:
        assert r["tokens"] == t and r["collectives_fwd"] == 2 and r["messages_bwd"] == 0
        # all-reduce of the row maxima (T,), then of (sum exp, target logit) (2, T):
        # 3 T float32, whatever V; a ring all-reduce delivers 2 (N-1)/N x the payload
        want = 2 * (WORLD - 1) / WORLD * 3 * t * F32
        assert r["recv_per_rank"] == pytest.approx([want] * WORLD)
        assert r["logits_mib"] == pytest.approx(t * r["vocab"] / WORLD * F32 / 2**20)
        assert r["single_logits_mib"] == pytest.approx(t * r["vocab"] * F32 / 2**20)


def _skip_the_halos(args):
    """The conv demo with a wrong sharded step: each rank convolves its own rows alone
    (no halo exchange; zero padding at the cut). The check must stop every rank."""
    from shardlab import ShardTensor
    from shardlab.demo import conv as demo

    right = demo._step

    def wrong(net, x):
        if not isinstance(x, ShardTensor):
            return right(net, x)
        net.zero_grad(set_to_none=True)
        y = net(x.to_local())  # plain torch on (1, C, H/N, W): wrong rows at the cut
        y.square().sum().backward()
        return ShardTensor.from_local(y.detach(), x.device_mesh, x.placements)

    demo._step = wrong
    try:
        return demo.run(args)
    finally:
        demo._step = right


def test_a_wrong_result_stops_every_rank(ranks_for, tmp_path):
    args = parse_args(["conv", "--quick", "--sizes", "16", "--out", str(tmp_path)])
    with pytest.raises(shardlab.RankError) as exc:
        ranks_for(WORLD).run(_skip_the_halos, args)
    failures = exc.value.failures  # rank -> (exception type, message)
    assert {r: kind for r, (kind, _) in failures.items()} == dict.fromkeys(
        range(WORLD), "AssertionError"
    )
    assert "differs from single device" in str(exc.value)
    assert not (tmp_path / "conv.png").exists()


def test_unknown_demo_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(n in err for n in ("conv", "attention", "loss"))


def test_conv_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc-per-node", str(WORLD), "-m", "shardlab.demo", "conv", "--quick"]
    cmd += ["--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("| image H=W | ranks |")]
    assert len(head) == 1, out.stdout  # printed by rank 0 only
    body = lines[head[0] + 2 : head[0] + 2 + len(conv.QUICK)]
    assert [int(line.split("|")[1]) for line in body] == list(conv.QUICK)
    assert all(int(line.split("|")[2]) == WORLD for line in body)
    assert (tmp_path / "conv.png").stat().st_size > 1000


def test_lm(ranks_for, tmp_path):
    """The decoder trains sequence-sharded on 2 ranks (and ring x TP on a (2, 2) mesh
    with 4) with the loss curve of one device; the ring moves fewer bytes per step than
    gathering K and V when the sequence is long enough to matter."""
    from shardlab.demo import lm

    for world in (2, 4):
        args = parse_args(["lm", "--quick", "--out", str(tmp_path)])
        per_rank = ranks_for(world).run(lm.run, args)
        rows = per_rank[0]
        assert all(r == rows for r in per_rank)
        names = [r["config"] for r in rows]
        want = ["1 device", f"ring, {world} ranks", f"all-gather K/V, {world} ranks"]
        assert names == want + (["ring x TP, mesh (2, 2)"] if world == 4 else []), names
        for r in rows:
            assert r["ok"] and r["max_rel_err"] <= 1e-5 and r["tokens_s"] > 0
            assert len(r["losses"]) == 2 and r["peak_mib"] > 0
        assert rows[0]["recv_mib"] == 0 and all(r["recv_mib"] > 0 for r in rows[1:])
        assert (tmp_path / "lm.png").stat().st_size > 1000
