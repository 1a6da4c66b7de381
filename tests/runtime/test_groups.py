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


def _grad(p: nn.Parameter, value: float = 1.0) -> None:
    """Accumulate ``value`` into ``p.grad`` through autograd (its post-accumulate hook fires, as in a backward)."""
    (p * value).sum().backward()


def test_buckets_launch_in_order_and_only_when_ready(monkeypatch):
    red, (a, b), launched = _reducer(monkeypatch)
    # buckets hold parameters in reverse: group 0 -> [a2], [a1], [a0] (buckets 0-2), group 1 -> [b1], [b0] (3, 4)
    assert [bk[1][0] for bk in red.buckets] == [a[2], a[1], a[0], b[1], b[0]]
    red.attach()
    _grad(a[0])  # not armed: not launched
    red.arm()
    _grad(a[1])  # bucket 1 ready, but bucket 0 is not launched: wait
    _grad(b[1])  # group 1's first bucket: launch
    assert launched == [3]
    _grad(a[2])  # bucket 0, then the waiting bucket 1
    assert launched == [3, 0, 1]
    red.finish(timeout=1.0, who="test", moment="step 1")  # the rest that got gradients, in bucket order; b[0] got none
    assert launched == [3, 0, 1, 2]
    assert b[0].grad is None
    red.attach()
    red.arm()  # the next step starts over
    _grad(a[2])
    assert launched[4:] == [0]


def test_gradients_live_in_the_buckets_and_accumulate_there(monkeypatch):
    red, (a,), _ = _reducer(monkeypatch, sizes=(2,))
    red.attach()
    for i, p in enumerate(a):
        _grad(p, i + 1.0)
        _grad(p, 10.0)  # a second micro-batch adds in place
    red.arm()
    red.finish(timeout=1.0, who="test", moment="step 1")  # a one-rank "sum" is the gradient itself
    assert [p.grad.tolist() for p in a] == [[11.0] * 4, [12.0] * 4]
    flats = {f.untyped_storage().data_ptr() for f in red._flat}
    assert all(p.grad.untyped_storage().data_ptr() in flats and red.holds(p.grad) for p in a)  # no second copy
    assert not red.holds(torch.ones(4))
    red.attach()  # the next step starts from zero in the same buffers
    assert all(p.grad.abs().sum() == 0 and red.holds(p.grad) for p in a)


def test_reduce_dtype_sends_the_bucket_in_that_dtype_and_writes_it_back(monkeypatch):
    red, (a,), _ = _reducer(monkeypatch, sizes=(2,))
    red.reduce_dtype = torch.bfloat16
    sent = []
    monkeypatch.setattr(groups.dist, "all_reduce", lambda flat, group, async_op, op=None: sent.append(flat) or _Done())
    red.attach()
    for p in a:
        _grad(p, 1.0 + 2**-12)  # not a bfloat16 value
    red.arm()
    red.finish(timeout=1.0, who="test", moment="step 1")
    assert [t.dtype for t in sent] == [torch.bfloat16, torch.bfloat16]
    assert all(p.grad.dtype == torch.float32 and torch.all(p.grad == 1.0) for p in a)  # rounded on the wire


def test_tied_groups_across_stages_wait_for_the_end_of_the_backward(monkeypatch):
    """A group spanning stages must not launch mid-backward: its first stage joins only after this rank's
    gradients reach it (on NCCL a launched AllReduce spins on the GPU and can block the rest of the backward)."""
    red, (a, b), launched = _reducer(monkeypatch, spans=(1,))
    red.attach()
    red.arm()
    for p in (*b, *a):  # group 1 (tied) is ready first
        _grad(p)
    assert launched == [0, 1, 2]  # only the replica group's buckets
    red.finish(timeout=1.0, who="test", moment="step 1")
    assert launched == [0, 1, 2, 3, 4]


def test_parameters_without_gradients_keep_none_and_are_not_reduced(monkeypatch):
    """As on one device, a parameter no backward reached keeps ``.grad is None`` (AdamW's weight decay then leaves
    it alone under every plan); a bucket with no gradient at all is not reduced."""
    red, (a, b), launched = _reducer(monkeypatch, spans=(1,))
    red.attach()
    _grad(a[1])  # a[0], a[2] and all of b got none
    red.arm()
    red.finish(timeout=1.0, who="test", moment="step 1")
    assert [p.grad is None for p in a] == [True, False, True] and all(p.grad is None for p in b)
    assert launched == [1]


def test_armed_with_expected_accumulations_a_bucket_waits_for_every_chunks_last(monkeypatch):
    """A rank of several chunks arms once each has at most its last accumulation left: a parameter two of its chunks
    use (tied) gets two and is final only after both; one whose chunks are done is final at once."""
    red, (a,), launched = _reducer(monkeypatch, sizes=(3,))  # buckets [a2], [a1], [a0]
    red.attach()
    _grad(a[0])  # a0's chunk runs its last backward before the others' are down to their last
    red.arm({id(a[2]): 2, id(a[1]): 1, id(a[0]): 0})  # a2 tied between two chunks, a0's chunk already done
    assert launched == []  # bucket 0 (a2) is first in launch order and not final
    _grad(a[2])
    assert launched == []  # one chunk of two has added its part
    _grad(a[1])
    assert launched == []  # bucket 1 is ready but waits behind bucket 0
    _grad(a[2])
    assert launched == [0, 1, 2]  # a2 final: it, then a1, then a0 (final since arming)
    red.finish(timeout=1.0, who="test", moment="step 1")
    assert [p.grad.tolist() for p in a] == [[1.0] * 4, [1.0] * 4, [2.0] * 4]
