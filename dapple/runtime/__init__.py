"""The runtime: fx stage split, split-concat P2P, the dapple, gpipe and zb-h1 schedules, pipeline engine, launcher."""

from .activations import ActivationMeter
from .checkpoint_async import AsyncSave
from .data import RankData, rank_data
from .engine import Pipeline, pipeline
from .launch import launch
from .p2p import PipelineError
from .replan import Switch
from .sampler import DistributedPipelineSampler, IndexedDataset, LoadedBatch, RankCollate, pipeline_loader
from .sharding import ShardedOptimizer, shard_optimizer
from .tracing import Trace
from .weights import LoadedWeights, load_weights

__all__ = ["ActivationMeter", "AsyncSave", "DistributedPipelineSampler", "IndexedDataset", "LoadedBatch",
           "LoadedWeights", "Pipeline", "PipelineError", "RankCollate", "RankData", "ShardedOptimizer",
           "Switch", "Trace", "launch", "load_weights", "pipeline", "pipeline_loader", "rank_data", "shard_optimizer"]
