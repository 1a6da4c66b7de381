"""How a model was traced: the tracer, its options and the example inputs' shapes, recorded in a profile and carried
by a plan, so that ``dapple.pipeline`` traces the model into the same layers without being told again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import documents

TRACERS = ("fx", "export")
PLAIN = (type(None), bool, int, float, str)  # concrete_args values a document can hold


@dataclass(frozen=True)
class InputSpec:
    """One example input: its name (``forward``'s argument), shape (batch first) and dtype (``"int64"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TraceSpec:
    """What traced a model and with what.

    Attributes:
        tracer: ``"fx"`` or ``"export"``: the tracer that traced it (not ``"auto"``: the one auto chose).
        inputs: the example inputs, in the order the traced model takes them.
        by_name: the inputs were given by keyword (a dict), and are passed to ``forward`` by name.
        concrete_args: the Python-level arguments fixed for the tracer (plain values only).
        leaf_modules: torch.fx's leaf modules: module paths, or ``"class:module.QualName"`` for classes.
        unrecorded: options that were given but that a document cannot hold (``"concrete_args"``,
            ``"dynamic_shapes"``): the caller must give them again.
    """

    tracer: str
    inputs: tuple[InputSpec, ...] = ()
    by_name: bool = False
    concrete_args: dict[str, Any] = field(default_factory=dict)
    leaf_modules: tuple[str, ...] = ()
    unrecorded: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tracer not in TRACERS:
            raise ValueError(f"tracing.tracer: expected one of {TRACERS}, got {self.tracer!r}")
        bad = {k: v for k, v in self.concrete_args.items() if not isinstance(v, PLAIN)}
        if bad:
            raise ValueError(f"tracing.concrete_args: expected plain values (None, bool, int, float, str), got {bad}")

    def to_dict(self) -> dict:
        doc: dict = {"tracer": self.tracer,
                     "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in self.inputs]}
        if self.by_name:
            doc["by_name"] = True
        if self.concrete_args:
            doc["concrete_args"] = dict(self.concrete_args)
        if self.leaf_modules:
            doc["leaf_modules"] = list(self.leaf_modules)
        if self.unrecorded:
            doc["unrecorded"] = list(self.unrecorded)
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str = "tracing") -> "TraceSpec":
        f = documents.Fields(doc, where).known("tracer", "inputs", "by_name", "concrete_args", "leaf_modules",
                                               "unrecorded")

        def one(g: documents.Fields) -> InputSpec:
            g.known("name", "shape", "dtype")
            return InputSpec(g.str("name"), tuple(g.numbers("shape", integer=True)), g.str("dtype"))

        try:
            return cls(tracer=f.str("tracer"), inputs=tuple(f.each("inputs", one)),
                       by_name=bool(f.data.get("by_name", False)), concrete_args=f.mapping("concrete_args"),
                       leaf_modules=tuple(_strings(f, "leaf_modules")), unrecorded=tuple(_strings(f, "unrecorded")))
        except documents.DocumentError:
            raise
        except ValueError as e:
            raise documents.DocumentError(f"{where}: {e}") from e


def _strings(f: documents.Fields, key: str) -> list[str]:
    values = f.data.get(key, [])
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise documents.DocumentError(f"{f.where}.{key}: expected a list of strings, got {values!r:.100}")
    return values
