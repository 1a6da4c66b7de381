"""The runtime: fx stage split, split-concat P2P, the dapple, gpipe and zb-h1 schedules, pipeline engine, launcher."""

from .activations import ActivationMeter
from .data import RankData, rank_data
from .engine import Pipeline, pipeline
from .launch import launch
from .p2p import PipelineError
from .sampler import DistributedPipelineSampler, IndexedDataset, LoadedBatch, RankCollate, pipeline_loader
from .tracing import Trace

__all__ = ["ActivationMeter", "DistributedPipelineSampler", "IndexedDataset", "LoadedBatch", "Pipeline",
           "PipelineError", "RankCollate", "RankData", "Trace", "launch", "pipeline", "pipeline_loader", "rank_data"]
