"""Benchmark helper: this process's resident memory (Linux /proc/self/status)."""

from __future__ import annotations


def rss() -> tuple[int, int]:
    """(resident bytes now, high-water mark) of this process."""
    kb = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if value.strip().endswith("kB"):
                kb[key] = int(value.split()[0]) * 1024
    return kb["VmRSS"], kb["VmHWM"]
