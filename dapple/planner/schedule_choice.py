"""schedule="auto": dapple's 1F1B or the zero-bubble schedule (zb-h1), whichever the simulator finds faster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..core.plan import Plan, Stage
from ..core.schedule import SPLIT_BACKWARD
from .model.cost import CostModel
from .model.memory import split_backward_unfit
from .simulator.events import simulate

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.profile import Profile

AUTO = "auto"
CHOICES = ("dapple", "zb-h1")  # in order of preference on a tie: dapple holds fewer activations on later stages
TIE = 1e-3  # a later choice must simulate this fraction faster than an earlier one to be taken


def settle_schedule(schedule: str, profile: "Profile", cluster: "Cluster", stages: Sequence[Stage],
                    global_batch_size: int, micro_batch_size: int, overlap: bool, optimizer_factor: float,
                    mixed_precision: str | None = None, shard_optimizer: bool = False) -> tuple[str, dict | None]:
    """plan()'s last word on the schedule of the plan it found: "auto" picks (:func:`choose_schedule`, with its
    record); a split-backward schedule asked for by name must fit in memory (ValueError naming the stage); any other
    stays as it is (record None).

    Args:
        schedule: what plan() was asked for.
        profile, cluster, stages, global_batch_size, micro_batch_size: the plan found (K_i set).
        overlap, optimizer_factor, mixed_precision, shard_optimizer: as planned.
    """
    if schedule == AUTO:
        return choose_schedule(profile, cluster, stages, global_batch_size, micro_batch_size, overlap=overlap,
                               optimizer_factor=optimizer_factor, mixed_precision=mixed_precision,
                               shard_optimizer=shard_optimizer)
    if schedule in SPLIT_BACKWARD:
        cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor,
                       mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)
        why = split_backward_unfit(cm, stages, global_batch_size // micro_batch_size, cluster.device_memory)
        if why:
            raise ValueError(f"schedule={schedule!r}: the plan found does not fit: {why}; schedule='auto' falls "
                             f"back to 'dapple' where it does not")
    return schedule, None


def choose_schedule(profile: "Profile", cluster: "Cluster", stages: Sequence[Stage], global_batch_size: int,
                    micro_batch_size: int, *, overlap: bool, optimizer_factor: float,
                    mixed_precision: str | None = None, shard_optimizer: bool = False) -> tuple[str, dict]:
    """The faster of :data:`CHOICES` for ``stages`` (their K_i set), simulated, and what was found.

    zb-h1 keeps each micro-batch's activations until its W and lets every stage hold K_0 of them
    (``core.schedule.stage_holds``; a recomputing stage runs its whole backward in B and holds its K_i): it is a
    candidate only where that fits in device memory on every stage.

    Args:
        profile, cluster: the model's layers and the devices.
        stages: the plan's stages, warmup K_i included.
        global_batch_size, micro_batch_size: the plan's batch sizes.
        overlap: AllReduce overlapped with the last backward, as planned.
        optimizer_factor: bytes held per parameter byte.
        mixed_precision: the plan's ("bf16"/"fp16"; None: full precision).
        shard_optimizer: the plan's: each stage's optimizer state sharded over its replicas (memory).

    Returns:
        (schedule, record): ``record["simulated_ms"]`` per candidate, ``record["refused"]`` a reason per one left
        out, ``record["chosen"]``.
    """
    cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor,
                   mixed_precision=mixed_precision, shard_optimizer=shard_optimizer)
    simulated: dict[str, float] = {}
    refused: dict[str, str] = {}
    M = global_batch_size // micro_batch_size
    for name in CHOICES:
        if name in SPLIT_BACKWARD and (why := split_backward_unfit(cm, stages, M, cluster.device_memory)):
            refused[name] = why
            continue
        plan = Plan(global_batch_size, micro_batch_size, list(stages), schedule=name, mixed_precision=mixed_precision)
        simulated[name] = round(simulate(plan, profile, cluster, overlap=overlap).latency_ms, 6)
    chosen = CHOICES[0]  # another must simulate TIE faster, as when the simulator judges candidates (choice.py)
    for name in CHOICES[1:]:
        if name in simulated and simulated[name] < simulated[chosen] * (1 - TIE):
            chosen = name
    record: dict = {"simulated_ms": simulated, "chosen": chosen}
    if refused:
        record["refused"] = refused
    return chosen, record
