"""GradReducer: buckets launch in each group's order, as soon as they and the group's earlier buckets are ready."""

from __future__ import annotations

import torch
from torch import nn

from dapple.runtime import groups
from dapple.runtime.groups import GradGroup, GradReducer


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


def _reducer(monkeypatch, sizes=(3, 2), spans=()) -> tuple[GradReducer, list[list[nn.Parameter]], list[int]]:
    """Groups of ``sizes`` float32 parameters of 4 elements (16 bytes: one bucket each with 16-byte buckets);
    AllReduce replaced by a record of the launched buckets."""
    launched: list[int] = []
    params = [[nn.Parameter(torch.ones(4)) for _ in range(n)] for n in sizes]
    gs = [GradGroup(f"g{i}", [0], [f"p{i}.{j}" for j in range(n)], group=object(), params=ps, spans_stages=i in spans)
          for i, (n, ps) in enumerate(zip(sizes, params))]
    red = GradReducer(gs, bucket_bytes=16)

    def all_reduce(flat, group, async_op, op=None):
        if op is None:  # a bucket (the MAX AllReduce is tied groups' agreement on which have gradients)
            launched.append(next(k for k, f in enumerate(red._flat) if f is flat))
        return _Done()
    monkeypatch.setattr(groups.dist, "all_reduce", all_reduce)
    return red, params, launched


def test_buckets_launch_in_order_and_only_when_ready(monkeypatch):
    red, (a, b), launched = _reducer(monkeypatch)
    # buckets hold parameters in reverse: group 0 -> [a2], [a1], [a0] (buckets 0-2), group 1 -> [b1], [b0] (3, 4)
    assert [bk[1][0] for bk in red.buckets] == [a[2], a[1], a[0], b[1], b[0]]
    for p in (*a, *b):
        p.grad = torch.zeros(4)
    red._ready(a[0])  # not armed: ignored
    red.arm()
    red._ready(a[1])  # bucket 1 ready, but bucket 0 is not launched: wait
    red._ready(b[1])  # group 1's first bucket: launch
    assert launched == [3]
    red._ready(a[2])  # bucket 0, then the waiting bucket 1
    assert launched == [3, 0, 1]
    red.finish(timeout=1.0, who="test", moment="step 1")  # the rest, in bucket order
    assert launched == [3, 0, 1, 2, 4]
    red.arm()  # the next step starts over
    red._ready(a[2])
    assert launched[5:] == [0]


def test_finish_writes_the_sums_back(monkeypatch):
    red, (a,), _ = _reducer(monkeypatch, sizes=(2,))
    for i, p in enumerate(a):
        p.grad = torch.full((4,), float(i + 1))
    red.arm()
    red.finish(timeout=1.0, who="test", moment="step 1")  # a one-rank "sum" is the gradient itself
    assert [p.grad.tolist() for p in a] == [[1.0] * 4, [2.0] * 4]


def test_tied_groups_across_stages_wait_for_the_end_of_the_backward(monkeypatch):
    """A group spanning stages must not launch mid-backward: its first stage joins only after this rank's
    gradients reach it (on NCCL a launched AllReduce spins on the GPU and can block the rest of the backward)."""
    red, (a, b), launched = _reducer(monkeypatch, spans=(1,))
    for p in (*a, *b):
        p.grad = torch.zeros(4)
    red.arm()
    for p in (*b, *a):  # group 1 (tied) is ready first
        red._ready(p)
    assert launched == [0, 1, 2]  # only the replica group's buckets
    red.finish(timeout=1.0, who="test", moment="step 1")
    assert launched == [0, 1, 2, 3, 4]


def test_parameters_without_gradients_keep_none_and_are_not_reduced(monkeypatch):
    """As on one device, a parameter no backward reached keeps ``.grad is None`` (AdamW's weight decay then leaves
    it alone under every plan); a bucket with no gradient at all is not reduced."""
    red, (a, b), launched = _reducer(monkeypatch, spans=(1,))
    a[1].grad = torch.ones(4)  # a[0], a[2] and all of b got none
    red.arm()
    red.finish(timeout=1.0, who="test", moment="step 1")
    assert [p.grad is None for p in a] == [True, False, True] and all(p.grad is None for p in b)
    assert launched == [1]
