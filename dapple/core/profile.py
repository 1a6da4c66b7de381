"""The Profile document: per-layer times and sizes at a few batch sizes, with a linear fit in batch size."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from . import documents
from .checks import is_finite, is_int

VERSION = 1

OPTIONAL = ("weight_ms", "selective_bytes", "selective_ms")  # per-layer measurements older profiles lack


@dataclass
class LayerProfile:
    """One layer (a unit a plan may cut after); every list holds one value per profiled batch size."""

    name: str
    forward_ms: list[float]
    backward_ms: list[float]
    boundary_bytes: list[int]  # bytes of ALL tensors crossing a cut placed right after this layer
    saved_bytes: list[float]  # activations autograd keeps for this layer's backward (a joined layer's: floats)
    param_bytes: int  # parameters owned by this layer (a tied parameter counts once, at its first layer)
    inputs: list[int] | None = None  # earlier layers whose outputs this layer reads (None: the previous one)
    weight_ms: list[float] | None = None  # of backward_ms, the weight gradients' part (None: not measured)
    # False: no plan may cut after this layer (a tensor crossing there can be neither split by rows nor sent whole;
    # the profiler says which in meta["uncuttable"])
    cuttable: bool = True
    # selective recomputation (recompute="selective"): the bytes of what it keeps (the outputs of matmuls,
    # convolutions and attention), and the ms it adds to the backward (the rest of the forward, run again); None:
    # not measured
    selective_bytes: list[float] | None = None
    selective_ms: list[float] | None = None


@dataclass
class LayerCosts:
    """All layers' costs at one (possibly fractional, unprofiled) batch size; plain lists for fast planning."""

    batch: float
    forward_ms: list[float]
    backward_ms: list[float]
    boundary_bytes: list[float]
    saved_bytes: list[float]
    param_bytes: list[int]


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear fit of y(x) through the profiled points (xs increasing), for any batch x > 0.

    Between points: linear. Beyond the ends: the end segment extended, but never below what proportional
    scaling of the nearest point gives for a smaller batch (y0 * x / x0: a fixed cost does not shrink, so a
    steep noisy first segment cannot make a small slice free), and never below the last point for a larger
    batch (more rows never cost less). With one point the value is proportional to x. Never negative.
    """
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x < xs[0]:
        y = max(y, ys[0] * x / xs[0])
    elif x > xs[-1]:
        y = max(y, ys[-1])
    return max(0.0, y)


@dataclass
class Profile:
    """What the planner needs to know of a model: see docs/design.md, 'The three YAML documents'."""

    model: str
    device: str
    batch_sizes: list[int]
    layers: list[LayerProfile]
    meta: dict = field(default_factory=dict)  # free-form extras (dtype, repeats, torch version, ...)
    # (forward, backward) ms of calling a layer at all (its module; autograd for the backward), measured on an empty
    # layer in the same rounds: part of every layer's own times, but a stage running several layers as one op pays
    # it once (CostModel); [0, 0]: no such part (PipeDream's profiles, documents without the field)
    call_ms: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # ms a training step pays once beyond its stages' work: the runtime's checks and end-of-step collectives (the
    # loss AllReduce, tied parameters' AllReduce across stages), added to every plan's latency; dapple.calibrate
    # measures it, dapple.profile leaves it 0
    step_ms: float = 0.0
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # the file it was loaded from or saved to (absolute; None: made in memory): a plan records it, so that
    # `dapple simulate plan.yaml` finds it (not part of the document)
    path: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- queries -------------------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def uncuttable(self) -> list[int]:
        """The layers after which no plan may cut (``LayerProfile.cuttable`` False)."""
        return [i for i, layer in enumerate(self.layers[:-1]) if not layer.cuttable]

    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def costs(self, batch: float) -> LayerCosts:
        """Per-layer forward/backward ms and bytes at ``batch`` rows, from the linear fit (memoised).

        Treat a Profile as immutable once made: the fit is cached per batch size.
        """
        batch = float(batch)
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        if (hit := self._cache.get(batch)) is None:
            xs = self.batch_sizes

            def fit(key: str) -> list[float]:
                return [interpolate(xs, getattr(layer, key), batch) for layer in self.layers]

            hit = self._cache[batch] = LayerCosts(
                batch=batch, forward_ms=fit("forward_ms"), backward_ms=fit("backward_ms"),
                boundary_bytes=fit("boundary_bytes"), saved_bytes=fit("saved_bytes"),
                param_bytes=[layer.param_bytes for layer in self.layers])
        return hit

    def net_ms(self, batch: float) -> tuple[list[float], list[float]]:
        """Per layer, the forward and backward ms at ``batch`` less :attr:`call_ms` (none below 0): what the layer
        adds to a stage, which pays ``call_ms`` once (the layers' own lists when there is no call cost)."""
        c = self.costs(batch)
        f0, b0 = self.call_ms
        if not (f0 or b0):
            return c.forward_ms, c.backward_ms
        return [max(0.0, v - f0) for v in c.forward_ms], [max(0.0, v - b0) for v in c.backward_ms]

    def forward_ms(self, layer: int, batch: float) -> float:
        return self.costs(batch).forward_ms[layer]

    def backward_ms(self, layer: int, batch: float) -> float:
        return self.costs(batch).backward_ms[layer]

    def boundary_bytes(self, layer: int, batch: float) -> float:
        return self.costs(batch).boundary_bytes[layer]

    def weight_share(self, start: int, end: int, batch: float) -> float | None:
        """Of the backward of layers [start, end) at ``batch`` rows, the share that computes weight gradients (what
        a split backward's W runs); None unless every one of them has ``weight_ms``."""
        layers = self.layers[start:end]
        weights = [layer.weight_ms for layer in layers if layer.weight_ms is not None]
        if not layers or len(weights) < len(layers):
            return None
        xs = self.batch_sizes
        w = sum(interpolate(xs, ms, batch) for ms in weights)
        b = sum(interpolate(xs, layer.backward_ms, batch) for layer in layers)
        return min(1.0, max(0.0, w / b)) if b > 0 else None

    def saved_bytes(self, layer: int, batch: float) -> float:
        return self.costs(batch).saved_bytes[layer]

    @property
    def selective(self) -> bool:
        """Whether every layer has its selective recomputation measured (``selective_bytes``, ``selective_ms``)."""
        return all(layer.selective_bytes is not None and layer.selective_ms is not None for layer in self.layers)

    def selective_costs(self, batch: float) -> tuple[list[float], list[float]]:
        """Per layer at ``batch`` rows: (bytes kept, ms added to the backward) under selective recomputation.

        Raises:
            ValueError: some layer has not measured them (a profile from before they were, or made by hand).
        """
        if not self.selective:
            missing = [layer.name for layer in self.layers if layer.selective_bytes is None or
                       layer.selective_ms is None]
            raise ValueError(f"recompute='selective': the profile of {self.model!r} has no selective recomputation "
                             f"measurements (selective_bytes, selective_ms) for layers {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}; profile the model again with "
                             f"dapple.profile(..., selective=True) (dapple profile --selective)")
        xs = self.batch_sizes
        return ([interpolate(xs, layer.selective_bytes or [], batch) for layer in self.layers],
                [interpolate(xs, layer.selective_ms or [], batch) for layer in self.layers])

    # ---- validation and YAML -------------------------------------------------------------------
    def validate(self, where: str = "Profile") -> None:
        """Raise ValueError naming the offending field if the profile is inconsistent."""
        n = len(self.batch_sizes)
        if n == 0:
            raise ValueError(f"{where}.batch_sizes: expected at least one batch size, got []")
        if any(not is_int(b, 1) for b in self.batch_sizes) or sorted(set(self.batch_sizes)) != list(
                self.batch_sizes):
            raise ValueError(f"{where}.batch_sizes: expected strictly increasing positive integers, "
                             f"got {self.batch_sizes}")
        if not self.layers:
            raise ValueError(f"{where}.layers: expected at least one layer, got none")
        if (not isinstance(self.call_ms, (list, tuple)) or len(self.call_ms) != 2
                or not all(is_finite(v) for v in self.call_ms)):
            raise ValueError(f"{where}.call_ms: expected [forward, backward], two finite numbers >= 0 (ms), got "
                             f"{self.call_ms!r:.120}")
        if not is_finite(self.step_ms):
            raise ValueError(f"{where}.step_ms: expected a finite number >= 0 (ms), got {self.step_ms!r:.120}")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise TypeError(f"{where}.layers[{i}]: expected a LayerProfile, got {type(layer).__name__}")
            if not isinstance(layer.name, str):
                raise TypeError(f"{where}.layers[{i}].name: expected a string (the module path), got {layer.name!r}")
            for key in ("forward_ms", "backward_ms", "boundary_bytes", "saved_bytes", *OPTIONAL):
                values = getattr(layer, key)
                if key in OPTIONAL and values is None:
                    continue
                if not isinstance(values, (list, tuple)) or len(values) != n:
                    raise ValueError(f"{where}.layers[{i}] ({layer.name}).{key}: expected {n} values, one per "
                                     f"batch size {self.batch_sizes}, got {values!r:.120}")
                if not all(is_finite(v) for v in values):  # a NaN would fit as 0 ms
                    raise ValueError(f"{where}.layers[{i}] ({layer.name}).{key}: expected finite numbers >= 0, got "
                                     f"{values}")
            if not is_finite(layer.param_bytes):
                raise ValueError(f"{where}.layers[{i}] ({layer.name}).param_bytes: expected a finite number >= 0, "
                                 f"got {layer.param_bytes!r}")
            if not isinstance(layer.cuttable, bool):
                raise ValueError(f"{where}.layers[{i}] ({layer.name}).cuttable: expected true or false, got "
                                 f"{layer.cuttable!r}")
            if layer.inputs is not None and any(not 0 <= j < i for j in layer.inputs):
                raise ValueError(f"{where}.layers[{i}] ({layer.name}).inputs: expected indices of earlier layers "
                                 f"(0..{i - 1}), got {layer.inputs}")

    def to_dict(self) -> dict:
        doc: dict = {"dapple_profile": VERSION, "model": self.model, "device": self.device,
                     "batch_sizes": list(self.batch_sizes)}
        if any(self.call_ms):
            doc["call_ms"] = [round(float(v), 6) for v in self.call_ms]
        if self.step_ms:
            doc["step_ms"] = round(float(self.step_ms), 6)
        if self.meta:
            doc["meta"] = dict(self.meta)
        layers = []
        for layer in self.layers:
            d = {"name": layer.name, "forward_ms": [round(float(v), 6) for v in layer.forward_ms],
                 "backward_ms": [round(float(v), 6) for v in layer.backward_ms],
                 "boundary_bytes": [int(v) for v in layer.boundary_bytes],
                 "saved_bytes": [int(v) for v in layer.saved_bytes], "param_bytes": int(layer.param_bytes)}
            if layer.inputs is not None:
                d["inputs"] = list(layer.inputs)
            for key in OPTIONAL:
                if (values := getattr(layer, key)) is not None:
                    d[key] = [round(float(v), 6) for v in values]
            if not layer.cuttable:
                d["cuttable"] = False
            layers.append(d)
        doc["layers"] = layers
        return doc

    def save(self, path: documents.PathLike) -> None:
        documents.dump(self.to_dict(), path)
        self.path = str(Path(path).resolve())

    def source(self) -> dict:
        """Where a plan finds this profile again: ``profile_file`` (:attr:`path`) and, for a PipeDream graph.txt
        (read by :meth:`from_pipedream`, not saved since), ``profile_batch`` (the batch it was measured at, which the
        file does not say); empty for a profile made in memory."""
        if self.path is None:
            return {}
        if self.path.endswith(".txt"):  # (the dapple CLI reads a .txt profile as PipeDream's)
            return {"profile_file": self.path, "profile_batch": self.batch_sizes[0]}
        return {"profile_file": self.path}

    @classmethod
    def from_dict(cls, doc: dict, where: str = "Profile") -> "Profile":
        f = documents.Fields(doc, where).known("dapple_profile", "model", "device", "batch_sizes", "layers", "meta",
                                         "call_ms", "step_ms")
        batch_sizes = f.numbers("batch_sizes", integer=True, minimum=1)
        n = len(batch_sizes)

        def layer(g: documents.Fields) -> LayerProfile:
            g.known("name", "forward_ms", "backward_ms", "boundary_bytes", "saved_bytes", "param_bytes", "inputs",
                    "cuttable", *OPTIONAL)
            inputs = g.numbers("inputs", integer=True, default=[]) if "inputs" in g.data else None
            measured = {key: g.numbers(key, n) for key in OPTIONAL if key in g.data}  # older profiles: none
            return LayerProfile(name=g.str("name"), forward_ms=g.numbers("forward_ms", n),
                                backward_ms=g.numbers("backward_ms", n),
                                boundary_bytes=g.numbers("boundary_bytes", n),
                                saved_bytes=g.numbers("saved_bytes", n),
                                param_bytes=g.number("param_bytes", integer=False), inputs=inputs,
                                cuttable=g.data.get("cuttable", True), **measured)

        layers = f.each("layers", layer)
        meta = f.mapping("meta")
        try:
            return cls(model=f.str("model"), device=f.str("device"), batch_sizes=batch_sizes, layers=layers,
                       meta=meta, call_ms=f.numbers("call_ms", 2, default=[0.0, 0.0]),
                       step_ms=f.number("step_ms", default=0.0))
        except ValueError as e:
            raise documents.DocumentError(str(e).replace("Profile", where, 1)) from e

    @classmethod
    def load(cls, path: documents.PathLike) -> "Profile":
        prof = cls.from_dict(documents.load(path, "dapple_profile", VERSION), where=str(path))
        prof.path = str(Path(path).resolve())
        return prof

    def __str__(self) -> str:
        b = self.batch_sizes[-1]
        c = self.costs(b)
        lines = [f"Profile of {self.model} on {self.device}: {self.num_layers} layers, "
                 f"{self.param_bytes() / 1e6:.3f} MB of parameters, batch sizes {self.batch_sizes}",
                 f"  {'#':>3}  {'layer':<28} {'fwd ms':>9} {'bwd ms':>9} {'boundary B':>12} {'saved B':>12} "
                 f"{'param B':>12}   (at batch {b})"]
        for i, layer in enumerate(self.layers):
            name = layer.name[:27] + "|" if not layer.cuttable else layer.name[:28]  # | : no cut after it
            lines.append(f"  {i:>3}  {name:<28} {c.forward_ms[i]:>9.3f} {c.backward_ms[i]:>9.3f} "
                         f"{c.boundary_bytes[i]:>12.0f} {c.saved_bytes[i]:>12.0f} {layer.param_bytes:>12}")
        if self.uncuttable:
            lines.append("  (| : no plan cuts after the layer: what crosses there can be neither split nor sent whole)")
        if any(self.call_ms):
            f0, b0 = self.call_ms
            lines.append(f"  (each layer's times include {f0:.3f} / {b0:.3f} ms of calling it, which a stage pays "
                         f"once)")
        if self.step_ms:
            lines.append(f"  (a training step also pays {self.step_ms:g} ms once: the runtime's checks and end-of-step "
                         f"collectives)")
        return "\n".join(lines)

    @classmethod
    def from_pipedream(cls, path: documents.PathLike, batch_size: int) -> "Profile":
        """Read a PipeDream ``graph.txt`` profile measured at ``batch_size`` (nodes ordered topologically)."""
        prof = _from_pipedream(Path(path), batch_size)
        prof.path = str(Path(path).resolve())
        return prof



_NODE = re.compile(r"^(node\d+) -- (.*) -- (forward_compute_time=.*)$")
_EDGE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")


def _from_pipedream(path: Path, batch_size: int) -> Profile:
    if not is_int(batch_size, 1):
        raise ValueError(f"from_pipedream: batch_size must be a positive integer (the batch size {path.name} was "
                         f"profiled at), got {batch_size!r}")
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise documents.DocumentError(f"{path}: cannot read PipeDream profile: {e}") from e
    nodes: dict[str, tuple[str, dict[str, float]]] = {}
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if m := _NODE.match(line):
            stats = {}
            for item in m.group(3).split(","):
                key, _, value = item.strip().partition("=")
                try:
                    value = value.strip()
                    if value.startswith("[") and value.endswith("]"):  # several outputs: PipeDream sums them
                        stats[key] = sum(float(v) for v in value[1:-1].split(";"))
                    else:
                        stats[key] = float(value)
                except ValueError:
                    raise documents.DocumentError(f"{path}:{lineno}: {key}={value!r} is not a number") from None
            for key in ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size"):
                if key not in stats:
                    raise documents.DocumentError(f"{path}:{lineno}: node {m.group(1)} lacks {key}")
            nodes[m.group(1)] = (m.group(2).strip(), stats)
        elif m := _EDGE.match(line):
            edges.append((m.group(1), m.group(2)))
        else:
            raise documents.DocumentError(f"{path}:{lineno}: expected 'nodeN -- name -- stats' or '\\tnodeA -- nodeB', "
                                    f"got {line!r:.100}")
    if not nodes:
        raise documents.DocumentError(f"{path}: no nodes found; is this a PipeDream graph.txt?")
    for a, b in edges:
        for x in (a, b):
            if x not in nodes:
                raise documents.DocumentError(f"{path}: edge {a} -- {b} names unknown node {x}")
    order = sorted(nodes, key=lambda s: int(s[4:]))  # PipeDream numbers nodes in a topological order
    index = {n: i for i, n in enumerate(order)}
    preds: list[set[int]] = [set() for _ in order]
    last_use = list(range(len(order)))  # index of the last consumer of each node's output
    for a, b in edges:
        if index[a] >= index[b]:
            raise documents.DocumentError(f"{path}: edge {a} -- {b} goes backwards in node order; not a topological "
                                          f"order")
        preds[index[b]].add(index[a])
        last_use[index[a]] = max(last_use[index[a]], index[b])
    act = [nodes[n][1]["activation_size"] for n in order]
    layers = []
    for i, n in enumerate(order):
        name, s = nodes[n]
        # everything produced at or before i and still needed after i crosses a cut right after i
        boundary = sum(act[k] for k in range(i + 1) if last_use[k] > i)
        layers.append(LayerProfile(
            name=f"{n}:{name}"[:120], forward_ms=[s["forward_compute_time"]], backward_ms=[s["backward_compute_time"]],
            boundary_bytes=[int(boundary)], saved_bytes=[int(s["activation_size"])],
            param_bytes=int(s["parameter_size"]), inputs=sorted(preds[i])))
    return Profile(model=path.stem, device="pipedream", batch_sizes=[batch_size], layers=layers,
                   meta={"source": str(path), "format": "pipedream graph.txt"})
