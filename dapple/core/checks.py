"""Argument checks shared by the profiler, planner and runtime: a bool is neither a count nor a number."""

from __future__ import annotations

import math
from typing import Any, TypeGuard


def is_int(value: Any, least: int | None = None) -> TypeGuard[int]:
    """True for an int that is not a bool (flags are not counts) and, when ``least`` is given, >= ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)


def is_real(value: Any) -> bool:
    """True for an int or float that is neither a bool nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def is_finite(value: Any, least: float = 0.0) -> bool:
    """True for a real number (:func:`is_real`) >= ``least`` that is not inf."""
    return is_real(value) and least <= value < math.inf


def positive_int(name: str, value: Any) -> int:
    """``value``; ValueError unless it is an int >= 1."""
    if not is_int(value, 1):
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an int >= 0."""
    if not is_int(value, 0):
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")


def number(name: str, value: Any, *, positive: bool = False, finite: bool = False) -> None:
    """Raise ValueError unless ``value`` is a real number >= 0 (> 0 with ``positive``; not inf with ``finite``)."""
    if not is_real(value) or value < 0 or (positive and value == 0) or (finite and value == math.inf):
        raise ValueError(f"{name}: expected a {'positive' if positive else 'non-negative'}"
                         f"{' finite' if finite else ''} number, got {value!r}")


def flag(name: str, value: Any, meaning: str = "") -> None:
    """Raise TypeError unless ``value`` is True or False (a string such as "no" is not a switch)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False{f' ({meaning})' if meaning else ''}, got {value!r}")
