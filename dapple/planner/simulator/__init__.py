"""The event simulator that judges plans: the runtime's op order per device, links, AllReduce, Gantt charts."""

from .events import SimResult, from_simulation, simulate

__all__ = ["SimResult", "from_simulation", "simulate"]
