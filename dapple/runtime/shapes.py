"""Boundary tensor shapes for a slice of n rows, inferred by meta-device propagation, cached per input shape."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple, Sequence, cast

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from ..core.dist import first_line
from ..profiler.boundary import WHOLE, data_dependent, shape_of, value_kind, why_not
from ..profiler.export_graph import retarget_devices


class Spec(NamedTuple):
    """A boundary tensor of one slice: its shape (rows first), dtype, whether a gradient flows back, and whether it
    is whole: without batch rows (a position bias made from parameters and sizes), the same tensor for any rows,
    sent whole to every replica of the next stage."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    whole: bool = False


PROBE = (2, 3)  # slice rows at which every boundary value's shape is seen, to tell batch rows from a whole tensor


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
        if b.dim() == 0:  # one of a meta-device model's other stages has no value to copy: zero stands in
            memo[id(b)] = torch.zeros((), dtype=b.dtype) if b.is_meta else b.detach().to("cpu", copy=True)
        else:
            memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(gm, memo)


def _same(t: Any) -> Any:
    return t


def _on_host(t: Any) -> Any:
    """A meta tensor as zeros on the CPU (same shape, dtype, requires_grad); anything else as it is."""
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    z = torch.zeros(t.shape, dtype=t.dtype)
    return z.requires_grad_() if t.requires_grad and (z.is_floating_point() or z.is_complex()) else z


def _as_meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    m = torch.empty_like(t, device="meta")
    return m.requires_grad_() if t.requires_grad else m


class ShapeError(RuntimeError):
    """Shape inference failed at a node; the message names its layer and stage and the inputs' shapes."""


class _Failed(Exception):
    def __init__(self, node: fx.Node, error: BaseException):
        super().__init__(str(error))
        self.node, self.error = node, error


class _Propagation(fx.Interpreter):
    """Runs the graph on meta tensors, keeping the values of the nodes named in ``keep``. A module call that
    cannot run on the meta device (a leaf module with data-dependent control flow: ``if x.sum() > 0``) runs once
    on the CPU instead, on zeros of its inputs' shapes with zeros for its parameters and buffers."""

    def __init__(self, gm: fx.GraphModule, keep: set[str]):
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except Exception as e:
            if n.op != "call_module":
                raise _Failed(n, e) from e
            try:
                out = self._on_host(n)
            except Exception as again:
                raise _Failed(n, again) from again
        if n.name in self.keep:
            self.values[n.name] = out
        return out

    def _on_host(self, n: fx.Node) -> Any:
        module = self.module.get_submodule(cast(str, n.target))  # (a call_module's target: the module's name)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = tree_map(_on_host, (args, kwargs))
        state = {name: _on_host(t) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                   *module.named_buffers(remove_duplicate=False)]}
        return tree_map(_as_meta, torch.func.functional_call(module, state, tuple(args), kwargs))


class BoundaryShapes:
    """Spec of every value crossing a cut, per (input shapes, slice rows); computed once, then cached.

    The whole model runs on the meta device (no memory, no compute), so every rank derives the same shapes
    without a handshake, and a new sequence length only costs one more propagation.
    """

    def __init__(self, gm: fx.GraphModule, input_names: Sequence[str], boundary: Sequence[Sequence[str]],
                 places: dict[str, tuple[str, int]] | None = None, cuts: Sequence[tuple[str, str]] | None = None):
        self.dependent = data_dependent(gm)  # a whole value made from the batch's values cannot be sent whole
        self.cuts = list(cuts or [])  # per cut: the layers before and after it, for errors
        self.gm = meta_copy(gm)
        if "dapple_trace" in gm.meta:  # torch.export graphs: factory ops and .to() carry the traced device
            self.gm.meta["dapple_trace"] = dict(gm.meta["dapple_trace"])
            retarget_devices(self.gm, "meta")
        self.input_names = list(input_names)
        self.boundary = [list(b) for b in boundary]  # per cut: value names
        self.places = places or {}  # node name -> (layer name, stage), for errors
        self._cache: dict[tuple[InputKey, int], list[list[Spec]]] = {}
        self._whole: dict[InputKey, list[list[bool]]] = {}

    def specs(self, key: InputKey, rows: int) -> list[list[Spec]]:
        """Per cut, per boundary value: its Spec for a slice of ``rows`` rows.

        Raises:
            ValueError: a value that is neither batch rows (dim 0) nor the same tensor for any rows, or one without
                batch rows computed from the batch's values, crosses a cut (naming the layers on both sides).
        """
        if (key, rows) not in self._cache:
            values = self._propagate(key, rows)
            whole = self.whole(key)
            self._cache[(key, rows)] = [[self._spec(v, name, c, rows, whole[c][i]) for i, (name, v) in
                                         enumerate(zip(names, cut))] for c, (names, cut) in
                                        enumerate(zip(self.boundary, values))]
        return self._cache[(key, rows)]

    def whole(self, key: InputKey) -> list[list[bool]]:
        """Per cut, per boundary value: whether it is sent whole (seen at :data:`PROBE` rows: no batch rows, the same
        shape); ValueError if a value can be neither split by rows nor sent whole."""
        if key not in self._whole:
            seen = {rows: self._propagate(key, rows) for rows in PROBE}
            flags = []
            for c, names in enumerate(self.boundary):
                shapes = [{rows: shape_of(seen[rows][c][i]) for rows in PROBE} for i in range(len(names))]
                for name, s in zip(names, shapes):
                    if why := why_not(name, s, self.dependent):
                        raise self._uncut(c, name, why)
                flags.append([value_kind(s) == WHOLE for s in shapes])
            self._whole[key] = flags
        return self._whole[key]

    def _uncut(self, c: int, name: str, why: str) -> ValueError:
        layer = self.places.get(name, (None,))[0]
        where = (f", between layers {self.cuts[c][0]!r} and {self.cuts[c][1]!r}" if c < len(self.cuts) else
                 f", after layer {layer!r} that makes it" if layer is not None else "")
        return ValueError(f"value {name!r} crosses the cut after stage {c}{where}, and cannot be sent: {why}. "
                          f"dapple splits micro-batches along dimension 0 among a stage's replicas, and sends a tensor "
                          f"without batch rows whole to each. What to do: cut elsewhere (dapple.plan never cuts where "
                          f"the model's profile marks a boundary uncuttable), or keep the batch first in what the "
                          f"layer returns")

    def _propagate(self, key: InputKey, rows: int) -> list[list[Any]]:
        run = _Propagation(self.gm, {v for cut in self.boundary for v in cut})
        metas = [torch.empty((rows, *shape), dtype=dtype, device="meta") for shape, dtype in key]
        # enable_grad: requires_grad tells which values carry a gradient back. Identity saved-tensor hooks
        # shield the caller's own hooks (offloading, memory meters) from these meta tensors.
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                run.run(*metas)
        except _Failed as f:
            raise self._error(f, key, rows) from f.error
        return [[run.values[name] for name in names] for names in self.boundary]

    def _error(self, f: _Failed, key: InputKey, rows: int) -> ShapeError:
        layer, stage = self.places.get(f.node.name, ("?", "?"))
        inputs = ", ".join(f"{name} {(rows, *shape)} {str(dtype).removeprefix('torch.')}"
                           for name, (shape, dtype) in zip(self.input_names, key))
        target = f.node.target if isinstance(f.node.target, str) else getattr(f.node.target, "__name__", "?")
        return ShapeError(f"shape inference (meta device) failed in layer {layer!r} (stage {stage}) at node "
                          f"{f.node.name!r} ({f.node.op} {target}), for a slice of {rows} rows of inputs {inputs}: "
                          f"{type(f.error).__name__}: {first_line(f.error)}")

    @staticmethod
    def _spec(v: Any, name: str, c: int, rows: int, whole: bool = False) -> Spec:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"value {name!r} crosses the cut after stage {c} but is a {type(v).__name__}, "
                            f"not a tensor; only tensors can be sent between stages (move the cut, or "
                            f"compute it in the stage that uses it)")
        grad = bool(v.requires_grad and (v.is_floating_point() or v.is_complex()))
        if whole:
            return Spec(tuple(v.shape), v.dtype, grad, True)
        if v.dim() == 0 or v.shape[0] != rows:
            raise ValueError(f"value {name!r} crosses the cut after stage {c} with shape {tuple(v.shape)} "
                             f"for a slice of {rows} rows; dapple splits micro-batches along dimension 0, "
                             f"so every tensor crossing a cut must have the batch rows first")
        return Spec(tuple(v.shape), v.dtype, grad)
