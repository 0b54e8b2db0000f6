"""Figures of expert parallelism: the router's choices, the load per expert and the token
flow between ranks (:class:`shardlab.ExpertParallel`), and an explorer of an unbalanced
router.

* :func:`plot_routing`      each token's top-k experts, tokens and experts by rank
* :func:`plot_expert_load`  the (token, expert) pairs each expert gets, by source rank
* :func:`token_flow`        the bytes each rank hands each rank in a trace's all-to-alls
* :func:`plot_token_flow`   that rank x rank matrix
* :func:`simulate_routing`  a router's top-k choices, biased towards expert 0
* :func:`expert_explorer`   the load and the flow of :func:`simulate_routing`, live

Experts are numbered in rank order, E/p per rank (expert e lives on rank ``e // (E/p)``),
as :class:`shardlab.ExpertParallel` spreads them. Tokens come in rank order too, ``sizes``
of them per rank.
"""

from __future__ import annotations

from shardlab.trace import Trace

from ._common import human_bytes, new_figure, rank_colour
from .explorers import _Explorer, _make

__all__ = [
    "ExpertExplorer",
    "expert_explorer",
    "expert_load",
    "plot_expert_load",
    "plot_routing",
    "plot_token_flow",
    "simulate_routing",
    "token_flow",
]


def _rows(index) -> list[list[int]]:
    """``index`` (T, k) as lists of ints (a tensor, an array or nested lists)."""
    rows = index.tolist() if hasattr(index, "tolist") else [list(r) for r in index]
    return [[int(e) for e in (r if isinstance(r, list) else [r])] for r in rows]


def _owners(sizes, tokens: int) -> list[int]:
    """The rank of each of ``tokens`` tokens, ``sizes`` per rank (None: one rank)."""
    sizes = [tokens] if sizes is None else [int(n) for n in sizes]
    if sum(sizes) != tokens:
        raise ValueError(f"sizes {sizes} sum to {sum(sizes)}, not the {tokens} tokens routed")
    return [r for r, n in enumerate(sizes) for _ in range(n)]


def _check_experts(experts: int, ranks: int) -> int:
    if ranks < 1 or experts < 1 or experts % ranks:
        raise ValueError(
            f"{experts} experts on {ranks} ranks: the number of experts must be a positive "
            "multiple of the number of ranks (E/p experts on each)"
        )
    return experts // ranks


def expert_load(index, experts: int, sizes=None) -> list[list[int]]:
    """``load[r][e]``: how many of rank r's (token, expert) pairs chose expert e, for the
    top-k choices ``index`` (T, k) of tokens in rank order, ``sizes`` per rank.

    Example::

        viz.expert_load([[0, 1], [0, 2], [3, 0]], 4, sizes=[2, 1])   # [[2, 1, 1, 0], [1, 0, 0, 1]]
    """
    rows = _rows(index)
    owners = _owners(sizes, len(rows))
    load = [[0] * experts for _ in range(max(owners, default=0) + 1)]
    for r, chosen in zip(owners, rows):
        for e in chosen:
            if not 0 <= e < experts:
                raise ValueError(f"expert {e} out of range for {experts} experts")
            load[r][e] += 1
    return load


def simulate_routing(tokens: int, experts: int, k: int, bias: float = 0.0, seed: int = 0):
    """A router's top-k choices for ``tokens`` tokens: logits drawn from N(0, 1), expert 0's
    raised by ``bias`` (0: balanced on average; 3: most tokens pick expert 0). Returns a
    (tokens, k) int64 tensor, best first, as transformers' routers give it.

    Example::

        index = viz.simulate_routing(64, 8, 2, bias=2.0)
    """
    import torch

    if not 1 <= k <= experts:
        raise ValueError(f"top_k must be between 1 and the {experts} experts, got {k}")
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    logits[:, 0] += bias
    return logits.topk(k, dim=-1).indices


def token_flow(trace: Trace, label: str = "experts.dispatch forward", layer: int | None = None):
    """``flow[r][s]``: the bytes rank r handed rank s in the ``all_to_all`` events of
    ``trace`` whose label starts with ``label`` (their :attr:`~shardlab.trace.Event.splits`;
    the diagonal stays on its rank). ``layer``: only each rank's ``layer``-th such event
    (the MoE layers in call order), None: their sum.

    Example::

        flow = viz.token_flow(trace, layer=0)    # the first MoE layer's dispatch
    """
    seen: dict[int, int] = {}
    picked = []
    for e in sorted(trace.events, key=lambda e: (e.rank, e.seq)):
        if e.kind != "all_to_all" or not e.label.startswith(label) or e.splits is None:
            continue
        nth = seen[e.rank] = seen.get(e.rank, -1) + 1
        if layer is None or nth == layer:
            picked.append(e)
    if not picked:
        raise ValueError(f"no all_to_all labelled {label!r} with splits in the trace")
    ranks = 1 + max(max(e.rank, *e.group) for e in picked)
    flow = [[0] * ranks for _ in range(ranks)]
    for e in picked:
        for to, n in zip(e.group, e.splits):
            flow[e.rank][to] += n
    return flow


def plot_routing(index, experts: int, sizes=None, ranks: int | None = None, ax=None):
    """Each token's top-k experts: tokens across (coloured by their rank), experts down
    (grouped by the rank that holds them), one mark per choice (filled: the first).
    ``ranks``: how many ranks hold the experts (default: ``len(sizes)``).
    ``fig.shardlab_load`` is :func:`expert_load`'s matrix."""
    rows = _rows(index)
    owners = _owners(sizes, len(rows))
    ranks = ranks or (len(sizes) if sizes is not None else 1)
    per = _check_experts(experts, ranks)
    fig, ax = new_figure((min(9.5, 2.0 + 0.09 * len(rows)), 1.2 + 0.28 * experts), ax)
    for t, (r, chosen) in enumerate(zip(owners, rows)):
        for j, e in enumerate(chosen):
            ax.scatter(t, e, s=22, marker="s", color=rank_colour(r),
                       alpha=1.0 if j == 0 else 0.45, linewidths=0)  # fmt: skip
    for r in range(1, ranks):  # the experts each rank holds
        ax.axhline(r * per - 0.5, color="#555555", lw=0.8)
    start = 0
    for r, n in enumerate([owners.count(r) for r in range(max(owners, default=0) + 1)]):
        if n:
            ax.text(start + (n - 1) / 2, -0.9, f"rank {r}'s tokens", ha="center", fontsize=8,
                    color=rank_colour(r))  # fmt: skip
        start += n
    ax.set_yticks(range(experts), [f"E{e} (r{e // per})" for e in range(experts)], fontsize=8)
    ax.set_ylim(experts - 0.5, -1.4)
    ax.set_xlim(-1, len(rows))
    ax.set_xlabel("token (filled: its first choice; faded: the others)")
    ax.set_title("the router's choices: token -> its top-k experts", fontsize=10)
    fig.shardlab_load = expert_load(rows, experts, sizes)
    return fig


def plot_expert_load(load, ranks: int | None = None, ax=None, title: str | None = None):
    """Bars: the pairs each expert gets (``load[r][e]`` from :func:`expert_load`), stacked
    by the rank they come from; the background: which rank holds each expert (``ranks``
    of them, default ``len(load)``); dashed: the even share. ``fig.shardlab_received``:
    the pairs each rank's experts receive."""
    experts = len(load[0]) if load else 0
    ranks = ranks or len(load)
    per = _check_experts(experts, ranks)
    fig, ax = new_figure((6.4, 2.8), ax)
    bottom = [0] * experts
    for r, row in enumerate(load):
        ax.bar(range(experts), row, bottom=bottom, color=rank_colour(r), width=0.7,
               label=f"from rank {r}")  # fmt: skip
        bottom = [b + n for b, n in zip(bottom, row)]
    for r in range(ranks):  # the experts rank r holds
        ax.axvspan(r * per - 0.5, (r + 1) * per - 0.5, color=rank_colour(r), alpha=0.08, lw=0)
    even = sum(bottom) / max(experts, 1)
    ax.axhline(even, color="k", ls="--", lw=0.8)
    ax.set_xticks(range(experts), [f"E{e}\nr{e // per}" for e in range(experts)], fontsize=8)
    ax.set_ylabel("(token, expert) pairs")
    ax.legend(fontsize=7, loc="upper right", ncols=2 if len(load) > 4 else 1)
    ax.set_title(title or "load per expert (background: the rank that holds it)", fontsize=10)
    fig.shardlab_received = [sum(bottom[r * per : (r + 1) * per]) for r in range(ranks)]
    return fig


def plot_token_flow(flow, ax=None, row_bytes: int | None = None, title: str | None = None):
    """The rank x rank matrix of :func:`token_flow` (or a Trace, whose dispatch it sums):
    row r, column s = what rank r hands rank s (tokens if ``row_bytes``, the bytes of one
    token row, is given; else bytes). The diagonal stays on its rank; row sums: what each
    rank sends, column sums: what each receives (on the margins)."""
    if isinstance(flow, Trace):
        flow = token_flow(flow)
    n = len(flow)
    cells = [[v // row_bytes if row_bytes else v for v in row] for row in flow]
    fig, ax = new_figure((1.6 + 0.9 * n, 1.3 + 0.8 * n), ax)
    ax.imshow(cells, cmap="Blues", vmin=0)
    top = max((v for row in cells for v in row), default=0)

    def text(v):
        return str(v) if row_bytes else human_bytes(v)

    for r in range(n):
        for s in range(n):
            v = cells[r][s]
            ax.text(s, r, text(v), ha="center", va="center", fontsize=8,
                    color="white" if top and v > 0.6 * top else "black",
                    style="italic" if r == s else "normal")  # fmt: skip
        ax.text(n - 0.3, r, "= " + text(sum(cells[r])), va="center", fontsize=8)
    for s in range(n):
        ax.text(s, n - 0.3, text(sum(row[s] for row in cells)), ha="center", va="top", fontsize=8)
    ax.set_xticks(range(n), [f"to {s}" for s in range(n)], fontsize=8)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    ax.set_xlim(-0.5, n + 0.4)
    ax.set_ylim(n + 0.1, -0.5)
    what = "tokens" if row_bytes else "bytes"
    ax.set_title(title or f"token flow: {what} each rank hands each (diagonal: kept)", fontsize=10)
    fig.shardlab_flow = cells
    return fig


def expert_explorer(*, static: bool | None = None, **initial):
    """Live load per expert and token flow of a router biased towards expert 0
    (:func:`simulate_routing`), with experts, top_k, ranks, tokens (per rank), bias and
    row_bytes controls (:class:`ExpertExplorer`); ``static`` as in
    :func:`shardlab.viz.halo_explorer`.

    Example::

        viz.expert_explorer(experts=8, top_k=2, ranks=4, bias=2.0)
    """
    return _make(ExpertExplorer, static, initial)


class ExpertExplorer(_Explorer):
    """Controls: experts (E), top_k, ranks (p; E must be a multiple), tokens (per rank), bias
    (added to expert 0's router logit: 0 balanced, 3 most tokens pick it), row_bytes (one
    token row: hidden x itemsize). ``figure``: the load and the flow; ``received`` ``{rank:
    pairs its experts get}``, ``sent`` ``{rank: bytes it hands other ranks}``.

    Example::

        ex = viz.ExpertExplorer(bias=0.0)
        ex.controls["bias"].value = 3.0      # redraws: rank 0's experts get most pairs
        ex.received
    """

    DEFAULTS = dict(experts=8, top_k=2, ranks=4, tokens=64, bias=0.0, row_bytes=8192)

    def _controls(self, w, v):
        def slider(name, lo, hi):
            return w.IntSlider(value=v[name], min=lo, max=max(hi, v[name]), description=name)

        return {  # the router's bias first: what the explorer is about
            "bias": w.FloatSlider(value=v["bias"], min=0.0, max=max(6.0, v["bias"]), step=0.25,
                                  description="bias"),
            "experts": slider("experts", 1, 32),
            "top_k": slider("top_k", 1, 8),
            "ranks": slider("ranks", 1, 8),
            "tokens": slider("tokens", 1, 512),
            "row_bytes": w.IntText(value=v["row_bytes"], description="row bytes"),
        }  # fmt: skip

    @classmethod
    def _values_to_figure(cls, v):
        from ._common import make_figure

        experts, k, ranks = int(v["experts"]), int(v["top_k"]), int(v["ranks"])
        tokens, row = int(v["tokens"]), int(v["row_bytes"])
        per = _check_experts(experts, ranks)
        if row < 1:
            raise ValueError(f"row_bytes must be >= 1, got {row}")
        index = simulate_routing(tokens * ranks, experts, k, float(v["bias"]))
        load = expert_load(index, experts, [tokens] * ranks)
        flow = [[sum(load[r][s * per : (s + 1) * per]) * row for s in range(ranks)]
                for r in range(ranks)]  # fmt: skip
        fig = make_figure((9.5, 3.2))
        left, right = fig.subplots(1, 2, width_ratios=[1.5, 1])
        plot_expert_load(load, ranks, ax=left, title=f"load per expert, bias {v['bias']:g}")
        plot_token_flow(flow, ax=right, title="bytes each rank hands each")
        fig.shardlab_load, fig.shardlab_flow = load, flow
        fig.shardlab_received = left.figure.shardlab_received
        return fig

    @property
    def received(self) -> dict[int, int]:
        """``{rank: (token, expert) pairs its experts get}`` for the current figure."""
        return {} if self.figure is None else dict(enumerate(self.figure.shardlab_received))

    @property
    def sent(self) -> dict[int, int]:
        """``{rank: bytes it hands the other ranks}`` (its own experts' rows excluded)."""
        if self.figure is None:
            return {}
        flow = self.figure.shardlab_flow
        return {r: sum(row) - row[r] for r, row in enumerate(flow)}

    def _table(self, fig) -> str:
        got = fig.shardlab_received
        mean = sum(got) / len(got)
        rows = "".join(
            f"<tr><td>rank {r}</td><td>{n}</td><td>{n / mean:.2f}x</td>"
            f"<td>{human_bytes(self.sent[r])}</td></tr>"
            for r, n in enumerate(got)
        )
        return (
            "<table><tr><th>rank</th><th>pairs its experts compute</th><th>vs mean</th>"
            f"<th>bytes sent to others</th></tr>{rows}</table>"
        )
