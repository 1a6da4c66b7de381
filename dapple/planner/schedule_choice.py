"""schedule="auto": dapple's 1F1B or the zero-bubble schedule (zb-h1), whichever the simulator finds faster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..core.plan import Plan, Stage
from ..core.schedule import stage_holds
from .model.cost import CostModel
from .simulator.events import simulate

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.profile import Profile

AUTO = "auto"
CHOICES = ("dapple", "zb-h1")  # in order of preference on a tie: dapple holds fewer activations on later stages


def choose_schedule(profile: "Profile", cluster: "Cluster", stages: Sequence[Stage], global_batch_size: int,
                    micro_batch_size: int, *, overlap: bool, optimizer_factor: float) -> tuple[str, dict]:
    """The faster of :data:`CHOICES` for ``stages`` (their K_i set), simulated, and what was found.

    zb-h1 keeps each micro-batch's activations until its W and lets every stage hold K_0 of them
    (``core.schedule.stage_holds``): it is a candidate only where that fits in device memory on every stage.

    Args:
        profile, cluster: the model's layers and the devices.
        stages: the plan's stages, warmup K_i included.
        global_batch_size, micro_batch_size: the plan's batch sizes.
        overlap: AllReduce overlapped with the last backward, as planned.
        optimizer_factor: bytes held per parameter byte.

    Returns:
        (schedule, record): ``record["simulated_ms"]`` per candidate, ``record["refused"]`` a reason per one left
        out, ``record["chosen"]``.
    """
    cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor)
    M = global_batch_size // micro_batch_size
    holds = stage_holds([s.warmup for s in stages], M)
    simulated: dict[str, float] = {}
    refused: dict[str, str] = {}
    for name in CHOICES:
        if name == "zb-h1" and (why := holds_unfit(cm, stages, holds, cluster.device_memory)):
            refused[name] = why
            continue
        plan = Plan(global_batch_size, micro_batch_size, list(stages), schedule=name)
        simulated[name] = round(simulate(plan, profile, cluster, overlap=overlap).latency_ms, 6)
    chosen = min(simulated, key=lambda n: (simulated[n], CHOICES.index(n)))
    record: dict = {"simulated_ms": simulated, "chosen": chosen}
    if refused:
        record["refused"] = refused
    return chosen, record


def zero_bubble_unfit(profile: "Profile", cluster: "Cluster", stages: Sequence[Stage], global_batch_size: int,
                      micro_batch_size: int, optimizer_factor: float) -> str:
    """Why zb-h1 does not fit ``stages`` (their K_i set) in device memory ("" where it fits): each stage holds
    K_0 micro-batches until their W."""
    cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor)
    holds = stage_holds([s.warmup for s in stages], global_batch_size // micro_batch_size)
    return holds_unfit(cm, stages, holds, cluster.device_memory)


def holds_unfit(cm: CostModel, stages: Sequence[Stage], holds: Sequence[int], memory: float) -> str:
    """Why holding ``holds[i]`` micro-batches on stage i does not fit somewhere ("" where it fits)."""
    for i, (st, h) in enumerate(zip(stages, holds)):
        a, c = st.layers
        need = cm.static_bytes(a, c) + h * cm.saved_bytes(a, c, st.replicas)
        if need > memory:
            return (f"stage {i} would hold {h} micro-batches until their W: {need / 1e9:.3g} GB > "
                    f"{memory / 1e9:.3g} GB of device memory")
    return ""
