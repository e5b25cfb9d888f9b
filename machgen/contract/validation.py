"""How one request input's value is checked, raising InvalidArgument
that names the field: the request parser (contract/request.py), published
inputs (contract/api.py) and the families' own inputs use these. Only numpy
is imported."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# The largest guidance scale (and LoRA adapter scale) a request may give.
MAX_GUIDANCE = 100.0


class InvalidArgument(ValueError):
    """A request input is missing or out of range; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"invalid input '{field}': {problem}")
        self.field = field


def scalar_input(field: str, value: np.ndarray) -> Any:
    """The one element of ``value``."""
    if value.size != 1:
        raise InvalidArgument(field, f"expected one element, got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def text_input(field: str, value: np.ndarray) -> str:
    """One UTF-8 text."""
    raw = scalar_input(field, value)
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except (UnicodeDecodeError, TypeError) as err:
        raise InvalidArgument(field, "not valid UTF-8 text") from err


def integer_input(field: str, value: np.ndarray, low: int, high: int) -> int:
    """One integer in [low, high]."""
    number = int(scalar_input(field, value))
    if not low <= number <= high:
        raise InvalidArgument(field, f"{number} is outside [{low}, {high}]")
    return number


def real_input(field: str, value: np.ndarray, low: float, high: float) -> float:
    """One finite number in [low, high]."""
    number = float(scalar_input(field, value))
    if not math.isfinite(number) or not low <= number <= high:
        raise InvalidArgument(field, f"{number} is outside [{low:g}, {high:g}]")
    return number


def guidance_scale_input(field: str, value: np.ndarray) -> float:
    """A guidance scale: finite, in [0, 100]."""
    return real_input(field, value, 0.0, MAX_GUIDANCE)


def fraction_input(field: str, value: np.ndarray) -> float:
    """One number in [0, 1]."""
    return real_input(field, value, 0.0, 1.0)


def indices_input(field: str, value: np.ndarray, count: int) -> tuple[int, ...]:
    """Distinct integers in [0, count), as sent (a 1-D INT32 array; empty is allowed)."""
    if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
        raise InvalidArgument(field, f"expected a 1-D integer array, got {value.dtype} {list(value.shape)}")
    indices = tuple(int(i) for i in value)
    outside = [i for i in indices if not 0 <= i < count]
    if outside:
        raise InvalidArgument(field, f"{outside} outside [0, {count - 1}]")
    if len(set(indices)) != len(indices):
        raise InvalidArgument(field, f"{list(indices)} repeats an index")
    return indices
