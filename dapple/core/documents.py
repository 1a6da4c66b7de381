"""Reading and writing dapple's versioned YAML documents, with errors that name the file and field."""

from __future__ import annotations

import builtins  # Fields has methods named str and list: its later annotations name the built-in types
import difflib
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from .checks import is_int, is_real

PathLike = str | os.PathLike


class DocumentError(ValueError):
    """A YAML document is malformed; the message names the file and the field."""


class _Dumper(yaml.SafeDumper):
    """Block style for mappings, flow style for short lists of scalars (one layer per line)."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = len(data) <= 64 and all(isinstance(x, (int, float, str, bool)) or x is None for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(tuple, _represent_list)


def dump(doc: Mapping[str, Any], path: PathLike | None = None) -> str:
    """Serialise ``doc`` (plain dicts, lists, numbers, strings) to YAML; write it to ``path`` if given."""
    text = yaml.dump(dict(doc), Dumper=_Dumper, sort_keys=False, width=120)
    if path is not None:
        Path(path).write_text(text)
    return text


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``25e9`` and ``1E-5`` as floats (YAML 1.1 wants ``25.0e+9``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+][0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read(path: PathLike, kind: str, header: str) -> dict[str, Any]:
    """The YAML mapping in ``path`` (a ``kind`` document, whose ``header`` the errors quote); DocumentError naming
    the file if it cannot be read or parsed."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise DocumentError(f"{path}: cannot read {kind} document: {e}") from e
    try:
        doc = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise DocumentError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise DocumentError(f"{path}: expected a YAML mapping with {header}, got {type(doc).__name__}")
    return doc


def check_header(doc: Mapping[str, Any], path: PathLike, kind: str, version: int) -> None:
    """DocumentError unless the header key ``kind`` (e.g. ``dapple_plan``) of ``doc`` equals ``version``."""
    if kind not in doc:
        raise DocumentError(f"{path}: missing header field '{kind}' (expected '{kind}: {version}'); "
                            f"is this the right kind of document? top-level keys: {sorted(doc)}")
    if doc[kind] != version:
        raise DocumentError(f"{path}: {kind} is {doc[kind]!r}, this dapple reads version {version}")


def load(path: PathLike, kind: str, version: int) -> dict[str, Any]:
    """Load a document whose header key ``kind`` (e.g. ``dapple_plan``) must equal ``version``."""
    doc = read(path, kind, f"'{kind}: {version}'")
    check_header(doc, path, kind, version)
    return doc


class Fields:
    """Typed access to one mapping of a document; every error names ``where`` (file and field path)."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, Mapping):
            raise DocumentError(f"{where}: expected a mapping, got {type(data).__name__} {data!r:.80}")
        self.data, self.where = data, where

    def known(self, *keys: str) -> "Fields":
        """DocumentError naming the first field not among ``keys`` (a misspelt ``warmup_polcy`` must not leave
        the default in force unsaid), with the closest known name when there is one."""
        for key in self.data:
            if key not in keys:
                close = difflib.get_close_matches(str(key), keys, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                extra = "; free-form values go under 'meta'" if "meta" in keys else ""
                raise DocumentError(f"{self.where}: unknown field {key!r}{hint}; known: {', '.join(keys)}{extra}")
        return self

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise DocumentError(f"{self.where}: missing field '{key}' (present: {sorted(self.data)})")
        return default

    def _fail(self, key: str, expected: str, value: Any) -> DocumentError:
        return DocumentError(f"{self.where}.{key}: expected {expected}, got {value!r:.120}")

    def str(self, key: str, default: Any = None) -> Any:
        v = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(v, str):
            raise self._fail(key, "a string", v)
        return v

    def number(self, key: builtins.str, default: Any = None, minimum: float | None = 0.0, integer: bool = False) -> Any:
        v = self._get(key, _REQUIRED if default is None else default)
        if not (is_int(v) if integer else is_real(v)):
            raise self._fail(key, "an integer" if integer else "a number", v)
        if minimum is not None and v < minimum:
            raise self._fail(key, f"a value >= {minimum}", v)
        return v

    def numbers(self, key: builtins.str, length: int | None = None, integer: bool = False, minimum: float | None = 0.0,
                default: Any = None) -> list:
        v = self._get(key, _REQUIRED if default is None else default)
        kind = "integers" if integer else "numbers"
        if not isinstance(v, (list, tuple)):
            raise self._fail(key, f"a list of {kind}", v)
        if length is not None and len(v) != length:
            raise self._fail(key, f"a list of {length} {kind}", v)
        for i, x in enumerate(v):
            if not (is_int(x) if integer else is_real(x)) or (minimum is not None and x < minimum):
                bound = f" >= {minimum}" if minimum is not None else ""
                raise DocumentError(f"{self.where}.{key}[{i}]: expected {kind[:-1]}{bound}, got {x!r}")
        return list(v)

    def mapping(self, key: builtins.str) -> dict:
        """An optional free-form mapping (``meta``, ``details``) as a dict; {} when absent or null."""
        v = self.data.get(key)
        if v is not None and not isinstance(v, Mapping):
            raise self._fail(key, "a mapping", v)
        return dict(v or {})

    def list(self, key: builtins.str, default: Any = None) -> Sequence[Any]:
        v = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(v, (list, tuple)):
            raise self._fail(key, "a list", v)
        return v

    def sub(self, key: builtins.str, default: Any = None) -> "Fields":
        return Fields(self._get(key, _REQUIRED if default is None else default), f"{self.where}.{key}")

    def each(self, key: builtins.str, convert: Callable[["Fields"], Any]) -> builtins.list:
        return [convert(Fields(x, f"{self.where}.{key}[{i}]")) for i, x in enumerate(self.list(key))]


_REQUIRED = object()
