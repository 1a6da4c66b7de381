"""How the simulator splits a stage's backward into input-gradient (B) and weight-gradient (W) time."""

from __future__ import annotations

# Share of a layer's backward that computes its weight gradients (W of a split backward), where the profile does
# not say: for a Linear the two halves are matmuls of the same size.
WEIGHT_SHARE = 0.5


def split_backward(stage: int, backward_ms: float, share: float | None = None) -> tuple[float, float]:
    """(B, W) ms of a stage's split backward of ``backward_ms`` in all: the first stage has no input gradients to
    compute (the runtime runs its whole backward in W); any other's W takes ``share`` of it (the profile's measured
    ``Profile.weight_share`` of its layers; None: :data:`WEIGHT_SHARE`), B the rest."""
    if stage == 0:
        return 0.0, backward_ms
    w = backward_ms * (WEIGHT_SHARE if share is None else share)
    return backward_ms - w, w
