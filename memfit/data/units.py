"""Byte sizes and budgets: parse what a user types ("11GiB", "500MB", 0.5) into bytes.

Note:
    A budget is either absolute device bytes or a fraction of the unplanned step's peak: a bare
    number at most 1 is a fraction, an integer above 1 or a size with units is bytes
    (``parse_budget``, the one reading for Python and the command line). The
    fraction can only be turned into bytes once that peak is known, so parsing returns a small
    ``Budget`` value and ``Budget.to_bytes(baseline_peak_bytes)`` resolves it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse a size such as ``"3GiB"``, ``"500MB"``, ``"1.5 gib"`` or ``1024`` into bytes.

    Raises:
        ValueError: for anything else, naming the accepted units.
    """
    if isinstance(text, bool):
        raise ValueError(f"a size must be a number of bytes or a string like '3GiB', not {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: write a number followed by one of "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '3GiB'"
        )
    return int(round(float(match.group(1)) * _UNITS[unit]))


def format_bytes(size_bytes: float) -> str:
    """Render bytes with a binary unit, e.g. ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    sign = "-" if size_bytes < 0 else ""
    value = float(abs(size_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Budget:
    """A device-memory budget: absolute bytes, or a fraction of the unplanned peak.

    Exactly one of ``bytes`` and ``fraction`` is set.
    """

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("a Budget has exactly one of bytes= and fraction=")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"a budget fraction must be in (0, 1], got {self.fraction}")
        if self.bytes is not None and self.bytes <= 0:
            raise ValueError(f"a budget must be positive, got {self.bytes} bytes")

    def to_bytes(self, baseline_peak_bytes: int) -> int:
        """Absolute bytes, resolving a fraction against the unplanned step's peak."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(self.fraction * baseline_peak_bytes)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{self.fraction:g} of the unplanned peak"


def parse_budget(budget: str | int | float | Budget | None) -> Budget | None:
    """Read a budget as a user writes it: the one reading for Python and the command line.

    The rule: a bare number at most 1 is a fraction of the unplanned step's peak; an integer
    above 1 is bytes; a size with units is bytes. So ``1``, ``1.0`` and ``"1"`` all mean the
    whole unplanned peak, ``0.5`` and ``"0.5"`` half of it, ``4096`` and ``"4096"`` 4096 bytes,
    ``"3GiB"`` three gibibytes. A non-integral number above 1 (``1.5``, ``"2.5"``) is refused:
    it is neither a fraction nor a whole number of bytes.

    Args:
        budget: ``None`` (no budget), a number, a numeric string or a size string, read by the
            rule above; a ``Budget`` is returned as is.

    Raises:
        ValueError: naming the accepted forms (for a number above 1 that is not whole, saying
            to write an integer of bytes or a size with units).

    Note:
        Why ``1`` is not one byte: ``memfit plan --budget 1`` can only read text, where "1" is
        naturally the whole peak, and Python's ``budget=1`` must mean what the command line does.
        A budget of one byte is never what anyone wants; ``budget=2`` and up stay bytes.
    """
    if budget is None or isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or not isinstance(budget, str | int | float):
        raise ValueError(_budget_help(budget))
    if isinstance(budget, str):
        text = budget.strip()
        try:
            value: int | float = float(text)  # also reads "1e9" and "3_000_000_000"
        except ValueError:
            return Budget(bytes=_positive_size(text, budget))
    else:
        value = budget
    if 0.0 < value <= 1.0:
        return Budget(fraction=float(value))
    if value > 1.0 and math.isfinite(value):
        if float(value).is_integer() and not isinstance(budget, float):
            return Budget(bytes=int(value))
        whole = f"{int(value):_}" if float(value).is_integer() else "3_000_000_000"
        raise ValueError(
            f"cannot use {budget!r} as a budget: above 1 a budget is bytes, given as an int "
            f"({whole}) or a size with units ('3GiB'); a bare number at most 1 is a fraction "
            "of the unplanned peak (0.5)")
    raise ValueError(_budget_help(budget))


def _positive_size(text: str, budget: object) -> int:
    try:
        size = parse_bytes(text)
    except ValueError:
        raise ValueError(_budget_help(budget)) from None
    if size <= 0:
        raise ValueError(_budget_help(budget))
    return size


def _budget_help(budget: object) -> str:
    return (
        f"cannot use {budget!r} as a budget: give bytes (3_000_000_000), a size string "
        "('3GiB', '500MB') or a fraction in (0, 1] of the unplanned peak (0.5 or '0.5')"
    )
