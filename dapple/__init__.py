"""dapple: synchronous pipelined data-parallel training for PyTorch (the DAPPLE approach)."""

from . import calibration, planner, profiler
from .autotune import Autotuner, Decision
from .calibration import calibrate
from .core.version import VERSION
from .planner import Cluster, Plan, evaluate, plan, simulate
from .profiler import Profile
from .profiler.api import profile
from .runtime import Pipeline, pipeline
from .runtime.checkpoint import load_checkpoint, load_full_state_dict, save_checkpoint
from .runtime.sharding import shard_optimizer
from .runtime.weights import load_weights

__version__ = VERSION

__all__ = ["Autotuner", "Cluster", "Decision", "Pipeline", "Plan", "Profile", "calibrate", "calibration", "evaluate",
           "load_checkpoint", "load_full_state_dict", "load_weights", "pipeline", "plan", "planner", "profile",
           "profiler", "save_checkpoint", "shard_optimizer", "simulate"]
