"""What every planner does with the profile it plans from: never cut where the profile forbids it (``cuts.py``), and
carry the profile's tracing (``Profile.meta["tracing"]``) into the plan, for ``dapple.pipeline``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from ..core.plan import Plan
from ..core.profile import Profile
from ..core.trace_spec import TraceSpec
from .cuts import joined


def profiled(reprice: Callable[..., Any] | None = None) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """A decorator for ``planner(profile, cluster, ...) -> Plan``: a profile with uncuttable boundaries is planned
    with the layers around each joined (``cuts.joined``), and the plan mapped back onto the profile's own layers and
    names (``reprice(profile, cluster, plan, **kwargs)``, given the planner's keyword arguments, if given, makes its
    estimate from those layers); the plan carries the profile's tracing (``Plan.tracing``)."""

    def wrap(planner: Callable[..., Plan]) -> Callable[..., Plan]:
        @functools.wraps(planner)
        def planned(profile: Profile, cluster: Any, *args: Any, **kwargs: Any) -> Plan:
            j = joined(profile)
            p = planner(profile if j is None else j.profile, cluster, *args, **kwargs)
            if j is not None:
                p = dataclasses.replace(p, stages=j.original(p.stages), layer_names=list(profile.layer_names),
                                        meta={**p.meta, **profile.source()})  # (every other field as planned)
                if reprice is not None:
                    p.estimate = reprice(profile, cluster, p, **kwargs)
            tracing = profile.meta.get("tracing") if isinstance(profile, Profile) else None
            if tracing and p.tracing is None:
                p.tracing = TraceSpec.from_dict(tracing, f"the profile of {profile.model}: meta.tracing")
            return p
        return planned
    return wrap
