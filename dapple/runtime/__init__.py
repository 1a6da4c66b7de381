"""The runtime: fx stage split, split-concat P2P, dapple/gpipe schedules, pipeline engine, local launcher."""

from .activations import ActivationMeter
from .autotune import Autotuner, Decision
from .data import RankData, rank_data
from .engine import Pipeline, pipeline
from .launch import launch
from .p2p import PipelineError
from .replan import Switch
from .sampler import DistributedPipelineSampler, IndexedDataset, LoadedBatch, RankCollate, pipeline_loader
from .tracing import Trace
from .weights import LoadedWeights, load_weights

__all__ = ["ActivationMeter", "Autotuner", "Decision", "DistributedPipelineSampler", "IndexedDataset", "LoadedBatch",
           "LoadedWeights", "Pipeline", "PipelineError", "RankCollate", "RankData", "Switch", "Trace", "launch",
           "load_weights", "pipeline", "pipeline_loader", "rank_data"]
