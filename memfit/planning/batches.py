"""Which batches ``max_batch_size`` plans: the bracket around the largest batch that fits, and
the fastest batch below it, as searches over an ``attempt(batch)`` callback.

Torch-free: the callback plans (or fakes) a batch, so the searches are tested on synthetic peaks
and a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from memfit.data.plan import Plan
from memfit.data.timeline import Timeline

__all__ = ["Trial", "FrontierPoint", "PlannedBatch", "bracket_largest", "search_fastest",
           "whole_bytes"]


@dataclass(frozen=True)
class Trial:
    """One batch the search tried.

    Args:
        batch_size: the batch.
        fits: whether it fit the budget.
        how: ``"planned"`` (on meta tensors) or ``"measured"`` (one real step).
        peak_bytes: the predicted (planned) or measured peak; the smallest reachable peak when
            planning failed.
        host_bytes: what its plan holds on the host at once (its simulated host peak; 0 when
            planning failed or measured).
        host_limited: planning failed with swaps held back by the profile's ``host_bytes``.
    """

    batch_size: int
    fits: bool
    how: str
    peak_bytes: int
    host_bytes: int = 0
    host_limited: bool = False


@dataclass(frozen=True)
class FrontierPoint:
    """One batch that fits, as planned: what a bigger batch costs in time and host memory.

    Args:
        batch_size: the batch.
        peak_bytes: its plan's predicted peak, whole device.
        step_time_s: its plan's predicted step time on the profile.
        host_bytes: bytes its plan holds on the host at once (its simulated host peak).
    """

    batch_size: int
    peak_bytes: int
    step_time_s: float
    host_bytes: int

    @property
    def samples_per_s(self) -> float:
        """Predicted throughput: the batch over the step time."""
        return self.batch_size / self.step_time_s if self.step_time_s else 0.0


@dataclass(frozen=True)
class PlannedBatch:
    """One batch's plan and its simulated step, as the searches compare them."""

    batch_size: int
    plan: Plan
    predicted: Timeline
    budget_bytes: int
    outside_bytes: int  # buffers and existing .grad: on the device, outside the graph
    host_bytes: int = 0  # held on the host at once (the simulated host peak)

    @property
    def at_full_speed(self) -> bool:
        """Nothing swapped or recomputed: the step runs as fast as unplanned."""
        return self.host_bytes == 0 and self.predicted.recompute_s == 0.0

    def point(self) -> FrontierPoint:
        return FrontierPoint(self.batch_size, whole_bytes(self), self.predicted.step_time_s,
                             self.host_bytes)


def whole_bytes(planned: PlannedBatch) -> int:
    """The whole device's predicted peak: the graph's and the bytes outside it."""
    return planned.predicted.peak_bytes + planned.outside_bytes


def bracket_largest(attempt: Callable[[int], PlannedBatch | None], tried: list[Trial],
                    budget_bytes: int, max_batch: int) -> PlannedBatch | None:
    """Grow from batch 1 until a batch does not fit (or ``max_batch``), then close the bracket.

    Note:
        A step's peak is close to affine in the batch, so each guess aims at the budget on the
        line through the last two peaks (a failed plan reports the smallest peak it could
        reach). Growth is at least one and at most 16x per guess; in the bracket, a guess that
        does not halve it is followed by a bisection, so the search costs at most twice plain
        bisection, and on an affine peak about four plans.
    """
    best = attempt(1)
    if best is None:
        return None
    previous = (0, 0)  # (batch, peak) of the fit before best; (0, 0) means "none yet"
    high, high_peak = 0, 0  # the smallest batch known not to fit (0: none yet), and its peak
    while not high:
        low, low_peak = best.batch_size, whole_bytes(best)
        if low >= max_batch:
            return best
        guess = 2 * low
        if previous[0]:  # a flat peak (the batch costs nothing yet) grows the most
            guess = 16 * low if low_peak <= previous[1] else \
                low + (budget_bytes - low_peak) * (low - previous[0]) // (low_peak - previous[1])
        guess = min(max(guess, low + 1), 16 * low, max_batch)
        planned = attempt(guess)
        if planned is None:
            high, high_peak = guess, tried[-1].peak_bytes
        else:
            previous, best = (low, low_peak), planned
    low, low_peak = best.batch_size, whole_bytes(best)
    bisect = False
    while high - low > 1:
        middle = (low + high) // 2
        if not bisect and high_peak > low_peak:
            guess = low + (budget_bytes - low_peak) * (high - low) // (high_peak - low_peak)
            middle = min(max(guess, low + 1), high - 1)
        width = high - low
        planned = attempt(middle)
        if planned is None:
            high, high_peak = middle, tried[-1].peak_bytes
        else:
            low, best, low_peak = middle, planned, whole_bytes(planned)
        bisect = not bisect and 2 * (high - low) > width
    return best


def search_fastest(attempt: Callable[[int], PlannedBatch | None], largest: PlannedBatch,
                   fitting: Mapping[int, PlannedBatch], refine_rounds: int = 3) -> PlannedBatch:
    """The fitting batch with the most predicted samples/s, planning few batches.

    Halves down from ``largest`` until a plan runs at full speed (nothing swapped or
    recomputed), then, ``refine_rounds`` times, plans the midpoints between the best batch
    planned so far and its planned neighbours. ``attempt`` adds each batch that fits to
    ``fitting``, where every batch (the bracketing search's too) is a candidate.

    Note:
        Below a batch that runs at full speed no batch is faster: its step is the unplanned
        one, whose time per sample only falls with the batch (a fixed cost per op spread over
        more samples), so the halving can stop there. Between planned batches throughput is
        assumed to have one peak; the refinement finds it within a few plans, not exactly.
    """
    batch = largest.batch_size
    while batch > 1 and not (batch in fitting and fitting[batch].at_full_speed):
        batch //= 2
        attempt(batch)
    for _ in range(refine_rounds):
        best = fastest_of(fitting)
        planned = sorted(fitting)
        index = planned.index(best.batch_size)
        neighbours = planned[max(index - 1, 0):index + 2]
        middles = {(best.batch_size + other) // 2 for other in neighbours} - set(fitting)
        if not middles:
            break
        for middle in sorted(middles):
            attempt(middle)
    return fastest_of(fitting)


def fastest_of(fitting: Mapping[int, PlannedBatch]) -> PlannedBatch:
    """The most samples/s; of equals, the smaller batch (less memory for the same speed)."""
    return max(fitting.values(), key=lambda p: (p.point().samples_per_s, -p.batch_size))
