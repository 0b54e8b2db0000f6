"""A recorded step projected onto a cluster described by its parameters.

A step traced on a few ranks (:func:`recorded_step`) is a list of :class:`Traffic` rows:
the messages of one rank, grouped by the parallel dim they run along (``"tensor"``,
``"sequence"``, ``"domain"``, ``"data"``), their kind, their bytes and a **scaling rule**
that says how they change with the degrees and the problem's size. :func:`project` puts
the step onto a :class:`Cluster` at other :class:`Degrees`: each row's bytes, count and
group size by its rule (:func:`scale`), its time by the formulas of
``shardlab/cost/formulas.py`` over the link its group spans (NVLink within a node,
InfiniBand across nodes: :func:`spans_nodes`), the compute by the GPU's throughput.

The rules (``t``, ``s``: tensor and sequence degrees; ``0``: recorded; a :class:`Growth`
scales a rank's tokens or pixels, the width, the depth and the bytes per element):

============ ============================== ==================== ===========================
rule         bytes of one message ×         messages ×           group
============ ============================== ==================== ===========================
halo         √tokens · width · dtype        layers               its neighbours (p2p)
ring         tokens · width · dtype · t0/t  layers · (s-1)/(s0-1) its neighbours (p2p)
activation   tokens · width · dtype         layers               tensor
gradients    width² · layers · dtype · t0/t 1                    domain · sequence · data
stats        width · dtype                  layers               its dim
fixed        1                              1                    its dim
input        (left out: at scale each GPU reads its own data)
============ ============================== ==================== ===========================

Weak scaling: a rank keeps its tile of the image or block of tokens whatever the domain,
sequence or data degree, so a halo (the tile's edge) stays the same size as the domain
degree grows, and so does a ring's K/V block, whose count grows with the ring. Tensor
parallelism cuts the weights (gradients, K/V heads and compute ``/ t``) but not the
activation a row-parallel layer all-reduces. Compute per rank: the recorded FLOPs ×
tokens · width² · layers · t0/t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from shardlab.cost.formulas import Link
from shardlab.cost.model import CostModel
from shardlab.cost.pairing import in_flight_together

__all__ = ["DIMS", "RULES", "Cluster", "Degrees", "Growth", "Projection", "Step", "Traffic"]
__all__ += ["count_flops", "project", "recorded_step", "rule_of", "scale", "spans_nodes"]

DIMS = ("tensor", "sequence", "domain", "data")  # innermost (neighbouring ranks) first
RULES = ("halo", "ring", "activation", "gradients", "stats", "fixed", "input")


@dataclass(frozen=True)
class Cluster:
    """A cluster by its parameters (bytes per second per GPU and direction, seconds, FLOP/s).

    The defaults describe a DGX H100 cluster; ``SOURCES`` gives each one's origin, and says
    which are assumptions (every figure drawn from a :class:`Projection` lists them)."""

    name: str = "H100 SXM, 8 per node, NDR InfiniBand"
    gpus_per_node: int = 8
    nvlink_bandwidth: float = 450e9
    nvlink_latency: float = 3.4e-6
    ib_bandwidth: float = 50e9
    ib_latency: float = 10e-6
    link_efficiency: float = 0.8
    flops: float = 989e12
    mfu: float = 0.4

    SOURCES = {
        "gpus_per_node": "DGX H100: 8 H100 SXM per node",
        "nvlink_bandwidth": "H100 SXM datasheet: NVLink 4, 900 GB/s per GPU both ways "
        "together; 450 GB/s each way",
        "nvlink_latency": "assumed: NCCL's tuning model puts an NVLink ring hop at ~3.4 µs",
        "ib_bandwidth": "ConnectX-7 NDR InfiniBand, 400 Gb/s per port, one port per GPU "
        "(DGX H100): 50 GB/s each way",
        "ib_latency": "assumed: 10 µs per message step between nodes",
        "link_efficiency": "assumed: collectives reach 80 % of the links' bandwidth",
        "flops": "H100 SXM datasheet: 989 TFLOP/s dense BF16",
        "mfu": "assumed: a step reaches 40 % of the peak FLOP/s",
    }
    ASSUMED = ("nvlink_latency", "ib_latency", "link_efficiency", "mfu")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (
                isinstance(v, (int, float)) and v > 0 and math.isfinite(v)
            ):
                raise ValueError(f"Cluster: {f.name} must be a finite number > 0, got {v!r}")
        if self.link_efficiency > 1 or self.mfu > 1:
            raise ValueError("Cluster: link_efficiency and mfu are fractions, at most 1")

    def link(self, across_nodes: bool) -> Link:
        """The link a group uses: InfiniBand if it spans nodes, else NVLink (``α``, and ``β``
        at ``link_efficiency`` of the bandwidth)."""
        bw, lat = (
            (self.ib_bandwidth, self.ib_latency)
            if across_nodes
            else (self.nvlink_bandwidth, self.nvlink_latency)
        )
        return Link(alpha=lat, beta=1.0 / (bw * self.link_efficiency))

    def compute_time(self, flops: float) -> float:
        """Seconds for ``flops`` at ``mfu`` of the peak."""
        return flops / (self.flops * self.mfu)

    def assumptions(self) -> list[str]:
        """One line per parameter: its value and where it came from ("assumed: ..." where
        it is an assumption)."""
        unit = {"bandwidth": (1e9, "GB/s"), "latency": (1e-6, "µs"), "flops": (1e12, "TFLOP/s")}
        out = []
        for f in fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            scale, u = next((s for k, s in unit.items() if f.name.endswith(k)), (1, ""))
            out.append(f"{f.name} = {v / scale:g} {u}".rstrip() + f"  ({self.SOURCES[f.name]})")
        return out


@dataclass(frozen=True)
class Degrees:
    """How many ranks each parallel dim has; ``gpus`` is their product."""

    tensor: int = 1
    sequence: int = 1
    domain: int = 1
    data: int = 1

    def __post_init__(self):
        for d in DIMS:
            if not (isinstance(getattr(self, d), int) and getattr(self, d) >= 1):
                raise ValueError(f"Degrees: {d} must be an int >= 1, got {getattr(self, d)!r}")

    @property
    def gpus(self) -> int:
        """The ranks in all (the product of the degrees)."""
        return self.tensor * self.sequence * self.domain * self.data

    def __str__(self) -> str:
        used = [f"{d} {getattr(self, d)}" for d in DIMS if getattr(self, d) > 1]
        return " × ".join(used) or "1 GPU"


@dataclass(frozen=True)
class Growth:
    """The projected step against the recorded one, per rank: ``tokens`` (tokens or pixels a
    rank holds), ``width`` (channels, hidden size), ``layers`` (depth), ``dtype`` (bytes per
    element: 0.25 for bfloat16 against a float64 recording)."""

    tokens: float = 1.0
    width: float = 1.0
    layers: float = 1.0
    dtype: float = 1.0


@dataclass(frozen=True)
class Traffic:
    """Messages of one rank in a step: ``count`` of them of ``nbytes`` each (``Event.bytes``)
    along ``dim``, of family ``kind``, scaled by ``rule``. ``assumed``: written by hand
    (e.g. from a published count), not recorded."""

    dim: str
    kind: str
    rule: str
    nbytes: float
    count: float
    label: str = ""
    assumed: bool = False

    def __post_init__(self):
        if self.dim not in DIMS:
            raise ValueError(f"Traffic: dim must be one of {DIMS}, got {self.dim!r}")
        if self.rule not in RULES:
            raise ValueError(f"Traffic: rule must be one of {RULES}, got {self.rule!r}")


@dataclass
class Step:
    """A step to project: its :class:`Traffic`, the :class:`Degrees` it was recorded at and
    one rank's FLOPs."""

    name: str
    traffic: list[Traffic]
    degrees: Degrees
    flops: float


def rule_of(kind: str, label: str, dim: str) -> str:
    """The scaling rule of a recorded message, from its family, its tracer label and dim."""
    if "scatter_tensor" in label:
        return "input"
    if "params" in label or kind in ("reduce_scatter", "all_gather") and dim == "data":
        return "gradients"
    if ".halo" in label:
        return "halo"
    if "ring" in label and kind == "p2p":
        return "ring"
    if "norm" in label:
        return "stats"
    if dim == "tensor" and kind == "all_reduce":
        return "activation"
    return "fixed"


def recorded_step(name, trace, degrees: Degrees, flops: float, dims=None) -> Step:
    """The :class:`Step` of one traced step: the messages of the rank that sent the most
    bytes, grouped by (dim, family, label, bytes). A point-to-point row counts exchanges
    (sends in flight at once count once, at the largest); a collective row, its calls.

    ``dims``: mesh dim -> parallel dim (``{0: "sequence", 1: "tensor"}``); default: the one
    dim of ``degrees`` above 1."""
    events = list(getattr(trace, "events", trace))
    if dims is None:
        used = [d for d in DIMS if getattr(degrees, d) > 1]
        if len(used) != 1:
            raise ValueError(f"dims: give mesh dim -> parallel dim for {degrees}")
        dims = {None: used[0], 0: used[0]}
    totals: dict = {}
    for e in events:
        totals[e.rank] = totals.get(e.rank, 0) + e.bytes
    rank = max(sorted(totals), key=totals.get)
    rows: dict = {}
    for run in in_flight_together([e for e in events if e.rank == rank]):
        sends = [e for e in run if e.kind == "send"]
        if sends:  # an exchange: its sends in flight at once cost the largest
            e = max(sends, key=lambda e: e.bytes)
            key = (dims[e.mesh_dim], "p2p", e.label, e.bytes)
            rows[key] = rows.get(key, 0) + 1
        for e in run:
            if e.kind not in ("send", "recv"):
                key = (dims[e.mesh_dim], e.kind, e.label, e.bytes)
                rows[key] = rows.get(key, 0) + 1
    traffic = [
        Traffic(dim, kind, rule_of(kind, label, dim), nbytes, count, label)
        for (dim, kind, label, nbytes), count in sorted(rows.items())
    ]
    return Step(name, traffic, degrees, flops)


def scale(row: Traffic, recorded: Degrees, target: Degrees, growth: Growth = Growth()):
    """``(nbytes, count, group dims)`` of ``row`` at ``target`` by its rule (the module's
    table); a count of 0 where the target has no such messages."""
    g, t0, t = growth, recorded.tensor, target.tensor
    own = getattr(target, row.dim)
    if row.rule == "input":
        return 0.0, 0.0, (row.dim,)
    if row.rule == "gradients":
        dims = ("sequence", "domain", "data")
        n = row.nbytes * g.width**2 * g.layers * g.dtype * t0 / t
        return n, row.count if math.prod(getattr(target, d) for d in dims) > 1 else 0, dims
    if own == 1:
        return 0.0, 0.0, (row.dim,)
    if row.rule == "halo":
        return (
            row.nbytes * math.sqrt(g.tokens) * g.width * g.dtype,
            row.count * g.layers,
            (row.dim,),
        )
    if row.rule == "ring":
        s0 = getattr(recorded, row.dim)
        count = row.count * g.layers * (own - 1) / max(s0 - 1, 1)
        return row.nbytes * g.tokens * g.width * g.dtype * t0 / t, count, (row.dim,)
    if row.rule == "activation":
        return row.nbytes * g.tokens * g.width * g.dtype, row.count * g.layers, (row.dim,)
    if row.rule == "stats":
        return row.nbytes * g.width * g.dtype, row.count * g.layers, (row.dim,)
    return row.nbytes, row.count, (row.dim,)  # fixed


def spans_nodes(dims, degrees: Degrees, gpus_per_node: int) -> bool:
    """True if a group over ``dims`` spans nodes: ranks are numbered ``tensor`` fastest,
    then ``sequence``, ``domain``, ``data``; the group stays in one node when the degrees
    up to its outermost dim multiply to at most ``gpus_per_node``."""
    outer = max(DIMS.index(d) for d in dims)
    return math.prod(getattr(degrees, d) for d in DIMS[: outer + 1]) > gpus_per_node


@dataclass
class Projection:
    """One step at one :class:`Degrees` on a :class:`Cluster`: ``compute`` seconds,
    ``comm`` dim -> seconds, ``rows`` ``(Traffic, nbytes, count, p, across nodes, seconds)``.

    Communication is assumed to overlap compute perfectly (the best case): it hides while
    ``communication <= compute``; ``exposed`` is what sticks out."""

    step: str
    degrees: Degrees
    cluster: Cluster
    growth: Growth
    compute: float
    comm: dict[str, float] = field(default_factory=dict)
    rows: list = field(default_factory=list)

    @property
    def communication(self) -> float:
        """Seconds of communication per step, every dim."""
        return sum(self.comm.values())

    @property
    def hidden(self) -> bool:
        """True while communication fits behind compute."""
        return self.communication <= self.compute

    @property
    def exposed(self) -> float:
        """Seconds of communication that do not fit behind compute."""
        return max(self.communication - self.compute, 0.0)

    @property
    def step_time(self) -> float:
        """Seconds per step with perfect overlap (``compute + exposed``)."""
        return self.compute + self.exposed

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:.3f} ms"  # noqa: E731
        dims = ", ".join(f"{d} {ms(s)}" for d, s in self.comm.items() if s)
        state = "hides" if self.hidden else f"exposed {ms(self.exposed)}"
        head = f"{self.step} on {self.degrees.gpus} GPUs ({self.degrees})"
        comm = f"communication {ms(self.communication)} ({dims})"
        return f"{head}: compute {ms(self.compute)}, {comm}: {state}"


def project(step: Step, cluster: Cluster, degrees: Degrees, growth: Growth = Growth()):
    """The :class:`Projection` of ``step`` at ``degrees`` on ``cluster``.

    Each :class:`Traffic` row: bytes, count and group by :func:`scale`; one message's
    seconds by the ring/tree formulas (``CostModel.uniform`` of ``cluster.link`` for the
    nodes its group spans: :func:`spans_nodes`); a point-to-point message spans nodes when
    its dim's group does. Compute: ``step.flops`` × tokens · width² · layers · t0/t at
    ``cluster.mfu`` of its FLOP/s. A dim the target runs on (degree above 1) with no
    recorded messages raises: there is nothing to scale."""
    missing = [d for d in ("tensor", "sequence", "domain") if getattr(degrees, d) > 1
               and not any(r.dim == d for r in step.traffic)]  # fmt: skip
    if missing:
        raise ValueError(f"degrees: {step.name} has no {', '.join(missing)} messages to "
                         "scale (record them, or add assumed Traffic rows)")  # fmt: skip
    g, rec = growth, step.degrees
    out = Projection(step.name, degrees, cluster, growth, 0.0, dict.fromkeys(DIMS, 0.0))
    for row in step.traffic:
        nbytes, count, dims = scale(row, rec, degrees, growth)
        if not count:
            continue
        across = spans_nodes(dims, degrees, cluster.gpus_per_node)
        model = CostModel.uniform(cluster.link(across))
        p = math.prod(getattr(degrees, d) for d in dims)
        kind = "send" if row.kind == "p2p" else row.kind
        seconds = count * model.time(kind, int(round(nbytes)), p)
        dim = "data" if row.rule == "gradients" else row.dim
        out.comm[dim] += seconds
        out.rows.append((row, nbytes, count, p, across, seconds))
    flops = step.flops * g.tokens * g.width**2 * g.layers * rec.tensor / degrees.tensor
    out.compute = cluster.compute_time(flops)
    return out


def count_flops(fn, *args, **kwargs) -> float:
    """FLOPs of ``fn(*args, **kwargs)`` on one device, as ``torch.utils.flop_counter``
    counts them (matrix products, convolutions, attention; not elementwise ops)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return float(counter.get_total_flops())
