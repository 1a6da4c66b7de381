"""Split-concat send/recv of activations and gradients between replicated stages: non-blocking, bounded waits."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..core.dist import PipelineError, first_line
from .program import Transfer

__all__ = ["P2P", "PipelineError"]

WHAT = {"act": "activations", "grad": "gradients"}


class P2P:
    """Posts and waits on one rank's transfers.

    Activations and gradients travel on two different process groups, so each direction between a pair
    of ranks is its own in-order channel (on NCCL a pair's sends and receives of one group share a stream;
    keeping directions apart means a posted receive never sits in front of a send the peer waits for). A transfer
    between two chunks of this rank (``Transfer.local``) is a hand-off: the tensor itself, kept until it is taken.
    ``stage_of(rank)`` is a rank's stage (an int) or where it is ("stage 2", "stages 1, 6": Plan.device_label), for
    messages.
    """

    def __init__(self, rank: int, stage_of: Callable[[int], object], act_group: dist.ProcessGroup | None,
                 grad_group: dist.ProcessGroup | None, timeout: float, value_name: Callable[[Transfer], str],
                 ahead: Callable[[int], int | None] = lambda stage: None):
        self.rank, self.stage_of, self.timeout = rank, stage_of, timeout
        self.groups = {"act": act_group, "grad": grad_group}
        self.value_name = value_name
        # per stage: how many forwards it runs before the backward of a micro-batch (K_i, early backward), or None
        # (all forwards first): what a received activation tells of the gradients that stage already took
        self.ahead = ahead
        self.step = 0
        self._recvs: dict[Transfer, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: list[tuple[Transfer, dist.Work, torch.Tensor]] = []
        self._handed: dict[Transfer, torch.Tensor] = {}  # hand-offs between this rank's chunks, until taken
        self.rec: Any = None  # a tracing.Recorder while tracing, else None

    # ---- receives -----------------------------------------------------------------------------
    def post_recv(self, t: Transfer, buffer: torch.Tensor) -> None:
        try:
            work = dist.irecv(buffer, src=t.src, group=self.groups[t.kind])
        except Exception as e:
            raise self._error(t, t.src, "posting the receive of", e) from e
        self._recvs[t] = (_handle(work, t, "receive"), buffer)
        if self.rec is not None:
            self.rec.posted[t] = self.rec.clock()

    def wait_recv(self, t: Transfer) -> torch.Tensor:
        if t.local:
            return self._take(t)
        work, buffer = self._recvs.pop(t)
        rec = self.rec
        start = rec.clock() if rec is not None else 0.0
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            raise self._error(t, t.src, "waiting for", e) from e
        if rec is not None:
            rec.transfer("recv", t, buffer.numel() * buffer.element_size(), start, rec.clock())
        self._reap_answered(t)
        return buffer

    # ---- sends --------------------------------------------------------------------------------
    def send(self, t: Transfer, tensor: torch.Tensor) -> None:
        if t.local:  # to a chunk of this rank: the tensor itself (the sender detached it), no copy, no link
            self._handed[t] = tensor
            return
        rec = self.rec
        start = rec.clock() if rec is not None else 0.0
        tensor = tensor.detach().contiguous()
        try:
            work = dist.isend(tensor, dst=t.dst, group=self.groups[t.kind])
        except Exception as e:
            raise self._error(t, t.dst, "posting the send of", e) from e
        self._sends.append((t, _handle(work, t, "send"), tensor))
        if rec is not None:
            rec.transfer("send", t, tensor.numel() * tensor.element_size(), start, rec.clock())
        self._reap()

    def _take(self, t: Transfer) -> torch.Tensor:
        """A hand-off from a chunk of this rank; PipelineError if that chunk has not made it (the program runs
        the chunk that makes it first: ``program.dry_run`` checks every order)."""
        tensor = self._handed.pop(t, None)
        if tensor is None:
            raise PipelineError(f"rank {self.rank} ({self._place(self.rank)}), step {self.step}: the "
                                f"{WHAT[t.kind]} of micro-batch {t.micro_batch} ({self.value_name(t)}) between its "
                                f"stages {t.cut} and {t.cut + 1} are taken before they were made")
        return tensor

    def _reap_answered(self, got: Transfer) -> None:
        """Forget the sends that message ``got`` proves delivered, so their tensors are freed during the step (a
        gloo send reports itself complete only once waited on; holding every send to the step's end grew memory
        with the number of micro-batches). The peer sent ``got`` only after receiving them:

        - a gradient of micro-batch j from the next stage: it ran the backward of j, so it had received the
          activations of every micro-batch up to j (across the same cut: a peer holding several chunks takes each
          cut's activations in its own order);
        - an activation of micro-batch j from the previous stage, which runs K forwards ahead of its backwards
          (early backward): it had run the backward of j - K, so it had received its gradients up to j - K.
        """
        keep = []
        for sent in self._sends:
            t, work, _ = sent
            if self._delivered(t, got):
                self._check_sent(t, work)  # delivered: returns at once (or raises what failed it)
            else:
                keep.append(sent)
        self._sends = keep

    def _delivered(self, sent: Transfer, got: Transfer) -> bool:
        """Whether receiving ``got`` proves that the peer already received ``sent`` (see :meth:`_reap_answered`)."""
        if sent.dst != got.src or sent.cut != got.cut:
            return False
        if got.kind == "grad":
            return sent.kind == "act" and sent.micro_batch <= got.micro_batch
        k = self.ahead(got.cut)  # the K of the stage that sent the activation
        return k is not None and sent.kind == "grad" and sent.micro_batch <= got.micro_batch - k

    def _reap(self) -> None:
        """Forget sends that completed, so their buffers can be freed; a send that failed raises here."""
        if len(self._sends) > 8:
            done = [s for s in self._sends if s[1].is_completed()]
            self._sends = [s for s in self._sends if not s[1].is_completed()]
            for t, work, _ in done:
                self._check_sent(t, work)

    def _check_sent(self, t: Transfer, work: dist.Work) -> None:
        """Raise PipelineError naming the peer unless ``work`` (a send of ``t``) succeeded; waits at most the
        timeout (a completed send returns at once, or raises what failed it)."""
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:
            raise self._error(t, t.dst, "sending", e) from e

    def finish(self) -> None:
        """Wait for every send of the step (the receivers have posted them all by the end of their step)."""
        sends, self._sends = self._sends, []
        for t, work, _ in sends:
            self._check_sent(t, work)
        left = [*self._recvs, *self._handed]
        self._handed = {}
        if left:  # cannot happen with a well-formed program; never leave receives dangling silently
            what = sorted(f"{t.kind} of micro-batch {t.micro_batch} from rank {t.src}" for t in left)
            raise PipelineError(f"rank {self.rank} ({self._place(self.rank)}), step {self.step}: "
                                f"{len(what)} receives were posted but never waited on: {what[:4]}")

    # ---- errors -------------------------------------------------------------------------------
    def _place(self, rank: int) -> str:
        """"stage 2" (or "stages 1, 6", a rank of chunks): where ``rank`` is, for messages."""
        where = self.stage_of(rank)
        return f"stage {where}" if isinstance(where, int) else str(where)

    def _error(self, t: Transfer, peer: int, doing: str, e: BaseException) -> PipelineError:
        text = first_line(e)
        cause = "timed out" if "imeout" in text or "imed out" in text else "failed"
        what = (f"{WHAT[t.kind]} of micro-batch {t.micro_batch} ({self.value_name(t)}, rows {t.start}:{t.end})"
                if t.micro_batch >= 0 else f"the {t.kind} channel check (before the first step)")
        return PipelineError(
            f"rank {self.rank} ({self._place(self.rank)}), step {self.step}: {cause} {doing} {what} "
            f"{'from' if peer == t.src else 'to'} rank {peer} ({self._place(peer)}), timeout "
            f"{self.timeout:g}s: {text}")


def _handle(work: dist.Work | None, t: Transfer, what: str) -> dist.Work:
    """What ``dist.isend``/``dist.irecv`` returned: a handle, None only on a rank outside the group."""
    if work is None:
        raise RuntimeError(f"posting the {what} of {t}: this rank is not in the {t.kind!r} group")
    return work
