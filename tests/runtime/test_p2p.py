"""P2P: a send that failed raises on the sender, naming the peer, whether it is reaped mid-step or at the end."""

from __future__ import annotations

import pytest
import torch

from dapple.runtime import p2p
from dapple.runtime.p2p import P2P, PipelineError
from dapple.runtime.program import Transfer


class _Work:
    """A finished send: ``ok`` or failed with gloo's error."""

    def __init__(self, ok: bool):
        self.ok = ok

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        if not self.ok:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection reset by peer")
        return True


def _p2p(monkeypatch, failing: int) -> P2P:
    """Rank 0 of a 2-stage straight pipeline whose ``failing``-th send fails (-1: none)."""
    sent = []

    def isend(tensor, dst, group):
        sent.append(dst)
        return _Work(len(sent) - 1 != failing)
    monkeypatch.setattr(p2p.dist, "isend", isend)
    return P2P(0, lambda r: r, None, None, 5.0, lambda t: "x")


def _t(mb: int) -> Transfer:
    return Transfer("act", 0, mb, 0, 0, 1, 0, 2)


@pytest.mark.parametrize("failing", [0, 9])
def test_a_failed_send_raises_on_the_sender_naming_the_peer(monkeypatch, failing):
    link = _p2p(monkeypatch, failing)
    with pytest.raises(PipelineError, match=r"^rank 0 \(stage 0\), step 0: failed sending activations of "
                                            rf"micro-batch {failing} \(x, rows 0:2\) to rank 1 \(stage 1\)"):
        for mb in range(12):  # sends beyond 8 in flight are reaped as they go
            link.send(_t(mb), torch.ones(2))
        link.finish()


def test_a_send_or_receive_that_cannot_be_posted_says_so(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(p2p.dist, "isend", refuse)
    monkeypatch.setattr(p2p.dist, "irecv", refuse)
    link = P2P(0, lambda r: r, None, None, 5.0, lambda t: "x")
    with pytest.raises(PipelineError, match=r"^rank 0 \(stage 0\), step 0: failed posting the send of activations "
                                            r"of micro-batch 1 \(x, rows 0:2\) to rank 1 \(stage 1\), timeout 5s: "
                                            r"Connection closed by peer$"):
        link.send(_t(1), torch.ones(2))
    back = Transfer("grad", 0, 1, 0, 1, 0, 0, 2)
    with pytest.raises(PipelineError, match=r"failed posting the receive of gradients of micro-batch 1 \(x, rows "
                                            r"0:2\) from rank 1 \(stage 1\)"):
        link.post_recv(back, torch.empty(2))


def test_sends_that_succeeded_are_reaped_quietly(monkeypatch):
    link = _p2p(monkeypatch, -1)
    for mb in range(12):
        link.send(_t(mb), torch.ones(2))
    assert len(link._sends) < 12  # reaped on the way
    link.finish()
    assert link._sends == []


class _Gloo:
    """A send as gloo reports it: never "completed" until waited on."""

    def __init__(self, log: list, mb: int):
        self.log, self.mb = log, mb

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        self.log.append(self.mb)
        return True


def test_sends_are_freed_once_an_answer_proves_them_delivered(monkeypatch):
    """Stage 1 of 3 (rank 1; K = 2 on stage 0): gradient sends to stage 0 and activation sends to stage 2 are
    freed during the step, as the answers come, not held to its end (memory would grow with M)."""
    waited: list = []
    monkeypatch.setattr(p2p.dist, "isend", lambda tensor, dst, group: _Gloo(waited, (dst, int(tensor[0]))))
    monkeypatch.setattr(p2p.dist, "irecv", lambda buffer, src, group: _Gloo([], None))
    link = P2P(1, lambda r: r, None, None, 5.0, lambda t: "x", ahead=lambda stage: {0: 2, 1: 1, 2: 1}[stage])
    for mb in range(6):
        link.send(Transfer("act", 1, mb, 0, 1, 2, 0, 2), torch.full((2,), float(mb)))
        link.send(Transfer("grad", 0, mb, 0, 1, 0, 0, 2), torch.full((2,), float(mb)))
    got = Transfer("grad", 1, 2, 0, 2, 1, 0, 2)  # stage 2 ran the backward of micro-batch 2
    link.post_recv(got, torch.empty(2))
    link.wait_recv(got)
    assert sorted(waited) == [(2, 0), (2, 1), (2, 2)]
    got = Transfer("act", 0, 4, 0, 0, 1, 0, 2)  # stage 0 ran F4, so (K = 2) it had run B2
    link.post_recv(got, torch.empty(2))
    link.wait_recv(got)
    assert sorted(waited) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    assert len(link._sends) == 6  # act 3-5 to stage 2, grad 3-5 to stage 0: waited at the end of the step
    link.finish()
    assert len(waited) == 12
