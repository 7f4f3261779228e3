"""Cache sizes in the syntax shared by the server's ``gpu_cache_size`` and the trainer's
``cache_size``: ``"auto"``, a fraction in [0, 1] (``0.2``), a percentage (``"20%"``) or a
size with a unit (``"2GiB"``, ``"512MB"``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


@dataclass(frozen=True)
class CacheSize:
    """A parsed cache size."""

    #: ``"auto"``, ``"fraction"`` (of the rows) or ``"bytes"``.
    kind: str
    #: The fraction in [0, 1], or the bytes; 0 for ``"auto"``.
    amount: float = 0.0


def parse_cache_amount(value: object, field: str, expected: str) -> CacheSize:
    """A cache size in the syntax shared by the server's ``gpu_cache_size`` and the
    trainer's ``cache_size``: ``"auto"``, a fraction in [0, 1], a percentage or a size
    with a unit. ``ValueError`` names ``field``, says ``expected`` and what it got."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return CacheSize("auto")
    if isinstance(value, bool) or not isinstance(value, int | float | str | np.number):
        raise ValueError(f"{field}: expected {expected}, got {value!r}")
    number, unit = (float(value), "") if not isinstance(value, str) else _split(value, field, expected)
    if unit and unit != "%":
        return CacheSize("bytes", float(math.floor(number * _UNITS[unit])))
    fraction = number / 100 if unit == "%" else number
    if not math.isfinite(fraction) or not 0 <= fraction <= 1:
        raise ValueError(f"{field}: expected {expected}, got {value!r}")
    return CacheSize("fraction", fraction)


def _split(text: str, field: str, expected: str) -> tuple[float, str]:
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit != "%" and unit not in _UNITS):
        raise ValueError(f"{field}: expected {expected}, got {text!r}")
    return float(match.group(1)), unit
