"""Type checks of the planner's entry points (the counts and numbers are in dapple.core.checks)."""

from __future__ import annotations

from typing import Any

from ..core.cluster import Cluster
from ..core.profile import Profile


def instance(where: str, name: str, value: Any, cls: type) -> None:
    """Raise TypeError unless ``value`` is a ``cls`` (e.g. a path given where a loaded Profile belongs)."""
    if not isinstance(value, cls):
        hint = f"; load it first with {cls.__name__}.load(...)" if isinstance(value, str) else ""
        raise TypeError(f"{where}: {name} must be a dapple {cls.__name__}, got {type(value).__name__} "
                        f"{value!r:.60}{hint}")


def profile_and_cluster(where: str, profile: Any, cluster: Any) -> None:
    """:func:`instance` for the (profile, cluster) pair every planner entry point takes."""
    instance(where, "profile", profile, Profile)
    instance(where, "cluster", cluster, Cluster)
