"""Calibration: the Profile and Cluster refit to the traced steps of a running job (compute, links, AllReduce)."""

from .api import accuracy_of, calibrate, median_step_ms, predictions
from .traces import TracedRun, traced_runs

__all__ = ["TracedRun", "accuracy_of", "calibrate", "median_step_ms", "predictions", "traced_runs"]
