"""Program-order keys of the actions of a rewritten step, and the step functions built on them.

Why: the incremental memory model (``memfit.model.profile``) prices a set of decisions as the
lifetimes it changes, without building the action list of ``schedule.lower``. It needs a name
for every action that sorts in program order and does not move when re-runs are inserted
before it: ``position * STRIDE + slot``. An op's group of actions holds, in order, the re-runs
placed before it (``slot`` = their rank), the waits before it (``WAIT``), its compute
(``COMPUTE``), its swap-outs (``SWAP_OUT``) and the swap-ins issued after it (``SWAP_IN``); no
action has the slot ``STRIDE - 1`` (``AFTER``), so that key reads the bytes live between two
groups. A buffer is live from the key of the action that allocates it to the key of its last
reader, both included (``memory_profile`` frees right after the last read).

Example:
    >>> key(3, COMPUTE) // STRIDE, key(3, 0) < key(3, WAIT) < key(3, COMPUTE) < key(4, 0)
    (3, True)
"""

from __future__ import annotations

import numpy as np

STRIDE = 1 << 22  # keys per op: room for a million re-runs before one op
WAIT = (1 << 20) - 1  # waits come after the re-runs (slots 0..) and before the compute
COMPUTE = 1 << 20
SWAP_OUT = COMPUTE + 1
SWAP_IN = COMPUTE + 2
AFTER = STRIDE - 1  # no action: between an op's group and the next
MISSING = np.iinfo(np.int64).min // 2  # the maximum of no values


def key(position: int, slot: int) -> int:
    """The key of the action at ``slot`` of op ``position``'s group."""
    return position * STRIDE + slot


def first_compute_from(keys: np.ndarray, op_count: int) -> np.ndarray:
    """Per key, the first op whose compute comes at or after it (``op_count`` if none)."""
    return np.clip(-(-(keys - COMPUTE) // STRIDE), 0, op_count)


def covered_computes(first: np.ndarray, last: np.ndarray, size: np.ndarray,
                     op_count: int) -> np.ndarray:
    """Per op, the sum of ``size`` over the lifetimes ``[first, last]`` that cover its compute
    (a difference array and one ``cumsum``: O(ops + lifetimes))."""
    change = np.zeros(op_count + 1, dtype=np.int64)
    np.add.at(change, first_compute_from(first, op_count), size)
    np.add.at(change, np.clip((last - COMPUTE) // STRIDE + 1, 0, op_count), -size)
    return np.cumsum(change[:-1])


class StepFunction:
    """The sum of signed lifetimes ``[first, last]`` as a function of the key, kept as its
    sorted breakpoints: read at any keys by bisection (O(log m) each, whatever the step's
    length), for the sparse queries of a few changed lifetimes on a long step."""

    def __init__(self, first: np.ndarray, last: np.ndarray, size: np.ndarray) -> None:
        points = np.concatenate((first, last + 1))
        order = np.argsort(points, kind="stable")
        self.points = points[order]  # the function changes at each
        # its value from points[i - 1] (inclusive) to points[i]: 0 before the first
        self.values = np.concatenate(([0], np.cumsum(np.concatenate((size, -size))[order])))

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        """The value at each key."""
        return self.values[np.searchsorted(self.points, keys, "right")]


class RangeMax:
    """Maximum of ``values[low:high]`` for many ranges at once (a sparse table: log n arrays of
    the maxima of power-of-two windows, built once)."""

    def __init__(self, values: np.ndarray) -> None:
        levels = [values if len(values) else np.full(1, MISSING, dtype=np.int64)]
        width = 1
        while 2 * width <= len(levels[0]):
            levels.append(np.maximum(levels[-1][:-width], levels[-1][width:]))
            width *= 2
        self.table = np.full((len(levels), len(levels[0])), MISSING, dtype=np.int64)
        for level, maxima in enumerate(levels):
            self.table[level, : len(maxima)] = maxima

    def __call__(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """Per range, its maximum; ``MISSING`` for an empty range."""
        length = high - low
        empty = length <= 0
        level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
        low = np.where(empty, 0, low)
        right = np.where(empty, 0, high - (1 << level))
        return np.where(empty, MISSING, np.maximum(self.table[level, low], self.table[level, right]))
