"""Per-rank communication programs (recv posts, computations, sends) and a deadlock-checking dry run."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence, Union

import torch

from ..core.chunk_schedule import ChunkOp
from ..core.plan import Plan
from ..core.schedule import Op, pipeline_stage_ops
from ..core.split_concat import Route, routes

AnyOp = Union[Op, ChunkOp]  # a rank of one stage runs Ops; a rank of several chunks ChunkOps (their stage named)

LOOKAHEAD = 1  # receives are posted for the current op and the next one, so transfers overlap compute


def receive_lookahead(device: torch.device) -> int:
    """How many ops ahead a rank posts its receives: :data:`LOOKAHEAD` where a receive waits on the host (gloo),
    none on CUDA.

    There a posted NCCL receive is a kernel that spins until its data comes, and a lazily loaded kernel
    (CUDA_MODULE_LOADING=LAZY, torch's default) or a host sync of the same rank waits for it; if the data depends
    on work the rank has yet to launch (stage 0's first forward, with micro-batch 0's gradient receive posted
    before it), that is a deadlock. Just in time, the receive is waited on as soon as it is posted
    (torch.distributed.pipelining does the same); sends still go out as soon as they are made.
    """
    return 0 if device.type == "cuda" else LOOKAHEAD


class Transfer(NamedTuple):
    """One message: rows ``[start, end)`` of boundary value ``value`` at cut ``cut`` for one micro-batch.

    ``kind`` "act" goes forward from stage ``cut`` to stage ``cut + 1``; "grad" is its gradient, going back.
    ``src``/``dst`` are global ranks; ``rows`` is what both sides size their buffers from. Between two chunks of one
    device group ``src == dst``: a hand-off on the rank (:attr:`local`), not a message.
    """

    kind: str
    cut: int
    micro_batch: int
    value: int
    src: int
    dst: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def channel(self) -> tuple[int, int, str]:
        return (self.src, self.dst, self.kind)

    @property
    def local(self) -> bool:
        """Between two chunks on the same rank: the tensor itself is handed over, nothing crosses a link."""
        return self.src == self.dst


class Instr(NamedTuple):
    """One step of a rank's program: ``"recv"`` (post an irecv), ``"compute"`` (wait its recvs, run op),
    ``"send"`` (post an isend)."""

    action: str
    op: AnyOp | None = None
    transfer: Transfer | None = None

    def __str__(self) -> str:
        return f"{self.action} {self.op}" if self.action == "compute" else f"{self.action} {self.transfer}"

    @property
    def compute_op(self) -> AnyOp:
        """The op of a "compute" instruction."""
        if self.op is None:
            raise ValueError(f"a {self.action!r} instruction has no op: {self}")
        return self.op

    @property
    def message(self) -> Transfer:
        """The transfer of a "recv" or "send" instruction."""
        if self.transfer is None:
            raise ValueError(f"a {self.action!r} instruction has no transfer: {self}")
        return self.transfer


@dataclass(frozen=True)
class BoundaryLayout:
    """Which boundary values cross each cut, for one input shape: what a rank's transfers are made of.

    Cut c lies between stage c and stage c + 1. ``values[c]`` boundary values go forward across it (indices
    into ``StageGraph.send`` of stage c); ``grads[c]`` are the indices, among those, of the values whose
    gradient comes back (floating-point tensors that require grad). Not to be confused with the placement of
    ranks on servers (``validate.layout_mismatch``).
    """

    values: tuple[int, ...]  # per cut: number of boundary values
    grads: tuple[tuple[int, ...], ...]  # per cut: indices of values whose gradient is sent back
    whole: tuple[tuple[int, ...], ...] = ()  # per cut: indices of values sent whole (shapes.Spec.whole); () none

    def carried(self, c: int, first: bool, grads: bool = False) -> list[int]:
        """The values (or, with ``grads``, the gradients) a route across cut ``c`` carries: a whole value only on the
        ``first`` route into each receiver (from the sender holding its first row), which sums the gradients of
        the receivers it serves."""
        values = self.grads[c] if grads else range(self.values[c])
        whole = self.whole[c] if self.whole else ()
        return [v for v in values if first or v not in whole]


def cut_routes(plan: Plan, c: int) -> Iterator[tuple[Route, int, int]]:
    """The split-concat routes across the cut after stage c, each with its sender's and receiver's global rank."""
    src_ranks, dst_ranks = plan.stages[c].devices, plan.stages[c + 1].devices
    for r in routes(plan.micro_batch_size, len(src_ranks), len(dst_ranks)):
        yield r, src_ranks[r.src], dst_ranks[r.dst]


def first_routes(plan: Plan, c: int) -> set[Route]:
    """The first route into each receiver of cut ``c`` (from the sender holding its first row): the ones that carry
    values sent whole (:attr:`BoundaryLayout.whole`)."""
    firsts: dict[int, Route] = {}
    for r, _, _ in cut_routes(plan, c):
        firsts.setdefault(r.dst, r)  # routes come by sender, then receiver: a receiver's lowest rows first
    return set(firsts.values())


def op_stage(plan: Plan, rank: int, op: AnyOp) -> int:
    """The stage ``op`` runs on: its own (a chunk's op), or ``rank``'s one stage."""
    return op.stage if isinstance(op, ChunkOp) else plan.stage_of_device(rank)


def op_transfers(plan: Plan, layout: BoundaryLayout, rank: int, op: AnyOp) -> tuple[list[Transfer], list[Transfer]]:
    """(receives, sends) of ``rank`` for one op, in posting order: by route (sender, then receiver), then value.

    F receives activations from the previous stage and sends its own on (split-concat, paper V-B2); B receives
    the gradients of what it sent and sends those of what it received, back along the same routes. A
    weight-gradient op (W) moves nothing: its B already sent the input gradients. Between chunks of one device
    group every route is the rank's own (:attr:`Transfer.local`)."""
    if op.kind == "W":
        return [], []
    s = op_stage(plan, rank, op)
    me = plan.stages[s].devices.index(rank)
    grads = op.kind != "F"
    before = _cut_transfers(plan, layout, s - 1, op.micro_batch, me, grads, False) if s > 0 else []
    after = _cut_transfers(plan, layout, s, op.micro_batch, me, grads, True) if s < plan.num_stages - 1 else []
    return (after, before) if grads else (before, after)


def _cut_transfers(plan: Plan, layout: BoundaryLayout, c: int, j: int, me: int, grads: bool, sender: bool
                   ) -> list[Transfer]:
    """Micro-batch ``j``'s activations (or, with ``grads``, gradients) across cut ``c`` on the routes of replica
    ``me``, the sending stage's replica if ``sender`` else the receiving one's."""
    firsts = first_routes(plan, c)
    out = []
    for r, src, dst in cut_routes(plan, c):
        if (r.src if sender else r.dst) == me:
            ends = (dst, src) if grads else (src, dst)
            out += [Transfer("grad" if grads else "act", c, j, v, *ends, r.start, r.end)
                    for v in layout.carried(c, r in firsts, grads)]
    return out


def rank_program(plan: Plan, layout: BoundaryLayout, rank: int, lookahead: int = LOOKAHEAD) -> list[Instr]:
    """The exact sequence of posts and computations ``rank`` runs in one training step.

    Computations follow ``pipeline_stage_ops(plan.schedule, M, plan.warmup, stage)`` (Ops), or on a rank of several
    chunks ``plan.rank_ops(rank)`` (ChunkOps). Receives of op t+``lookahead`` are posted before op t computes (irecv
    early); sends are posted right after the op that produced them and never waited on before the end of the step,
    so only receives can block.
    """
    if plan.chunks.chunks > 1:
        ops: list[AnyOp] = list(plan.rank_ops(rank))
    else:
        ops = list(pipeline_stage_ops(plan.schedule, plan.num_micro_batches, plan.warmup, plan.stage_of_device(rank)))
    return _program(plan, layout, rank, ops, lookahead)


def forward_program(plan: Plan, layout: BoundaryLayout, rank: int, micro_batches: int,
                    lookahead: int = LOOKAHEAD) -> list[Instr]:
    """``rank``'s program for a forward-only pass (evaluation) of ``micro_batches`` micro-batches: each forward
    in order (with several chunks: each micro-batch through them in pipeline order, which every rank follows, so
    none waits on one that waits on it), its activations received and sent as in a training step, no backward."""
    stages = plan.stages_of_device(rank)
    if len(stages) == 1:
        ops: list[AnyOp] = [Op("F", j) for j in range(micro_batches)]
    else:
        ops = [ChunkOp("F", j, s) for j in range(micro_batches) for s in stages]
    return _program(plan, layout, rank, ops, lookahead)


def _program(plan: Plan, layout: BoundaryLayout, rank: int, ops: list[AnyOp], lookahead: int) -> list[Instr]:
    per_op = [op_transfers(plan, layout, rank, op) for op in ops]
    prog: list[Instr] = []
    posted = 0
    for t, op in enumerate(ops):
        while posted < len(ops) and posted <= t + lookahead:
            prog += [Instr("recv", transfer=x) for x in per_op[posted][0]]
            posted += 1
        prog.append(Instr("compute", op=op))
        prog += [Instr("send", transfer=x) for x in per_op[t][1]]
    return prog


def format_program(program: Sequence[Instr]) -> str:
    """A rank's program, one instruction a line: ``F3``/``B3``/``W3`` computations, then posts such as
    ``recv act1 v0 0->2 rows 0:2`` (kind and micro-batch, boundary value, sender->receiver, rows of the slice)."""
    lines = []
    for i in program:
        if i.action == "compute":
            lines.append(str(i.op))
        else:
            t = i.message
            lines.append(f"  {i.action} {t.kind}{t.micro_batch} v{t.value} {t.src}->{t.dst} rows {t.start}:{t.end}")
    return "\n".join(lines)


def op_receives(program: Sequence[Instr], rank: int, plan: Plan, layout: BoundaryLayout
                ) -> dict[AnyOp, list[Transfer]]:
    """For each compute of ``program``, the receives it waits for."""
    return {i.compute_op: op_transfers(plan, layout, rank, i.compute_op)[0] for i in program if i.action == "compute"}


class CommError(RuntimeError):
    """Per-rank programs that do not match pairwise or that would deadlock."""


def dry_run(plan: Plan, layout: BoundaryLayout, programs: dict[int, list[Instr]] | None = None) -> int:
    """Play every rank's program without processes; return the number of rounds, or raise CommError.

    Checks that on every channel (sender, receiver, kind) the sender's sends and the receiver's receives
    are the same messages in the same order with the same row counts, and that the ranks can all finish
    when a receive completes only once its matching send was posted (gloo semantics; as each channel is
    matched in order, also NCCL's in-order pairing). A rank's hand-offs between its own chunks are a channel
    from it to itself: each is made before the op that takes it runs.
    """
    ranks = range(plan.num_devices)
    progs = programs if programs is not None else {r: rank_program(plan, layout, r) for r in ranks}
    sent = _matched_channels(progs)
    waits = {r: op_receives(progs[r], r, plan, layout) for r in ranks}
    return _play(ranks, progs, sent, waits)


def _matched_channels(progs: dict[int, list[Instr]]) -> dict[tuple, list[Transfer]]:
    """Every channel's sends, in order; CommError unless each matches its receiver's receives one for one."""
    sent: dict[tuple, list[Transfer]] = defaultdict(list)
    recv: dict[tuple, list[Transfer]] = defaultdict(list)
    for r, prog in progs.items():
        for ins in prog:
            if ins.action == "send":
                t = ins.message
                if t.src != r:
                    raise CommError(f"rank {r} posts a send from rank {t.src}: {t}")
                sent[t.channel].append(t)
            elif ins.action == "recv":
                t = ins.message
                if t.dst != r:
                    raise CommError(f"rank {r} posts a receive for rank {t.dst}: {t}")
                recv[t.channel].append(t)
    for ch in sorted(set(sent) | set(recv)):
        a, b = sent.get(ch, []), recv.get(ch, [])
        for k in range(max(len(a), len(b))):
            x = a[k] if k < len(a) else None
            y = b[k] if k < len(b) else None
            if x != y:
                raise CommError(f"channel {ch[0]}->{ch[1]} ({ch[2]}): message {k} is {x} at the sender but {y} "
                                f"at the receiver")
    return sent


def _play(ranks: Sequence[int], progs: dict[int, list[Instr]], sent: dict[tuple, list[Transfer]],
          waits: dict[int, dict[AnyOp, list[Transfer]]]) -> int:
    """Run the programs in rounds, a compute waiting until its receives' sends were posted; the rounds taken,
    or CommError when every unfinished rank waits."""
    position = {x: k for ch, xs in sent.items() for k, x in enumerate(xs)}  # each transfer's place in its channel
    done_sends: dict[tuple, int] = defaultdict(int)  # sends posted so far, per channel
    pc = {r: 0 for r in ranks}
    rounds = 0
    while any(pc[r] < len(progs[r]) for r in ranks):
        rounds += 1
        progress = False
        for r in ranks:
            prog = progs[r]
            while pc[r] < len(prog):
                ins = prog[pc[r]]
                if ins.action == "compute" and any(done_sends[x.channel] <= position[x]
                                                   for x in waits[r][ins.compute_op]):
                    break
                if ins.action == "send":
                    done_sends[ins.message.channel] += 1
                pc[r] += 1
                progress = True
        if not progress:
            stuck = {r: str(progs[r][pc[r]]) for r in ranks if pc[r] < len(progs[r])}
            raise CommError(f"deadlock: every unfinished rank waits on a receive nobody will send: {stuck}")
    return rounds
