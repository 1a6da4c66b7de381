"""The Plan document: stages (layer range, devices, warmup K_i; several may share devices as chunks), micro-batching,
schedule, estimate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from . import documents
from .checks import is_int, positive_int
from .chunk_schedule import PLACEMENT_OF, ChunkOp, chunk_warmups, rank_ops
from .chunks import ChunkLayout, chunk_layout
from .plan_table import format_plan
from .schedule import (
    CHUNKED_SCHEDULES,
    SCHEDULES,
    STAGE_SCHEDULES,
    WARMUP_POLICIES,
    pipeline_stage_ops,
    validate_warmup,
    warmup_counts,
)
from .trace_spec import TraceSpec

VERSION = 1
MIXED_PRECISIONS = ("bf16", "fp16")  # a plan's mixed_precision: autocast dtype of every stage (None: full precision)
REDUCE_DTYPES = ("bf16", "fp16", "fp32")  # a plan's reduce_dtype: what gradients travel in (None: their own dtype)
FULL_PRECISION = "fp32"  # what a caller passes to run a plan made for mixed precision in full precision
# a stage's activation recomputation: none, the whole stage (True), each layer checkpointed, or selective (the
# outputs of matmuls, convolutions and attention kept, the rest recomputed)
RECOMPUTE = (False, True, "layers", "selective")
Recompute = Union[bool, str]


def recompute_value(value: Any) -> bool:
    """Whether ``value`` is one of :data:`RECOMPUTE` (True and False themselves, not 1 or 0)."""
    return value is True or value is False or (isinstance(value, str) and value in RECOMPUTE)


@dataclass
class Stage:
    """Layers ``[start, end)`` replicated on ``devices``; ``warmup`` is K_i (None: from the plan's policy, or under a
    schedule of chunks the forwards its order runs before the stage's first backward); ``recompute``: activation
    recomputation (:data:`RECOMPUTE`): True, the stage keeps only its inputs per micro-batch in flight and runs its
    forward again in the backward; "layers", it keeps every layer's inputs and recomputes one layer at a time;
    "selective", it keeps its inputs and the outputs of matmuls, convolutions and attention, and recomputes the
    rest. Stages listing the same devices are chunks of one device group (core.chunks)."""

    layers: tuple[int, int]
    devices: list[int]
    warmup: int | None = None
    recompute: Recompute = False

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)  # type: ignore[assignment]
        self.devices = list(self.devices)

    @property
    def replicas(self) -> int:
        return len(self.devices)


@dataclass
class Estimate:
    """The planner's latency model of one training iteration (paper formula 2), in milliseconds."""

    latency_ms: float
    warmup_ms: float
    steady_ms: float
    ending_ms: float
    pivot_stage: int
    details: dict = field(default_factory=dict)  # per-stage F/B/AR, bubble fraction, ... (planner-defined)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            k: (round(float(getattr(self, k)), 6) if k != "pivot_stage" else int(self.pivot_stage))
            for k in ("latency_ms", "warmup_ms", "steady_ms", "ending_ms", "pivot_stage")}
        if self.details:
            d["details"] = self.details
        return d

    @classmethod
    def from_dict(cls, f: documents.Fields) -> "Estimate":
        f.known("latency_ms", "warmup_ms", "steady_ms", "ending_ms", "pivot_stage", "details")
        return cls(latency_ms=f.number("latency_ms"), warmup_ms=f.number("warmup_ms"),
                   steady_ms=f.number("steady_ms", minimum=None), ending_ms=f.number("ending_ms", minimum=None),
                   pivot_stage=f.number("pivot_stage", integer=True), details=f.mapping("details"))


def check_stages(stages: Sequence[Stage], micro_batch_size: int, where: str) -> int:
    """ValueError naming the stage and value unless the layer ranges are half-open, non-empty and contiguous from
    0, and every stage has devices (ids >= 0, each in one device group: stages on the same devices list them alike,
    chunks in the loop or V order, core.chunks) but no more than the micro-batch has rows. Returns the number of
    layers the stages cover."""
    start = 0
    for i, s in enumerate(stages):
        lo, hi = s.layers
        if not (is_int(lo) and is_int(hi)) or lo != start or hi <= lo:
            raise ValueError(f"{where}.stages[{i}].layers: expected a non-empty range starting at layer {start} "
                             f"(ranges are half-open and contiguous from 0), got [{lo}, {hi})")
        start = hi
        if not s.devices:
            raise ValueError(f"{where}.stages[{i}].devices: expected at least one device, got []")
        if micro_batch_size < len(s.devices):
            raise ValueError(f"{where}.stages[{i}]: {len(s.devices)} replicas cannot split a micro-batch of "
                             f"{micro_batch_size} rows (each replica needs at least one row)")
        for d in s.devices:
            if not is_int(d, 0):
                raise ValueError(f"{where}.stages[{i}].devices: expected device ids >= 0, got {d!r}")
    chunk_layout([s.devices for s in stages], where)  # (raises naming the stage and device)
    return start


def check_fit(stages: Sequence[Stage], num_layers: int, num_devices: int, where: str) -> None:
    """ValueError unless ``stages`` (checked by :func:`check_stages`) cover exactly the profile's ``num_layers``
    layers and use only the cluster's devices 0..``num_devices`` - 1."""
    end = stages[-1].layers[1]
    if end != num_layers:
        raise ValueError(f"{where}: stages cover layers [0, {end}) but the profile has {num_layers} layers")
    for i, s in enumerate(stages):
        for d in s.devices:
            if d >= num_devices:
                raise ValueError(f"{where}.stages[{i}]: device {d} is not in the cluster (ids 0..{num_devices - 1})")


@dataclass
class Plan:
    """How to run a model: see docs/design.md, 'The three YAML documents'. Validated on construction."""

    global_batch_size: int
    micro_batch_size: int
    stages: list[Stage]
    schedule: str = "dapple"
    warmup_policy: str = "A"
    layer_names: list[str] | None = None
    estimate: Estimate | None = None
    meta: dict = field(default_factory=dict)  # model, cluster, planner name, planning time, ...
    mixed_precision: str | None = None  # "bf16"/"fp16": the stages run under autocast (None: full precision)
    reduce_dtype: str | None = None  # "bf16"/"fp16"/"fp32": the gradient AllReduce's dtype (None: the gradients')
    shard_optimizer: bool = False  # each stage's optimizer state sharded over its replicas (dapple.shard_optimizer)
    tracing: TraceSpec | None = None  # how the profile traced the model: dapple.pipeline traces it the same way

    def __post_init__(self) -> None:
        self.stages = [s if isinstance(s, Stage) else Stage(*s) for s in self.stages]
        self._check_batches("Plan")  # before the policy's K_i, which divide by micro_batch_size
        if all(s.warmup is None for s in self.stages):
            if self.schedule in CHUNKED_SCHEDULES:  # the order's own K_i, once the chunks are known to be in it
                self._check_chunks("Plan")
                ks = self.chunk_warmups()
            else:
                ks = warmup_counts(len(self.stages), self.num_micro_batches, self.warmup_policy)
            for s, k in zip(self.stages, ks):
                s.warmup = k
        self.validate()

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return len({d for s in self.stages for d in s.devices})

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def warmup(self) -> list[int]:
        return [int(s.warmup) for s in self.stages]  # type: ignore[arg-type]

    @property
    def shape(self) -> str:
        """The paper's notation (Tables V-VII): "DP", "straight<S>", or replicas per stage, e.g. "14:2"."""
        layout = self.chunks
        if layout.chunks > 1:  # the device groups' shape, then the chunks: "straight4 x2 V", "2:1:1 x2 loop"
            groups = [Stage((0, 1), list(ds)) for ds in layout.groups]
            base = "DP" if len(groups) == 1 else f"straight{len(groups)}" if all(
                len(g.devices) == 1 for g in groups) else ":".join(str(len(g.devices)) for g in groups)
            return f"{base} x{layout.chunks} {self.placement or layout.placements[0]}"
        if self.num_stages == 1:
            return "DP"
        if all(len(s.devices) == 1 for s in self.stages):
            return f"straight{self.num_stages}"
        return ":".join(str(len(s.devices)) for s in self.stages)

    @property
    def chunks(self) -> ChunkLayout:
        """Where the stages sit: their device groups, each group's chunks, the chunk order (core.chunks)."""
        return chunk_layout([s.devices for s in self.stages])

    @property
    def placement(self) -> str | None:
        """The chunk order the schedule runs: "loop" (interleaved-1f1b), "V" (zb-v), None (one stage per group)."""
        return PLACEMENT_OF.get(self.schedule)

    def stages_of_device(self, device: int) -> list[int]:
        """The stages ``device`` holds, in pipeline order: one, or its device group's chunks."""
        found = [i for i, s in enumerate(self.stages) if device in s.devices]
        if not found:
            raise ValueError(f"device {device} is in no stage of this plan (devices 0..{self.num_devices - 1})")
        return found

    def device_label(self, device: int) -> str:
        """``"stage 2"``, or ``"stages 0, 3"`` for a device holding several chunks (for messages)."""
        found = self.stages_of_device(device)
        return f"stage {found[0]}" if len(found) == 1 else f"stages {', '.join(map(str, found))}"

    def stage_of_device(self, device: int) -> int:
        """The stage ``device`` holds; ValueError where it holds several chunks (:meth:`stages_of_device`)."""
        found = self.stages_of_device(device)
        if len(found) > 1:
            raise ValueError(f"device {device} holds {len(found)} stages (chunks {found}): use "
                             f"Plan.stages_of_device")
        return found[0]

    def rank_ops(self, device: int) -> list[ChunkOp]:
        """The computations ``device`` runs in one training step, in order, each with its stage: the schedule's
        order of its chunks (core.chunk_schedule), or its one stage's (``core.schedule.pipeline_stage_ops``)."""
        layout = self.chunks
        group = layout.group_of_device(device)
        if self.schedule in CHUNKED_SCHEDULES:
            return rank_ops(self.schedule, self.num_micro_batches, len(layout.groups), layout.chunks, group)
        (s,) = layout.stages_of(group)
        return [ChunkOp(op.kind, op.micro_batch, s)
                for op in pipeline_stage_ops(self.schedule, self.num_micro_batches, self.warmup, s)]

    def chunk_warmups(self) -> list[int]:
        """Under a schedule of chunks, each stage's K_i as its order runs it: the forwards before its first
        backward (core.chunk_schedule.chunk_warmups)."""
        layout, ks = self.chunks, {}
        for g in range(len(layout.groups)):
            ks.update(chunk_warmups(rank_ops(self.schedule, self.num_micro_batches, len(layout.groups),
                                             layout.chunks, g)))
        return [ks[i] for i in range(self.num_stages)]

    # ---- validation ----------------------------------------------------------------------------
    def validate(self, where: str = "Plan") -> None:
        """Raise ValueError naming the offending field and value if the plan is inconsistent."""
        self._check_batches(where)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{where}.schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if self.warmup_policy not in WARMUP_POLICIES:
            raise ValueError(f"{where}.warmup_policy: expected one of {WARMUP_POLICIES}, got {self.warmup_policy!r}")
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"{where}.mixed_precision: expected one of {MIXED_PRECISIONS} or None (full precision), "
                             f"got {self.mixed_precision!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"{where}.reduce_dtype: expected one of {REDUCE_DTYPES} or None (the gradients' own "
                             f"dtype), got {self.reduce_dtype!r}")
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(f"{where}.shard_optimizer: expected True or False, got {self.shard_optimizer!r}")
        for i, s in enumerate(self.stages):
            if not recompute_value(s.recompute):
                raise ValueError(f"{where}.stages[{i}].recompute: expected one of {RECOMPUTE}, got {s.recompute!r}")
        if not self.stages:
            raise ValueError(f"{where}.stages: expected at least one stage, got none")
        start = check_stages(self.stages, self.micro_batch_size, where)
        for i, s in enumerate(self.stages):
            if s.warmup is None:
                raise ValueError(f"{where}.stages[{i}].warmup: missing while other stages give one; give K_i for "
                                 f"every stage or for none")
        ids = sorted({d for s in self.stages for d in s.devices})
        if ids != list(range(len(ids))):
            raise ValueError(f"{where}: device ids must be 0..{len(ids) - 1} (device id == global rank), got {ids}")
        if self.tracing is not None and not isinstance(self.tracing, TraceSpec):
            raise ValueError(f"{where}.tracing: expected a TraceSpec or None, got {type(self.tracing).__name__}")
        if self.layer_names is not None and len(self.layer_names) != start:
            raise ValueError(f"{where}: stages cover {start} layers but layer_names lists {len(self.layer_names)}")
        if self._check_chunks(where):
            self._check_chunk_warmups(where)
            return
        try:
            validate_warmup([s.warmup for s in self.stages], self.num_micro_batches)  # as given, not int()'d
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _check_chunks(self, where: str) -> bool:
        """ValueError unless the schedule runs the stages' chunk layout (a schedule of chunks in its own order, any
        other on one stage per device group); whether the plan has chunks."""
        layout = chunk_layout([s.devices for s in self.stages], where)
        chunked = self.schedule in CHUNKED_SCHEDULES
        if layout.chunks == 1:
            if chunked:
                raise ValueError(f"{where}.schedule: {self.schedule!r} runs several chunks per device group (stages "
                                 f"on the same devices), but each of the {self.num_stages} stage(s) has devices of "
                                 f"its own; use one of {STAGE_SCHEDULES}")
            return False
        wanted = PLACEMENT_OF.get(self.schedule)
        if wanted not in layout.placements:
            order = " or ".join(f"{p} order" for p in layout.placements)
            use = " or ".join(repr(s) for s, p in PLACEMENT_OF.items() if p in layout.placements)
            what = (f"{self.schedule!r} runs chunks in the {wanted} order" if chunked else
                    f"{self.schedule!r} runs one stage per device group")
            raise ValueError(f"{where}.schedule: {what}, but the stages are {layout.chunks} chunks per device group "
                             f"in the {order} (stages {layout.stages_of(0)} on devices {list(layout.groups[0])}); "
                             f"use {use}")
        return True

    def _check_chunk_warmups(self, where: str) -> None:
        """ValueError naming the chunk and its devices where a K_i is not the one its schedule's order runs."""
        layout = self.chunks
        for i, (s, k) in enumerate(zip(self.stages, self.chunk_warmups())):
            if s.warmup != k:
                raise ValueError(f"{where}.stages[{i}].warmup: chunk {layout.chunk_of(i)} on devices {s.devices} "
                                 f"runs K_{i} = {k} forwards before its first backward under {self.schedule}, got "
                                 f"{s.warmup!r} (leave warmup out to have it filled in)")

    def check_layers(self, names: Sequence[str], what: str = "the model") -> None:
        """Raise ValueError unless the plan was made for these layers (``names``: ``what``'s, in order): the same
        count, and the same names where the plan records them (``layer_names``)."""
        if self.num_layers != len(names):
            raise ValueError(f"plan covers {self.num_layers} layers but {what} has {len(names)}: "
                             f"{list(names)!r:.200}")
        if self.layer_names is None:
            return
        for i, (a, b) in enumerate(zip(self.layer_names, names)):
            if a != b:
                raise ValueError(f"plan.layer_names differs from {what}'s layers at index {i}: the plan has {a!r}, "
                                 f"{what} has {b!r} (was the plan made for another model, or with other "
                                 f"leaf_modules?)")

    def _check_batches(self, where: str) -> None:
        g, b = self.global_batch_size, self.micro_batch_size
        positive_int(f"{where}.global_batch_size", g)
        positive_int(f"{where}.micro_batch_size", b)
        if g % b:
            raise ValueError(f"{where}: global_batch_size {g} is not divisible by micro_batch_size {b}")

    # ---- YAML ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        doc: dict = {"dapple_plan": VERSION, "global_batch_size": self.global_batch_size,
                     "micro_batch_size": self.micro_batch_size, "schedule": self.schedule,
                     "warmup_policy": self.warmup_policy,
                     **({"mixed_precision": self.mixed_precision} if self.mixed_precision else {}),
                     **({"reduce_dtype": self.reduce_dtype} if self.reduce_dtype else {}),
                     **({"shard_optimizer": True} if self.shard_optimizer else {}),
                     "stages": [{"layers": list(s.layers), "devices": list(s.devices), "warmup": s.warmup,
                                 **({"recompute": s.recompute} if s.recompute else {})} for s in self.stages]}
        if self.layer_names is not None:
            doc["layer_names"] = list(self.layer_names)
        if self.estimate is not None:
            doc["estimate"] = self.estimate.to_dict()
        if self.tracing is not None:
            doc["tracing"] = self.tracing.to_dict()
        if self.meta:
            doc["meta"] = dict(self.meta)
        return doc

    def save(self, path: documents.PathLike) -> None:
        documents.dump(self.to_dict(), path)

    @classmethod
    def from_dict(cls, doc: dict, where: str = "Plan") -> "Plan":
        f = documents.Fields(doc, where).known("dapple_plan", "global_batch_size", "micro_batch_size", "schedule",
                                         "warmup_policy", "stages", "layer_names", "estimate", "meta",
                                         "mixed_precision", "reduce_dtype", "shard_optimizer", "tracing")

        def stage(g: documents.Fields) -> Stage:
            g.known("layers", "devices", "warmup", "recompute")
            layers = g.numbers("layers", length=2, integer=True)
            warmup = g.number("warmup", integer=True, minimum=1) if g.data.get("warmup") is not None else None
            recompute = g.data.get("recompute", False)
            if not recompute_value(recompute):
                raise documents.DocumentError(f"{g.where}.recompute: expected false, true, layers or selective, got "
                                              f"{recompute!r}")
            return Stage(layers=(layers[0], layers[1]), devices=g.numbers("devices", integer=True), warmup=warmup,
                         recompute=recompute)

        names = f.data.get("layer_names")
        if names is not None and (not isinstance(names, list) or not all(isinstance(x, str) for x in names)):
            raise documents.DocumentError(f"{where}.layer_names: expected a list of strings, got {names!r:.100}")
        estimate = Estimate.from_dict(f.sub("estimate")) if f.data.get("estimate") is not None else None
        tracing = TraceSpec.from_dict(f.data["tracing"], f"{where}.tracing") if f.data.get("tracing") else None
        try:
            return cls(global_batch_size=f.number("global_batch_size", integer=True, minimum=1),
                       micro_batch_size=f.number("micro_batch_size", integer=True, minimum=1),
                       stages=f.each("stages", stage), schedule=f.str("schedule", default="dapple"),
                       warmup_policy=str(f.data.get("warmup_policy", "A")), layer_names=names, estimate=estimate,
                       meta=f.mapping("meta"), mixed_precision=f.data.get("mixed_precision"),
                       reduce_dtype=f.data.get("reduce_dtype"), shard_optimizer=f.data.get("shard_optimizer", False),
                       tracing=tracing)
        except documents.DocumentError:
            raise
        except ValueError as e:
            raise documents.DocumentError(str(e).replace("Plan", where, 1)) from e

    @classmethod
    def load(cls, path: documents.PathLike) -> "Plan":
        return cls.from_dict(documents.load(path, "dapple_plan", VERSION), where=str(path))

    def precision(self, given: str | None = None) -> str | None:
        """The autocast dtype to run the plan with: ``given`` ("bf16", "fp16", or "fp32" for full precision), or
        None for the plan's own ``mixed_precision``. Returns "bf16", "fp16" or None (full precision).

        Raises:
            ValueError: ``given`` is none of those (naming it).
        """
        if given is None:
            return self.mixed_precision
        if given == FULL_PRECISION:
            return None
        if given not in MIXED_PRECISIONS:
            raise ValueError(f"mixed_precision: expected one of {MIXED_PRECISIONS}, {FULL_PRECISION!r} (full "
                             f"precision) or None (as the plan says), got {given!r}")
        return given

    # ---- display -------------------------------------------------------------------------------
    def __str__(self) -> str:
        return format_plan(self)

