"""The runtime: fx stage split, split-concat P2P, dapple/gpipe schedules, pipeline engine, local launcher."""

from .activations import ActivationMeter
from .engine import Pipeline, pipeline
from .launch import launch
from .p2p import PipelineError
from .tracing import Trace

__all__ = ["ActivationMeter", "Pipeline", "PipelineError", "Trace", "launch", "pipeline"]
