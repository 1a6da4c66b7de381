"""Argument checks shared by the planner's entry points: errors name the argument, its value, what was expected."""

from __future__ import annotations

from typing import Any


def positive_int(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an int >= 1 (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def non_negative_int(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an int >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")


def number(name: str, value: Any, *, positive: bool = False) -> None:
    """Raise ValueError unless ``value`` is a real number >= 0 (> 0 with ``positive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: expected a {'positive' if positive else 'non-negative'} number, got {value!r}")


def instance(where: str, name: str, value: Any, cls: type) -> None:
    """Raise TypeError unless ``value`` is a ``cls`` (e.g. a path given where a loaded Profile belongs)."""
    if not isinstance(value, cls):
        hint = f"; load it first with {cls.__name__}.load(...)" if isinstance(value, str) else ""
        raise TypeError(f"{where}: {name} must be a dapple {cls.__name__}, got {type(value).__name__} "
                        f"{value!r:.60}{hint}")


def profile_and_cluster(where: str, profile: Any, cluster: Any) -> None:
    """:func:`instance` for the (profile, cluster) pair every planner entry point takes."""
    from ..profiler.profile import Profile
    from .cluster import Cluster

    instance(where, "profile", profile, Profile)
    instance(where, "cluster", cluster, Cluster)
