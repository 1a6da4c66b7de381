"""dapple.core.checks: counts are ints that are not bools; numbers are ints or floats that are neither bools nor NaN."""

from __future__ import annotations

import math

import pytest

from dapple.core.checks import is_int, is_real, non_negative_int, number, positive_int
from dapple.runtime import launch


@pytest.mark.parametrize("value, least, ok", [
    (3, None, True), (0, 0, True), (-1, None, True), (0, 1, False), (True, None, False), (False, 0, False),
    (2.0, None, False), ("2", None, False), (None, None, False), (5, 5, True), (4, 5, False),
])
def test_is_int(value, least, ok):
    assert is_int(value, least) is ok


@pytest.mark.parametrize("value, ok", [
    (1, True), (0.5, True), (-2.0, True), (math.inf, True), (math.nan, False), (True, False), ("1", False),
    (None, False),
])
def test_is_real(value, ok):
    assert is_real(value) is ok


def test_messages_name_the_argument_and_value():
    with pytest.raises(ValueError, match=r"^beam: expected a positive integer, got True$"):
        positive_int("beam", True)
    with pytest.raises(ValueError, match=r"^verify: expected a non-negative integer, got -1$"):
        non_negative_int("verify", -1)
    with pytest.raises(ValueError, match=r"^gap: expected a positive number, got 0$"):
        number("gap", 0, positive=True)
    with pytest.raises(ValueError, match=r"^limit: expected a non-negative number, got nan$"):
        number("limit", math.nan)
    positive_int("beam", 1), non_negative_int("verify", 0), number("gap", 0)


def test_launch_needs_a_process_count_before_it_starts_anything():
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"nprocs: expected a positive integer, got {bad}"):
            launch(print, bad)
