"""PipeDream's per-level DP (optimizer_graph_hierarchical.compute_partitioning / analyze_partitioning), ported."""

from __future__ import annotations

import math
from typing import NamedTuple

# Faithful port of optimizer/optimizer_graph_hierarchical.py of msr-fiddle/pipedream (commit 11c40c0):
# compute_partitioning (per-level DP) and analyze_partitioning (walk back the splits); its main (remove the
# Input sources, build the antichain states, solve level after level substituting each level's times into
# the next, then expand the splits top-down) is pipedream.pipedream_plan. Units as there: seconds, bytes, bytes/s.
SOURCE = "msr-fiddle/pipedream optimizer/optimizer_graph_hierarchical.py @ 11c40c0"


class Cell(NamedTuple):
    """A[i][j][m]: the best pipeline of states i..j on m+1 machines (all None: none)."""

    time: float | None  # its time per minibatch, s
    split: tuple[int, int] | None  # (k, m'): the last stage is states k+1..j, the rest A[i][k][m'] (None: one stage)
    machines: int | None  # the last stage's replicas


NONE = Cell(None, None, None)


def dp_time(t: float, params: float, r: int, bandwidth: float, within: int = 1) -> float:
    """One stage on r replicas: (t + 4(r-1)P/(B r) / within) / r, PipeDream's data-parallel cost."""
    return (t + 4 * (r - 1) * params / (bandwidth * r) / within) / r


def compute_partitioning(compute_times, activation_sizes, parameter_sizes, output_activation_sizes,
                         all_predecessor_ids, num_machines: int, num_machines_within_machine: int,
                         num_machines_in_first_level: int | None, bandwidth: float, final_level: bool,
                         opts: dict) -> list:
    """optimizer_graph_hierarchical.compute_partitioning: A[i][j][m] (a :class:`Cell`) for states i..j on m+1
    machines of one level.

    Args:
        compute_times, activation_sizes, parameter_sizes: per states i..j (s, bytes, bytes), as main() builds them.
        output_activation_sizes: bytes leaving each state.
        all_predecessor_ids: the antichain-DAG ancestors of each state, in the order they are scanned.
        num_machines: machines of this level; num_machines_within_machine: of the level below.
        num_machines_in_first_level: PipeDream's flag (only that many machines for the first stage), or None.
        bandwidth: of this level, B/s.
        final_level: only row 0 is needed.
        opts: straight_pipeline, activation_compression_ratio (None: no activation transfers),
            use_memory_constraint, memory_size, use_fewer_machines (PipeDream's flags).
    """
    A = _data_parallel_cells(compute_times, activation_sizes, parameter_sizes, num_machines,
                             num_machines_within_machine, num_machines_in_first_level, bandwidth, opts)
    # The DP below is compute_partitioning's loop, reordered for speed with identical results (checked
    # against a line-by-line port in the tests): columns j outer (A[i][j][m] only reads A[i][k][m'] with
    # k < j, m' < m), and the last stage's cost max'd with its transfers precomputed per (k, j, m').
    top = 1 if opts["straight_pipeline"] else num_machines - 1
    L = _last_stages(compute_times, parameter_sizes, output_activation_sizes, all_predecessor_ids, top, bandwidth,
                     opts["activation_compression_ratio"])
    pred_sets = [set(p) for p in all_predecessor_ids]
    min_machines = 1 if num_machines_in_first_level is None else num_machines_in_first_level
    for i in range(1 if final_level else len(compute_times)):
        _fill_row(A[i], i, L, all_predecessor_ids, pred_sets[i - 1] if i > 0 else set(), activation_sizes,
                  parameter_sizes, num_machines, min_machines, top, opts)
    return A


def _data_parallel_cells(compute_times, activation_sizes, parameter_sizes, num_machines: int, within: int,
                         num_machines_in_first_level: int | None, bandwidth: float, opts: dict) -> list:
    """A with every states i..j as one data-parallel stage of m+1 replicas (what the DP starts from)."""
    straight, memory, memory_size = opts["straight_pipeline"], opts["use_memory_constraint"], opts["memory_size"]
    rows, cols = len(compute_times), len(compute_times[0])
    A = [[[NONE] * num_machines for _ in range(cols)] for _ in range(rows)]
    for i in range(rows):
        for j in range(i, cols):
            t, act, par = compute_times[i][j], activation_sizes[i][j], parameter_sizes[i][j]
            for m in range(1 if straight else num_machines):
                if memory and math.ceil((num_machines - (m + 1)) / (m + 1)) * (act + par) > memory_size:
                    continue
                if num_machines_in_first_level is not None and m != num_machines_in_first_level - 1:
                    continue
                A[i][j][m] = NONE if t is None else Cell(dp_time(t, par, m + 1, bandwidth, within), None, m + 1)
    return A


def _last_stages(compute_times, parameter_sizes, output_activation_sizes, all_predecessor_ids, top: int,
                 bandwidth: float, ratio: float | None) -> list[dict]:
    """L[j][k]: (costs of states k+1..j as the last stage on m' = 1..top machines, their running minimum over
    m') for every ancestor k of j (the running minimum bounds every candidate of a k from below)."""
    last_out = len(output_activation_sizes) - 1

    def last_stage(k: int, j: int) -> list[float] | None:
        t_last, p_last = compute_times[k + 1][j], parameter_sizes[k + 1][j]
        if t_last is None:
            return None
        row = []  # m' = 1..top
        for mp in range(1, top + 1):
            # 4(m'-1)P/(B m') here is NOT divided by num_machines_within_machine (as in PipeDream)
            t = dp_time(t_last, p_last, mp, bandwidth)
            if ratio is not None:  # activations in and out: 2 * size / (B m'), both directions
                t = max(t, 2.0 * output_activation_sizes[k] / (bandwidth * mp) / ratio)
                if j < last_out:
                    t = max(t, 2.0 * output_activation_sizes[j] / (bandwidth * mp) / ratio)
            row.append(t)
        return row

    return [{k: (row, _running_min(row)) for k in all_predecessor_ids[j] if (row := last_stage(k, j)) is not None}
            for j in range(len(compute_times[0]))]


def _fill_row(Ai: list, i: int, L: list[dict], all_predecessor_ids, skip: set, activation_sizes, parameter_sizes,
              num_machines: int, min_machines: int, top: int, opts: dict) -> None:
    """Row i of the DP, column after column: the best split of states i..j on m+1 machines into a pipeline of
    states i..k on m+1-m' machines and a last stage k+1..j on m' (``skip``: the ancestors of state i - 1)."""
    inf, memory, memory_size, fewer = math.inf, opts["use_memory_constraint"], opts["memory_size"], \
        opts["use_fewer_machines"]
    cols = len(Ai)
    vals = [[inf if c[0] is None else c[0] for c in Ai[k]] for k in range(min(i + 1, cols))]  # A[i][k][m][0]
    rvals, vmin = [v[::-1] for v in vals], [_running_min(v) for v in vals]  # reversed; running min over m
    for j in range(i + 1, cols):
        Aij = Ai[j]
        ks = [(k, *L[j][k]) for k in all_predecessor_ids[j] if k not in skip and k >= i and k in L[j]]
        for m in range(min_machines, num_machines):
            best, split, used = Aij[m]
            if fewer and m > 0 and Aij[m - 1][0] is not None and (best is None or Aij[m - 1][0] < best):
                best, split, used = Aij[m - 1]
            hi = min(m, top)
            for k, Lkj, Lmin in ks:  # the last stage is states k+1..j on m' = 1..hi machines
                if best is not None and max(vmin[k][m - 1], Lmin[hi - 1]) >= best:
                    continue  # a lower bound of every candidate of this k: none can be strictly better
                # max(A[i][k][m - m'][0], last stage on m') for m' = 1..hi (zip stops at hi)
                c = [a if a >= b else b for a, b in zip(rvals[k][num_machines - m:], Lkj)]
                if memory:
                    stash = activation_sizes[k + 1][j] + parameter_sizes[k + 1][j]
                    c = [inf if stash * math.ceil((num_machines - (m + 1)) / (x + 1)) > memory_size else v
                         for x, v in enumerate(c)]
                t = min(c)
                if t < inf and (best is None or best > t):  # PipeDream keeps the first of equal times
                    mp = c.index(t) + 1
                    best, split, used = t, (k, m - mp), mp
            Aij[m] = Cell(best, split, used)
        v = [inf if c[0] is None else c[0] for c in Aij]
        rvals.append(v[::-1])
        vmin.append(_running_min(v))


def _running_min(xs: list[float]) -> list[float]:
    out, lo = [], math.inf
    for x in xs:
        lo = x if x < lo else lo
        out.append(lo)
    return out


def analyze_partitioning(A, start: int, end: int, num_machines: int) -> tuple[list[int], list[int]]:
    """optimizer_graph_hierarchical.analyze_partitioning: (split points, replication factors) of states
    [start, end) on num_machines machines of this level, first stage first."""
    metadata = A[start][end - 1][num_machines - 1]
    if metadata[0] is None:
        raise ValueError(f"pipedream_plan: no feasible partition of states [{start}, {end}) on {num_machines} "
                         f"machines (memory constraint?)")
    splits, factors = [], []
    while metadata[1] is not None:
        k, m_rest = metadata[1]
        splits.append(k + 1)
        factors.append(metadata[2])
        metadata = A[start][k][m_rest]
    factors.append(metadata[2])
    return splits[::-1], factors[::-1]
