"""What a plan costs: per-stage compute, split-concat transfers, AllReduce, memory, and the latency models."""
