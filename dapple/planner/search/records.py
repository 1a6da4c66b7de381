"""The search's typed records: its configuration, the prefixes it memoises, a new stage's placements, results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..model.cost import ServerLayout, Span

INF = float("inf")


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
        recompute, mixed_precision: the stages' activation recomputation (memory.RECOMPUTE_MODES) and autocast
            dtype (None, "bf16" or "fp16"), as CostModel prices them.
        shard_optimizer: a stage's optimizer state is sharded over its replicas (CostModel.static_bytes).
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
    shard_optimizer: bool = False

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
    """The best complete plan so far and the bar it sets: whatever cannot beat it by more than ``gap`` is pruned
    (``bar`` = latency / (1 + gap): a plan, or a bound on one, at or above it is dropped)."""

    __slots__ = ("latency", "found", "bar", "gap")

    def __init__(self, latency: float, gap: float):
        self.gap = gap
        self.set(latency, None)

    def set(self, latency: float, found: Found | None) -> None:
        self.latency, self.found = latency, found
        self.bar = latency / (1.0 + self.gap)

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


class Tail(NamedTuple):
    """The rest [a, N) as one stage on a layout: per micro-batch costs and the slices that fit in memory."""

    f: float
    b: float
    allreduce: float
    ending: float  # when its AllReduce ends after its last backward starts (B without overlap)
    fits: int


class StageLists(NamedTuple):
    """A stage [j, j2) on m replicas, per end j2 (lists indexed by j2, up to where M (F+B) reaches the bar)."""

    f: list
    b: list
    allreduce: list
    fits: list  # slices that fit in device memory


class Start(NamedTuple):
    """Where a new stage starts in one micro-batch's round trip: the least L the stages before it allow (``base``),
    their forwards (with the transfer into it: when the first micro-batch reaches it) and their backwards (the
    last gradient's way back from it)."""

    base: float
    forward_sum: float
    backward_sum: float


class StageEnd(NamedTuple):
    """An end j2 of a new stage [j, j2) that passes the bounds (Pruner.ends): the stage's costs, the least L the
    stages so far with it allow and the least L of a completion by the rest bounds."""

    end: int
    f: float
    b: float
    allreduce: float
    fits: int  # slices that fit in device memory
    lb: float  # from the stages up to it: its start's base, or its own chain from the first micro-batch's arrival
    rest_floor: float


class Completion(NamedTuple):
    """What completes a prefix + new stage into formula 5's plan, beyond their interleaved costs: the rest as one
    stage and the transfer into it, the plan's link periods, queues and feeds (StageCosts.plan_latency)."""

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
    queue: tuple | None  # transfers.queues of each stage (refined model)
    feed: list | None  # transfers.feeds (None: no server link shared, or formula 2)


class PlanCosts(NamedTuple):
    """Formula 5's inputs (StageCosts.plan_latency): the interleaved stages' costs of a prefix and its new stage
    (compute 2i, communication 2i + 1: docs/planner.md draws them) and what completes them."""

    F: list
    B: list
    AR: list
    E: list  # overlapped AllReduce endings (B without overlap)
    chain: list  # B, with the gradients' share of a round trip for communication stages
    D: list  # slices that fit, per compute stage
    window: list  # as chain, the steady state's share (CostModel.comm_links' window)
    completion: Completion | None

    @classmethod
    def empty(cls) -> "PlanCosts":
        """No stage yet (the DP's root)."""
        return cls([], [], [], [], [], [], [], None)


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
class Links:
    """How a prefix's transfers load the links, in ms per micro-batch (the refined model's; under formula 2 only
    ``last_in``, ``queue`` and ``hot`` are filled)."""

    servers: dict = field(default_factory=dict)  # per server, (uplink, downlink)
    server_max: float = 0.0  # the busiest server's uplink + downlink
    dev: float = 0.0  # the busiest device link
    last_in: float = 0.0  # the busiest receiving device link of the last communication stage
    dev_drain: float = 0.0  # the busiest device link once activations stop (one way)
    queue: tuple = ()  # transfers.queues of each stage before the last (the last's needs the next stage)
    hot: tuple = ()  # the last stage's inbound links that are the busiest of its transfer in (CommLinks.hot)
    users: dict | None = field(default_factory=dict)  # per server, the communication stages on its uplink and
    # downlink (None: an Arrival's, until Arrival.users makes them)
    # (transfers.add_users)


@dataclass(slots=True)
class Prefix:
    """Stages planned so far (layers [0, j)), in canonical server labels: a DP state's entry. Each extends its
    ``parent`` by one stage (docs/planner.md draws the chain); the communication stage after its last one is not
    priced (it depends on the next stage)."""

    # the plan so far
    parent: "Prefix | None" = None  # the prefix this one extends by one stage (None: no stage yet)
    span: Span | None = None  # that stage, in the parent's server labels
    perm: list | None = None  # the parent's server labels -> this prefix's
    last: ServerLayout | None = None  # the last stage's layout in this prefix's labels
    depth: int = 0  # stages planned
    policies: tuple = ()  # placement policy of each stage
    free: tuple = ()  # free devices per server (canonical order)
    # formula 5: this prefix + the remaining layers as one stage on the free devices
    costs: PlanCosts = field(default_factory=PlanCosts.empty)  # its inputs
    latency: float | None = None  # its L (None until StageCosts.prefix_latency prices it: only ties need it)
    # what the bounds know of every completion
    lb: float = 0.0  # L is at least this, from the fixed stages' steady costs
    floor: float = 0.0  # the least L of any completion by the bounds when it was made: the memo's rank
    forward_sum: float = 0.0  # the prefix's F summed (compute and communication): when the first micro-batch leaves
    backward_sum: float = 0.0  # its B summed (communication: their round-trip share): the last gradient's way back
    below: float | None = None  # refined_chains' `below` after the last stage: its ending and what follows it
    fmax: float = 0.0  # the slowest forward of the prefix (compute or communication)
    links: Links = field(default_factory=Links)
    # the bounds' tables of this prefix, made on first use (Pruner)
    lead: tuple | None = None  # least `lead` and own chain terms of its stages in a plan of depth + 2 (prefix_lead)
    u_table: list | None = None  # the largest U per count of stages after it (prefix_u_table)
    period_ts: dict | None = None  # Pruner.period_ts's buckets but the last, per (stages after, links, buckets)

    def spans(self) -> tuple[Span, ...]:
        """The stages in this prefix's labels (built on demand: most prefixes never need it)."""
        if self.parent is None:
            return ()
        perm, span = self.perm, self.span
        if perm is None or span is None:
            raise RuntimeError(f"Prefix at depth {self.depth}: extends a parent but holds no span or perm")
        return tuple(Span(a, c, tuple(perm[s] for s in lay)) for a, c, lay in self.parent.spans() + (span,))
