"""Griewank's revolve counts: the fewest forward steps to reverse a chain with c snapshots.

Conventions (Griewank & Walther, "Evaluating Derivatives", 2nd ed., ch. 12): ``slots`` = c
snapshots *including* the one holding x_0; one working state, not counted, advanced in place; the
reverse of step i runs from x_{i-1} and its forward part is not counted, so x_l is never stored.
t(l, c) counts every advance, the first sweep x_0 -> x_{l-1} included. ``memfit.planning.solvers.chain``
says how this maps onto its byte budget.
"""

from __future__ import annotations

import math
from functools import cache


def revolve_forward_steps(steps: int, slots: int) -> int:
    """Griewank's t(l, c): fewest forward steps to reverse ``steps`` steps with ``slots`` snapshots.

    The classical recurrence: advance j steps from the snapshot of x_0, snapshot x_j, reverse the
    last l - j steps with one snapshot fewer, then the first j steps with all of them:
    t(l, c) = min_j j + t(l - j, c - 1) + t(j, c); t(1, c) = 0; t(l, 1) = t(l - 1, 1) + l - 1.
    Filled as a table (O(l² c) time), so long chains need no deep recursion.

    Raises:
        ValueError: if ``steps`` or ``slots`` is below 1 (x_0 itself needs a snapshot).
    """
    if steps < 1 or slots < 1:
        raise ValueError("revolve needs steps >= 1 and slots >= 1 (one slot holds x_0)")
    return _revolve_table(steps, min(slots, steps))[min(slots, steps)][steps]


@cache
def _revolve_table(steps: int, slots: int) -> tuple[tuple[int, ...], ...]:
    """``table[c][l]`` = t(l, c) for 1 <= l <= steps, 1 <= c <= slots (index 0 unused)."""
    table = [[0] * (steps + 1) for _ in range(slots + 1)]
    for length in range(2, steps + 1):
        table[1][length] = table[1][length - 1] + length - 1
    for count in range(2, slots + 1):
        for length in range(2, steps + 1):
            table[count][length] = min(
                split + table[count - 1][length - split] + table[count][split]
                for split in range(1, length)
            )
    return tuple(tuple(row) for row in table)


def revolve_extra_steps(steps: int, slots: int) -> int:
    """Forward steps beyond the training step's own forward pass: t(l, c) - (l - 1).

    Zero when ``slots >= steps - 1``; (l - 1)(l - 2) / 2 with one slot (only x_0 stored; the
    working state x_{l-1} left by the forward pass is used once). See the module note.
    """
    return revolve_forward_steps(steps, slots) - (steps - 1)


def revolve_closed_form(steps: int, slots: int) -> int:
    """Griewank's binomial formula, as an independent check of ``revolve_forward_steps``.

    beta(c, r) = C(c + r, c) is the longest chain that c snapshots reverse when no step runs more
    than r times; with r the least such that l <= beta(c, r), t(l, c) = r l - beta(c + 1, r - 1).
    """
    if steps < 1 or slots < 1:
        raise ValueError("revolve needs steps >= 1 and slots >= 1")
    repeats = 0
    while math.comb(slots + repeats, slots) < steps:
        repeats += 1
    previous = math.comb(slots + 1 + repeats - 1, slots + 1) if repeats >= 1 else 0
    return repeats * steps - previous
