"""The runtime: fx stage split, split-concat P2P, dapple/gpipe schedules, pipeline engine, local launcher."""

from .comm import PipelineError
from .engine import Pipeline, pipeline
from .launch import launch
from .memory import ActivationMeter
from .tracing import Trace

__all__ = ["ActivationMeter", "Pipeline", "PipelineError", "Trace", "launch", "pipeline"]
