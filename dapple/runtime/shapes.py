"""Boundary tensor shapes for a slice of n rows, inferred by meta-device propagation, cached per input shape."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..profiler.record import NodeRecorder


class Spec(NamedTuple):
    """A boundary tensor of one slice: its shape (rows first), dtype, and whether a gradient flows back."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


InputKey = tuple  # per model input: (shape without the batch dimension, dtype)


def input_key(inputs: Sequence[torch.Tensor]) -> InputKey:
    return tuple((tuple(x.shape[1:]), x.dtype) for x in inputs)


def meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers are meta tensors (same shapes, dtypes, requires_grad,
    tying): no data is copied, and the copy keeps none of the original tensors alive. Scalar buffers are
    copied to the CPU instead: modules read them on the host (BatchNorm(momentum=None) divides by
    ``float(num_batches_tracked)``, which a meta tensor cannot give)."""
    memo: dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True) if b.dim() == 0 else torch.empty_like(b, device="meta")
    return copy.deepcopy(gm, memo)


def _same(t: Any) -> Any:
    return t


class BoundaryShapes:
    """Spec of every value crossing a cut, per (input shapes, slice rows); computed once, then cached.

    The whole model runs on the meta device (no memory, no compute), so every rank derives the same shapes
    without a handshake, and a new sequence length only costs one more propagation.
    """

    def __init__(self, gm: fx.GraphModule, input_names: Sequence[str], boundary: Sequence[Sequence[str]]):
        self.gm = meta_copy(gm)
        self.input_names = list(input_names)
        self.boundary = [list(b) for b in boundary]  # per cut: value names
        self._cache: dict[tuple[InputKey, int], list[list[Spec]]] = {}

    def specs(self, key: InputKey, rows: int) -> list[list[Spec]]:
        """Per cut, per boundary value: its Spec for a slice of ``rows`` rows."""
        if (key, rows) not in self._cache:
            self._cache[(key, rows)] = self._propagate(key, rows)
        return self._cache[(key, rows)]

    def _propagate(self, key: InputKey, rows: int) -> list[list[Spec]]:
        wanted = {v for cut in self.boundary for v in cut}
        rec = NodeRecorder(self.gm, {n for n in self.gm.graph.nodes if n.name in wanted}, transform=None)
        metas = [torch.empty((rows, *shape), dtype=dtype, device="meta") for shape, dtype in key]
        # enable_grad: requires_grad tells which values carry a gradient back. Identity saved-tensor hooks
        # shield the caller's own hooks (offloading, memory meters) from these meta tensors.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            rec.run(*metas)
        values = {n.name: v for n, v in rec.values.items()}
        out = []
        for c, names in enumerate(self.boundary):
            specs = []
            for name in names:
                v = values[name]
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"value {name!r} crosses the cut after stage {c} but is a {type(v).__name__}, "
                                    f"not a tensor; only tensors can be sent between stages (move the cut, or "
                                    f"compute it in the stage that uses it)")
                if v.dim() == 0 or v.shape[0] != rows:
                    raise ValueError(f"value {name!r} crosses the cut after stage {c} with shape {tuple(v.shape)} "
                                     f"for a slice of {rows} rows; dapple splits micro-batches along dimension 0, "
                                     f"so every tensor crossing a cut must have the batch rows first")
                grad = bool(v.requires_grad and (v.is_floating_point() or v.is_complex()))
                specs.append(Spec(tuple(v.shape), v.dtype, grad))
            out.append(specs)
        return out
