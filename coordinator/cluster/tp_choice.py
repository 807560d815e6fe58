"""`--tp auto`: the per-token model of tensor parallelism against a pipeline, and the
choice of a group size from measured figures. Decoding one token reads every weight once,
so a stage's time is its weight bytes over its members' memory read bandwidth; a group of
N reads 1/N each but pays 2 all-reduces per layer (after attention and after the MLP), a
ring's 2(N-1) steps of latency + hidden state / link bandwidth each; a pipeline pays a hop
per stage. benchmarks/dev/tp_shapes.py projects Macs with the same functions.
Left out: compute, KV reads, the head (the same in every plan); a MoE layer counts all its
experts, so its reads are an upper bound. Layers are shared equally among stages."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.proto_gen import wedlm_pb2 as pb


# ---- the model --------------------------------------------------------------------------
def step_s(link: pb.LinkFigures, nbytes: float) -> float:
    """One message of `nbytes` over `link`, one way: half its round trip + the transfer."""
    return link.rtt_s / 2 + nbytes / link.bandwidth


def ring_all_reduce_s(step: float, size: int) -> float:
    """A ring all-reduce of a small message over `size` members: 2(N-1) steps."""
    return 2 * (size - 1) * step


def tp_stage_s(reads_s: float, layers: float, size: int, all_reduce_s: float) -> float:
    """A stage of `layers` whose whole weights take `reads_s` to read, split `size` ways."""
    return reads_s / size + 2 * layers * all_reduce_s


def pipeline_s(reads_s: float, stages: int, hop_s: float) -> float:
    """Layers whose weights take `reads_s` to read in all, over `stages` stages: a hop each
    (the last stage's output goes back to the first); one stage has none."""
    return reads_s + (stages * hop_s if stages > 1 else 0.0)


def break_even_all_reduce_s(reads_s: float, layers: int, size: int, hop_s: float) -> float:
    """The all-reduce cost at which TP over `size` members (one stage) equals a pipeline of
    them: the weight reads TP saves and the hops it avoids pay for 2 per layer."""
    return (reads_s * (1 - 1 / size) + size * hop_s) / (2 * layers)


# ---- the choice -------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the model's layers cost: `layers` of `layer_bytes` each; a hidden state of a
    decoded token is `hidden_bytes`."""

    layers: int
    layer_bytes: int
    hidden_bytes: int


@dataclass
class Projection:
    """One candidate plan: its stages (each a list of member names, one for a member
    alone) and its projected per-token time, with what makes it up."""

    size: int  # the group size (1: a pipeline)
    stages: list[list[str]]
    token_s: float = 0.0
    all_reduce_s: float = 0.0  # all groups' all-reduces per token
    split_reads_s: float = 0.0  # the groups' weight reads per token
    all_reduces: float = 0.0  # per token
    ring: pb.LinkFigures | None = None  # the slowest ring link among the groups
    problem: str = ""  # why it cannot be projected (a link not measured)


@dataclass
class Figures:
    """What was measured: the links (by the unordered pair of names) and the members'
    memory read bandwidths (bytes/s)."""

    links: dict[frozenset, pb.LinkFigures] = field(default_factory=dict)
    reads: dict[str, float] = field(default_factory=dict)

    def link(self, a: str, b: str) -> pb.LinkFigures | None:
        return self.links.get(frozenset((a, b)))

    def read(self, name: str) -> float:
        known = [r for r in self.reads.values() if r > 0]
        return self.reads.get(name) or (min(known) if known else 0.0)


def project(shape: Shape, stages: list[list[str]], figures: Figures, size: int) -> Projection:
    """The per-token time of `stages` (layers shared equally among them)."""
    p = Projection(size, stages)
    per_stage = shape.layers / len(stages)
    stage_bytes = per_stage * shape.layer_bytes
    slowest_step = 0.0
    for members in stages:
        bandwidth = min(figures.read(m) for m in members)
        if bandwidth <= 0:
            p.problem = f"no read bandwidth measured for {', '.join(members)}"
            return p
        reads = stage_bytes / bandwidth
        if len(members) == 1:
            p.token_s += reads
            continue
        n = len(members)
        pairs = [(members[i], members[(i + 1) % n]) for i in range(n if n > 2 else 1)]
        links = [figures.link(a, b) for a, b in pairs]
        for (a, b), lk in zip(pairs, links, strict=True):
            if lk is None or lk.error or lk.bandwidth <= 0:
                why = f"could not be measured: {lk.error}" if lk is not None else "was not measured"
                p.problem = f"the link {a}↔{b} {why}"
                return p
        worst = max(links, key=lambda lk: step_s(lk, shape.hidden_bytes))
        step = step_s(worst, shape.hidden_bytes)
        if step > slowest_step:
            slowest_step, p.ring = step, worst
        all_reduce = ring_all_reduce_s(step, n)
        p.token_s += tp_stage_s(reads, per_stage, n, all_reduce)
        p.all_reduce_s += 2 * per_stage * all_reduce
        p.split_reads_s += reads / n
        p.all_reduces += 2 * per_stage
    p.token_s = pipeline_s(p.token_s, len(stages), hop_s(shape, figures))
    return p


def hop_s(shape: Shape, figures: Figures) -> float:
    """A hop between stages: a hidden state over the slowest link measured."""
    usable = [lk for lk in figures.links.values() if not lk.error and lk.bandwidth > 0]
    return max((step_s(lk, shape.hidden_bytes) for lk in usable), default=0.0)


def best(options: list[Projection]) -> Projection:
    """The lowest projected time; a tie goes to the smaller group (fewer collectives)."""
    usable = [p for p in options if not p.problem]
    return min(usable, key=lambda p: (p.token_s, p.size))


def reason(chosen: Projection, options: list[Projection]) -> str:
    """The plan's reason in a line a user reads in `wedlm status`."""
    pipeline = next(p for p in options if p.size == 1)
    rivals = [p for p in options if p.size > 1 and not p.problem]
    if chosen.size == 1:
        if not rivals:
            why = next((p.problem for p in options if p.problem), "no group could form")
            return f"tp auto: pipeline — {why}"
        rival = best(rivals)
        return (
            f"tp auto: pipeline (each member runs its own layers; {_ms(pipeline.token_s)} per "
            f"token projected) — splitting every layer over {rival.size} members would take "
            f"{_ms(rival.token_s)} per token: {_ms(rival.all_reduce_s)} of it exchanging "
            f"{rival.all_reduces:.0f} partial results over the slowest link ({_ring(rival)}), "
            f"{_ms(rival.split_reads_s)} reading the split weights"
        )
    return (
        f"tp auto: tp {chosen.size} (every layer split over {chosen.size} members; "
        f"{_ms(chosen.token_s)} per token projected, {_ms(pipeline.token_s)} as a pipeline) — "
        f"reading the split weights takes {_ms(chosen.split_reads_s)} per token, exchanging "
        f"{chosen.all_reduces:.0f} partial results over the slowest link ({_ring(chosen)}) "
        f"{_ms(chosen.all_reduce_s)}"
    )


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def _ring(p: Projection) -> str:
    lk = p.ring
    return f"{lk.a}↔{lk.b}: {lk.rtt_s * 1e3:.2f} ms round trip, {lk.bandwidth / 1e9:.2g} GB/s"
