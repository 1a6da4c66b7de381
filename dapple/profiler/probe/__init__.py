"""Measuring the cluster: link latency and bandwidth, how links are shared, and clock offsets between ranks."""
