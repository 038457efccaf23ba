"""The tables of the chain DP (see ``memfit.planning.solvers.chain`` for the model), vectorised over memory.

Two value functions, each a vector over the memory units m still free for the subproblem:

- ``segment[s, t, m]``: least recompute time to run B_t..B_{s+1} when a_s and g_t are live (and
  counted in m), the loss and the outputs of B_{t+1}..B_l live (counted too). Either t = s + 1 and
  B_t runs, or the schedule advances F_{s+1}..F_j from a_s (intermediates freed at once), keeps
  a_j, solves (j, t) with a_s still held, then (s, j).
- ``sweep[s, m]``: the same for the first forward pass from a_s, whose forward steps are free:
  keep some a_j (j < l) and recurse, or run on to a_l, take the loss and solve (s, l).

Both recurrences read only shorter segments (or later sweeps), so one pass by segment length fills
them. Numpy does the minimum over split points and memory at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from memfit.planning.solvers.chain_costs import ChainCosts

OperationTuple = tuple[str, int]  # ("forward" | "free" | "backward" | "loss", step)


def memory_unit_bytes(sizes: list[int], budget_bytes: int, memory_units: int) -> int:
    """Bytes per unit: an exact common divisor when it gives few enough units, else a rounding."""
    divisor = reduce(math.gcd, [size for size in sizes if size > 0], budget_bytes) or 1
    if budget_bytes // divisor <= memory_units:
        return divisor
    return max(1, -(-budget_bytes // memory_units))


@dataclass
class ChainTables:
    """Filled DP tables and the per-step sizes in units they were filled with."""

    steps: int
    budget_units: int
    activation: np.ndarray  # units of a_0..a_l (a_0 = 0)
    gradient: np.ndarray  # units of g_0..g_l (g_0 = 0)
    held_after: np.ndarray  # units live to the end once B_t..B_l ran: loss + outputs of B_{>t}
    advance_peak: np.ndarray  # [s, j]: units F_{s+1}..F_j add to a_s at their worst
    segment: np.ndarray
    segment_split: np.ndarray
    sweep: np.ndarray
    sweep_split: np.ndarray

    @staticmethod
    def fill(costs: ChainCosts, budget_bytes: int, memory_units: int) -> ChainTables:
        steps = costs.steps
        sizes = [*costs.activation_bytes, *costs.gradient_bytes, *costs.output_bytes, costs.loss_bytes]
        unit = memory_unit_bytes(sizes, budget_bytes, memory_units)

        def units(values: tuple[int, ...]) -> np.ndarray:
            return np.array([0, *(-(-v // unit) for v in values)], dtype=np.int64)

        activation, gradient, output = (
            units(costs.activation_bytes), units(costs.gradient_bytes), units(costs.output_bytes))
        loss = -(-costs.loss_bytes // unit)
        held_after = loss + np.concatenate([np.cumsum(output[::-1])[::-1][1:], [0]])
        advance_peak = np.zeros((steps + 1, steps + 1), dtype=np.int64)
        for start in range(steps):
            advance_peak[start, start + 1] = activation[start + 1]
            for end in range(start + 2, steps + 1):
                pair = activation[end] + (0 if costs.in_place_forward else activation[end - 1])
                advance_peak[start, end] = max(advance_peak[start, end - 1], pair)
        budget_units = budget_bytes // unit
        tables = ChainTables(
            steps, budget_units, activation, gradient, held_after, advance_peak,
            np.full((steps + 1, steps + 1, budget_units + 1), np.inf),
            np.full((steps + 1, steps + 1, budget_units + 1), -1, dtype=np.int32),
            np.full((steps + 1, budget_units + 1), np.inf),
            np.full((steps + 1, budget_units + 1), -1, dtype=np.int32),
        )
        forward_prefix = np.concatenate([[0.0], np.cumsum(costs.forward_time_s)])
        tables._fill_segments(output, forward_prefix)
        tables._fill_sweeps(loss)
        return tables

    def _fill_segments(self, output: np.ndarray, forward_prefix: np.ndarray) -> None:
        memory = np.arange(self.budget_units + 1)
        activation, gradient = self.activation, self.gradient
        for start in range(self.steps):
            need = (activation[start] + gradient[start + 1] + gradient[start] + output[start + 1]
                    + self.held_after[start + 1])
            self.segment[start, start + 1, memory >= need] = 0.0
        for length in range(2, self.steps + 1):
            for start in range(self.steps - length + 1):
                end = start + length
                splits = np.arange(start + 1, end)
                right = _shifted(self.segment[splits, end, :], int(activation[start]))
                total = right + self.segment[start, splits, :]
                total += (forward_prefix[splits] - forward_prefix[start])[:, None]
                need = (activation[start] + gradient[end] + self.held_after[end]
                        + self.advance_peak[start, splits])
                total[memory[None, :] < need[:, None]] = np.inf
                self._keep_best(self.segment[start, end], self.segment_split[start, end], total, splits)

    def _fill_sweeps(self, loss: int) -> None:
        memory = np.arange(self.budget_units + 1)
        activation, last = self.activation, self.steps
        for start in range(last - 1, -1, -1):
            run_on = max(activation[start] + self.advance_peak[start, last],
                         activation[start] + activation[last] + loss,
                         activation[start] + loss + self.gradient[last])
            straight = np.where(memory >= run_on, self.segment[start, last], np.inf)
            splits = np.arange(start + 1, last)
            right = _shifted(self.sweep[splits, :], int(activation[start]))
            total = np.vstack([right + self.segment[start, splits, :], straight])
            need = np.concatenate([activation[start] + self.advance_peak[start, splits], [0]])
            total[memory[None, :] < need[:, None]] = np.inf
            choices = np.concatenate([splits, [last]])
            self._keep_best(self.sweep[start], self.sweep_split[start], total, choices)

    @staticmethod
    def _keep_best(values: np.ndarray, choice: np.ndarray, total: np.ndarray, splits: np.ndarray) -> None:
        best = np.argmin(total, axis=0)
        values[:] = total[best, np.arange(total.shape[1])]
        choice[:] = np.where(np.isfinite(values), splits[best], -1)

    # ---- rebuilding the schedule -------------------------------------------------------------

    def operations(self) -> Iterator[OperationTuple]:
        """The optimal schedule for the whole budget, as (kind, step) pairs."""
        yield from self._sweep_operations(0, self.budget_units)

    def _sweep_operations(self, start: int, memory: int) -> Iterator[OperationTuple]:
        split = int(self.sweep_split[start, memory])
        yield from _advance(start, split)
        if split == self.steps:
            yield ("loss", self.steps)
            yield from self._segment_operations(start, self.steps, memory)
            return
        yield from self._sweep_operations(split, memory - int(self.activation[start]))
        yield from self._segment_operations(start, split, memory)

    def _segment_operations(self, start: int, end: int, memory: int) -> Iterator[OperationTuple]:
        if end == start + 1:
            yield ("backward", end)
            return
        split = int(self.segment_split[start, end, memory])
        yield from _advance(start, split)
        yield from self._segment_operations(split, end, memory - int(self.activation[start]))
        yield from self._segment_operations(start, split, memory)


def _advance(start: int, end: int) -> Iterator[OperationTuple]:
    """F_{start+1}..F_end from a_start, freeing each intermediate once its successor exists."""
    for step in range(start + 1, end + 1):
        yield ("forward", step)
        if step - 1 > start:
            yield ("free", step - 1)


def _shifted(values: np.ndarray, units: int) -> np.ndarray:
    """``out[..., m] = values[..., m - units]`` (inf where m < units): a subproblem with less room."""
    if units == 0:
        return values.copy()
    out = np.full_like(values, np.inf)
    if units < values.shape[-1]:
        out[..., units:] = values[..., : values.shape[-1] - units]
    return out
