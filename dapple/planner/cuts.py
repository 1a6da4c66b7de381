"""Boundaries no plan may cut (``Profile.uncuttable``): the planners search a profile in which the layers on both
sides of each are one layer, and their plan is mapped back onto the profile's own layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.plan import Stage
from ..core.profile import OPTIONAL, LayerProfile, Profile


@dataclass(frozen=True)
class Joined:
    """A profile whose uncuttable boundaries are inside layers: ``starts[g]`` is the original index of joined layer
    ``g``'s first layer (``starts[-1]``: the number of original layers)."""

    profile: Profile
    starts: list[int]

    def original(self, stages: Sequence[Stage]) -> list[Stage]:
        """``stages`` over the joined layers, as stages over the original ones."""
        return [Stage((self.starts[s.layers[0]], self.starts[s.layers[1]]), s.devices, s.warmup, s.recompute)
                for s in stages]


def joined(profile: Profile) -> Joined | None:
    """``profile`` with the layers around each uncuttable boundary joined into one (their times and bytes summed,
    the call cost counted once; the boundary bytes of the last); None where every boundary may be cut."""
    if not isinstance(profile, Profile) or not profile.uncuttable:
        return None
    starts = [0] + [i + 1 for i, layer in enumerate(profile.layers[:-1]) if layer.cuttable] + [profile.num_layers]
    group = {i: g for g in range(len(starts) - 1) for i in range(starts[g], starts[g + 1])}
    layers = [_join(profile, list(range(starts[g], starts[g + 1])), group, g) for g in range(len(starts) - 1)]
    meta = {**profile.meta, "joined_layers": [[profile.layers[a].name, profile.layers[b - 1].name]
                                              for a, b in zip(starts, starts[1:]) if b - a > 1]}
    out = Profile(model=profile.model, device=profile.device, batch_sizes=list(profile.batch_sizes), layers=layers,
                  meta=meta, call_ms=list(profile.call_ms))
    return Joined(out, starts)


def _join(profile: Profile, members: list[int], group: dict[int, int], g: int) -> LayerProfile:
    """One layer doing what layers ``members`` do (``group``: original layer -> joined layer)."""
    layers = [profile.layers[i] for i in members]
    extra = len(layers) - 1  # each layer's times include the call cost, which the joined layer pays once
    f0, b0 = profile.call_ms

    def summed(key: str, call: float) -> list[float]:
        return [max(0.0, sum(v) - extra * call) for v in zip(*(getattr(x, key) for x in layers))]

    inputs = {group[j] for i, x in zip(members, layers)
              for j in (x.inputs if x.inputs is not None else [i - 1] if i else [])} - {g}
    measured = {key: summed(key, 0.0) if all(getattr(x, key) is not None for x in layers) else None for key in OPTIONAL}
    return LayerProfile(name=f"{layers[0].name}..{layers[-1].name}" if extra else layers[0].name,
                        forward_ms=summed("forward_ms", f0), backward_ms=summed("backward_ms", b0),
                        boundary_bytes=list(layers[-1].boundary_bytes), saved_bytes=summed("saved_bytes", 0.0),
                        param_bytes=sum(x.param_bytes for x in layers), inputs=sorted(inputs),
                        weight_ms=measured["weight_ms"], selective_bytes=measured["selective_bytes"],
                        selective_ms=measured["selective_ms"])


def check_cuts(profile: Profile, stages: Sequence[Stage], where: str) -> None:
    """ValueError naming the layers if a stage boundary falls where the profile says no plan may cut."""
    bad = set(profile.uncuttable)
    for i, s in enumerate(stages[:-1]):
        k = s.layers[1] - 1
        if k in bad:
            names = profile.layer_names
            why = profile.meta.get("uncuttable", {}).get(names[k], "what crosses it can be neither split nor sent "
                                                                   "whole")
            raise ValueError(f"{where}: stage {i} ends after layer {k} ({names[k]!r}), before {names[k + 1]!r}, but "
                             f"no plan may cut there: {why}")
