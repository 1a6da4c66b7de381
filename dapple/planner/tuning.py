"""The planner's tuning constants in one place: how much it searches, simulates and forks, never what a plan costs."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SearchTuning:
    """The constants the planner's code reads as ``tuning.TUNING.<name>`` when it runs (a test may swap ``TUNING``
    for ``TUNING.replace(...)``). docs/planner.md says why each has its value."""

    # which search dapple.plan runs, and for how long
    compact_above: int = 4  # search="auto": servers above which the compact search is used
    compact_time_limit: float = 60.0  # time_limit="auto": seconds the compact search may take (the full: no limit)
    # the seeds (search/seeds.py) and the order the micro-batch sizes are searched in (planning.py)
    refined_seeds: int = 3  # seed plans per size whose cuts a local search improves
    refine_within: float = 0.05  # sizes whose best seed is within this of the best plan so far get refined seeds
    early_bounds: float = 0.02  # seeds taking this share of time_limit: sizes that may start late bound first
    # the DP (search/dp.py) and its bounds (search/bounds.py, search/bound_tables.py)
    tighten_after: int = 100  # states expanded before the search tightens its bounds (small searches need not)
    buckets_after: int = 2000  # states before it tightens them again with stage-count buckets
    comm_cache_limit: int = 30_000  # memoised stage-layout pairs above which the search drops them (memory)
    period_thresholds: int = 32  # the period bound's thresholds: it gives up at most (M - 1) x their spacing
    period_work: int = 10 ** 8  # at most this many array elements for the period bound's tables
    period_counts: int = 16  # the period bound's stage-count buckets of the rest (1, 2, ..., at least this many)
    period_min_m: int = 16  # fewer micro-batches: (M - 1) max(F, B) adds too little to pay for the tables
    row_wise_devices: int = 256  # devices from which rest_bound takes one replica count at a time
    cached_servers: int = 16  # CostModel.comm_pair caches per-cut answers for pairs over at most this many servers
    # certificates (search/exact.py)
    exact_plans: int = 200_000  # plans of one micro-batch size above which it is not enumerated
    judge_every: int = 400  # plans of all sizes together up to which the simulator judges every one
    # the final choice (judge.py)
    verify_within: float = 0.1  # candidates modelled more than this fraction above the DP's plan are not simulated
    simulate_limit: int = 50_000  # devices x micro-batches above which plan() does not simulate its candidates
    chunk_moves: int = 16  # simulations the fastest two-chunk variant's local search of its cuts may run (0: none)
    tie: float = 1e-3  # a later candidate or schedule must simulate this fraction faster to be taken
    chunked_variants: bool = True  # schedule="auto" (refined model): also the plan's two-chunk variants (chunked.py)
    # worker processes (workers.py)
    worker_memory: float = 2e9  # bytes a worker may need: workers="auto" starts no more than fit
    fork_worth: float = 0.1  # seconds of in-process work from which workers="auto" forks a full search's steps too
    worker_stuck: float = 30.0  # seconds without CPU use, work pending, after which workers count as stuck
    poll: float = 1.0  # seconds between looks at the workers

    def replace(self, **changes) -> "SearchTuning":
        """A copy with ``changes`` (field=value)."""
        return replace(self, **changes)


TUNING = SearchTuning()
