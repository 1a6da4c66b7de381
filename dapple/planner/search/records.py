"""The search's typed records: its configuration, the prefixes it memoises, a new stage's placements, results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..model.cost import ServerLayout

INF = float("inf")
Span = tuple  # (first layer, end layer, server of each replica): one stage


@dataclass(frozen=True)
class SearchConfig:
    """What the search is asked, whatever the profile and cluster.

    Args:
        model: "paper" (formula 2 as printed) or "refined" (the latency model that tracks the simulator).
        overlap: the AllReduce overlaps the last backward (DDP-style).
        warmup_policy: "A" or "B"; None: the better one per plan (refined model; formula 2 ignores K_i).
        optimizer_factor: bytes held per parameter byte (weights, gradients, optimizer state).
        beam: prefixes kept per DP state (the paper keeps one).
        max_stages: the most stages a plan may have (None: any).
        partial_kinds: only placements after which the partly used servers come in at most this many kinds
            (free devices, replicas of the new stage); None: any (the full search), 1: the compact search.
        gap: prune what cannot beat the best plan so far by more than this fraction.
        recompute, mixed_precision: the stages' activation recomputation (False, True or "auto") and autocast
            dtype (None, "bf16" or "fp16"), as CostModel prices them.
    """

    model: str = "paper"
    overlap: bool = False
    warmup_policy: str | None = None
    optimizer_factor: float = 4.0
    beam: int = 1
    max_stages: int | None = None
    partial_kinds: int | None = None
    gap: float = 0.0
    recompute: bool | str = False
    mixed_precision: str | None = None

    @property
    def refined(self) -> bool:
        return self.model == "refined"


class Found(NamedTuple):
    """A complete plan the search met: its stages, how each was placed and its warmup policy."""

    spans: tuple  # ((a, c, layout), ...)
    policies: tuple  # fresh/append/scatter per stage, "rest" (the last stage), "even" (a seed plan)
    warmup_policy: str


class Best(NamedTuple):
    """The incumbent as a value: its modelled latency and plan (None: only a bound, no plan yet)."""

    latency: float
    found: Found | None


class Incumbent:
    """The best complete plan so far and the cut it sets: whatever cannot beat it by more than ``gap`` is pruned."""

    __slots__ = ("latency", "found", "cut", "gap")

    def __init__(self, latency: float, gap: float):
        self.gap = gap
        self.set(latency, None)

    def set(self, latency: float, found: Found | None) -> None:
        self.latency, self.found = latency, found
        self.cut = latency / (1.0 + self.gap)

    def offer(self, latency: float, spans: tuple, policies: tuple, warmup_policy: str) -> None:
        """Take a complete plan if it is faster than the best so far."""
        if latency < self.latency:
            self.set(latency, Found(spans, policies, warmup_policy))

    @property
    def best(self) -> Best:
        return Best(self.latency, self.found)


@dataclass
class SearchResult:
    """The best plan of one micro-batch size's search, with how much the DP did to find it."""

    latency: float
    spans: tuple  # ((a, c, server of each replica), ...)
    policies: tuple  # how each stage was placed: fresh/append/scatter, "rest" (the last stage), "even" (a seed)
    warmup_policy: str
    micro_batch_size: int
    states: int
    transitions: int


class Tail(NamedTuple):
    """The rest [a, N) as one stage on a layout: per micro-batch costs and the slices that fit in memory."""

    f: float
    b: float
    allreduce: float
    ending: float  # when its AllReduce ends after its last backward starts (B without overlap)
    fits: int


class StageLists(NamedTuple):
    """A stage [j, j2) on m replicas, per end j2 (lists indexed by j2, up to where M (F+B) reaches the cut)."""

    f: list
    b: list
    allreduce: list
    fits: list  # slices that fit in device memory


class Job(NamedTuple):
    """What prices prefix + new stage + the rest as one stage, beyond their interleaved costs (plan_latency)."""

    busy: float  # the transfer into the rest: F and B of its communication stage
    f: float  # the rest's F, B, AllReduce, ending
    b: float
    allreduce: float
    ending: float
    chain: float  # the transfer's share of a round trip and of the steady state
    window: float
    fits: int  # the rest's slices that fit
    period: float  # the plan's link period and drain period
    drain: float
    queue: tuple | None  # comm.queues of each stage (refined model)
    feed: list | None  # comm.feeds (None: no server link shared, or formula 2)


class Option(NamedTuple):
    """One placement of a new stage after a prefix (Memo.options): where it goes, what it leaves, the new state."""

    policy: str  # fresh, append or scatter
    new: ServerLayout  # the new stage's layout
    free: tuple  # free devices per server after it
    n_rest: int  # devices left for the rest
    tail: ServerLayout  # the rest's layout (its first b replicas when wider)
    wide: bool  # the rest cannot be one stage (more than b devices)
    key: int  # the new state's key (Memo.canonical)
    perm: list  # this prefix's server labels -> the new state's
    multi: bool  # the new stage spans servers
    comms: list  # [comm_pair in, comm_pair to the rest]: filled once the placement passes the bounds


@dataclass(slots=True)
class Prefix:
    """Stages planned so far (layers [0, j)), in canonical server labels, with their interleaved costs (the
    communication stage after the last one is not included: it depends on the next stage)."""

    parent: "Prefix | None" = None  # the prefix this one extends by one stage (None: no stage yet)
    span: Span | None = None  # that stage, (a, c, layout) in the parent's server labels
    perm: list | None = None  # the parent's server labels -> this prefix's
    last: ServerLayout | None = None  # the last stage's layout in this prefix's labels
    depth: int = 0  # stages planned
    policies: tuple = ()  # placement policy of each stage
    F: list = field(default_factory=list)  # interleaved compute and communication stages' costs
    B: list = field(default_factory=list)
    AR: list = field(default_factory=list)
    E: list = field(default_factory=list)
    C: list = field(default_factory=list)  # B, with the gradients' share of a round trip for communication stages
    D: list = field(default_factory=list)
    lb: float = 0.0  # lower bound on L of any completion, from the fixed stages' steady costs
    free: tuple = ()  # free devices per server (canonical order)
    latency: float | None = None  # formula 5: the complete plan prefix + the remaining layers as one stage on the
    # free devices (None until StageCosts.prefix_latency prices it from ``job``)
    servers: dict = field(default_factory=dict)  # per server, (uplink, downlink) ms per micro-batch of the prefix's
    # transfers (refined model)
    server_max: float = 0.0
    dev: float = 0.0  # busiest device link of the prefix per micro-batch (refined model)
    last_in: float = 0.0  # busiest receiving device link of the prefix's last communication stage
    W: float = 0.0  # sum of the prefix's F (compute and communication): when the first micro-batch leaves it
    Bsum: float = 0.0  # sum of the prefix's B (communication: its round-trip share): the last gradient's way back
    below: float | None = None  # refined_chains' `below` after the last stage: its ending and what follows it
    fmax: float = 0.0  # slowest forward of the prefix (compute or communication)
    floor: float = 0.0  # the least L of any completion by the search's bounds when it was made: the memo's rank
    Cw: list = field(default_factory=list)  # as C, the steady state's share (CostModel.comm_links' window)
    dev_drain: float = 0.0  # busiest device link of the prefix per micro-batch once activations stop (one way)
    queue: tuple = ()  # comm.queues of each stage before the last (the last's needs the next stage)
    hot: tuple = ()  # the last stage's inbound links that are the busiest of its transfer in (CostModel.comm_links)
    lead: tuple | None = None  # least `lead` and own chain terms of its stages in a plan of depth + 2 (on use)
    us: list | None = None  # Pruner.prefix_u_table: the largest U per count of stages after it (on use)
    ts: dict | None = None  # Pruner.period_ts's buckets but the last, per (stages after, links, buckets) (on use)
    users: dict = field(default_factory=dict)  # per server, the communication stages on its uplink and downlink
    # with their ms per micro-batch (comm.add_users; refined model)
    job: Job | None = None  # with F, B, ..., what StageCosts.prefix_latency prices ``latency`` from

    def spans(self) -> tuple:
        """((a, c, layout), ...) in this prefix's labels (built on demand: most prefixes never need it)."""
        if self.parent is None:
            return ()
        perm = self.perm
        return tuple((a, c, tuple(perm[s] for s in lay)) for a, c, lay in self.parent.spans() + (self.span,))


class Progress(NamedTuple):
    """What a search's steps (DPSearch.seed, refine_seeds, bound_tables, run) have made of it, as a value: what a
    forked worker sends back and the search in the parent takes in (DPSearch.adopt)."""

    best: Best
    seeds: tuple = ()  # the seed plans kept for refine_seeds(), (L, spans)
    priced: int = 0  # seed plans seed() priced
    root_bound: float = 0.0
    states: int = 0
    transitions: int = 0
    complete: bool = True
