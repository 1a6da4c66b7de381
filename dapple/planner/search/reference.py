"""The planner's DP as paper section IV-C states it (formulas 4 and 5), nothing that makes it fast: read it first.

dp.DPSearch is the same recurrence with bounds (bounds.Pruner), a memo up to server symmetry (memo.py) and seed plans
(seeds.py); tests/planner/search/test_reference.py checks that the two find the same plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..model.cost import CostModel, ServerLayout, Span
from .placement import arrange, placements
from .pricing import StageCosts
from .records import INF, Incumbent, SearchConfig

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile


def new_stages(free: tuple, per_server: int, m: int, prev: ServerLayout | None) -> Iterator[tuple]:
    """Where a new stage of ``m`` replicas can go after a stage on ``prev``: Fresh, Append and Scatter First
    (placement.py, the previous stage's servers first), each in two replica orders (like ``prev``, whose slices it
    meets; the servers that keep the most free devices first). Yields (policy, layout, free devices after it)."""
    first = {s: k for k, s in enumerate(dict.fromkeys(prev or ()))}
    order = sorted(range(len(free)), key=lambda s: (first.get(s, len(free)), s))
    for policy, take in placements(free, per_server, m, order):
        left = tuple(f - t for f, t in zip(free, take))
        like = arrange(take, prev)
        fullest = tuple(sorted(like, key=lambda s: (-left[s], first.get(s, len(free)), s)))
        for new in dict.fromkeys((like, fullest)):
            yield policy, new, left


def reference_search(profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int,
                     config: SearchConfig = SearchConfig("refined")) -> tuple[float, tuple, str] | None:
    """The plan formula 4's DP finds for one micro-batch size, as (L, spans, warmup policy); None: none fits.

    Formula 4: a state is (j, the free devices of each server, the last stage's layout): layers [0, j) planned
    on the devices used. From each, a new stage [j, j2) on m replicas placed by :func:`new_stages` leads to the
    state (j2, ...). Formula 5 prices the move: L of the stages so far + the new stage + the remaining layers as
    one stage on the free devices (its first b when there are more); each state keeps the prefix formula 5 prices
    lowest (the paper keeps one), and every such plan that uses every device and fits is a candidate. ``config``:
    the model, overlap, warmup policy, memory and max_stages (not beam, partial_kinds or gap: dp.py's).
    """
    N, b, per_server = profile.num_layers, micro_batch_size, cluster.devices_per_server
    cm = CostModel(profile, cluster, b, optimizer_factor=config.optimizer_factor, recompute=config.recompute,
                   mixed_precision=config.mixed_precision, shard_optimizer=config.shard_optimizer)
    costs = StageCosts(cm, config, global_batch_size // b, Incumbent(INF, 0.0))
    most = N if config.max_stages is None else config.max_stages
    best: tuple = (INF, (), "A")

    def formula5(spans: tuple, new: Span, free: tuple) -> tuple[float, str, tuple] | None:
        """(L, warmup policy, the rest's stage) of ``spans`` + ``new`` + the rest as one stage on ``free``."""
        rest = Span(new.end, N, arrange(free, new.layout, b))
        if cm.fits(new.start, new.end, len(new.layout)) < 1:
            return None
        priced = costs.evaluate_spans(spans + (new, rest), check=False)  # (a rest that does not fit: K = 1)
        return None if priced is None else (*priced, rest)

    whole = Span(0, N, tuple(s for s in range(cluster.servers) for _ in range(per_server)))
    if len(whole.layout) <= b and cm.fits(0, N, len(whole.layout)) >= 1:  # pure data parallelism: j = 0 as a plan
        whole_priced = costs.evaluate_spans((whole,))
        if whole_priced is None:  # (it fits and has no more replicas than rows)
            raise RuntimeError(f"reference search: pure data parallelism on {len(whole.layout)} devices not priced")
        lat, pol = whole_priced
        best = (lat, (whole,), pol)
    states: list[dict] = [{} for _ in range(N + 1)]  # per j: (free, last layout) -> (formula 5's L, spans)
    states[0][((per_server,) * cluster.servers, None)] = (INF, ())
    for j in range(N):
        for (free, last), (_, spans) in states[j].items():
            if len(spans) + 2 > most:
                continue  # a new stage and the rest would be one too many
            for m in range(1, min(sum(free) - 1, b) + 1):  # the rest keeps a device at least
                for _, layout, left in new_stages(free, per_server, m, last):
                    for j2 in range(j + 1, N):
                        new = Span(j, j2, layout)
                        priced = formula5(spans, new, left)
                        if priced is None:
                            continue
                        lat, pol, rest = priced
                        if lat < best[0] and sum(left) <= b and cm.fits(j2, N, sum(left)) >= 1:
                            best = (lat, spans + (new, rest), pol)  # a complete plan
                        held = states[j2].get((left, layout))
                        if held is None or lat < held[0]:
                            states[j2][(left, layout)] = (lat, spans + (new,))
    return best if best[0] < INF else None
