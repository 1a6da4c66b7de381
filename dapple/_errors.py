"""Errors shared by the parts that talk over torch.distributed (profiler probes, runtime)."""


class PipelineError(RuntimeError):
    """A transfer or collective failed or timed out; the message names the rank, stage, peer and micro-batch."""
