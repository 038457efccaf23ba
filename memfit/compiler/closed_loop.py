"""The closed loop: a measured step over the budget makes the next one run a tighter plan.

The planner's memory model is exact for what it can see; an allocator that rounds up, or a kernel
whose real output storage is larger than its fake one, is not. When a measured peak runs over the
budget, the step still completes (its gradients are exact), and the next step runs a plan made for
a budget lowered by the excess. After ``CLOSED_LOOP.max_rounds`` plans, or when no tighter plan
exists, it warns (``BudgetWarning``) with the bytes still over, and stops trying.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from memfit.data.errors import BudgetError, BudgetWarning
from memfit.data.timeline import Timeline
from memfit.data.units import Budget, format_bytes
from memfit.model.schedule import PlanError
from memfit.planning.step import Planned

__all__ = ["CLOSED_LOOP", "ClosedLoop", "Loop", "Round"]


@dataclass(frozen=True)
class ClosedLoop:
    """How a step re-plans after a measured peak over the budget (``CLOSED_LOOP``)."""

    max_rounds: int = 4  # plans per input signature, the first included; then warn
    margin_fraction: float = 0.1  # the planning budget drops by the excess plus this much of it
    margin_bytes: int = 512  # ... plus one CUDA allocator block, so rounding cannot undo it


CLOSED_LOOP = ClosedLoop()


@dataclass(frozen=True)
class Round:
    """One plan of the closed loop, in whole-device bytes (bytes outside the graph included).

    Args:
        planning_budget_bytes: the budget the plan was made for (the user's, in the first round).
        predicted_peak_bytes: the simulator's peak of that plan.
        measured_peak_bytes: the highest measured peak of the steps run with it (``None`` before).
        step_time_s: the measured time of its first step.
    """

    planning_budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    step_time_s: float | None = None


PlanFor = Callable[[int], Planned]  # a plan of the same graph for a whole-device budget in bytes


@dataclass
class Loop:
    """The closed loop of one input signature.

    Args:
        rounds: one ``Round`` per plan, the first made for the user's budget.
        settled: the loop stopped (it fits, or it warned that it cannot).
        planning: the budget the next trace of the step plans for (``None``: the user's).
    """

    rounds: list[Round] = field(default_factory=list)
    settled: bool = False
    planning: Budget | None = None

    def record(self, planned: Planned, measured: Timeline, plan_for: PlanFor) -> bool:
        """Record one measured step of ``planned``; returns whether a tighter plan is due.

        ``planned`` is the plan that ran; ``plan_for`` plans its graph for another budget.
        """
        budget_bytes = self.rounds[0].planning_budget_bytes if self.rounds else \
            planned.budget.device_bytes
        if budget_bytes is None:
            return False
        if not self.rounds:
            self.rounds.append(Round(budget_bytes, planned.predicted_peak_bytes))
        last = self.rounds[-1]
        self.rounds[-1] = replace(
            last, measured_peak_bytes=max(last.measured_peak_bytes or 0, measured.peak_bytes),
            step_time_s=measured.step_time_s if last.step_time_s is None else last.step_time_s)
        excess = measured.peak_bytes - budget_bytes
        if excess <= 0 or self.settled:
            return False
        over = (f"the measured peak {format_bytes(measured.peak_bytes)} is over the budget "
                f"{format_bytes(budget_bytes)} by {format_bytes(excess)}")
        if len(self.rounds) >= CLOSED_LOOP.max_rounds:
            return self._give_up(f"{over} after {len(self.rounds)} plans")
        margin = int(excess * CLOSED_LOOP.margin_fraction) + CLOSED_LOOP.margin_bytes
        # the plan's own peak, not just its budget, must drop by the excess: a plan predicted
        # under its budget leaves that slack for the model's error to eat first
        planning = min(last.planning_budget_bytes, last.predicted_peak_bytes) - excess - margin
        outside = planned.budget.outside_bytes  # parameters, gradients, state: no plan drops them
        if planning <= outside:
            return self._give_up(f"{over}, and the budget is below what the model holds beside "
                                 f"the step's activations ({format_bytes(outside)}: its "
                                 f"parameters, gradients and optimizer state), which no plan "
                                 "can drop. Raise the budget above that")
        try:
            made, planning = _tighter(plan_for, planning, last.predicted_peak_bytes)
        except (BudgetError, PlanError) as error:
            return self._give_up(f"{over}, and no plan fits a tighter "
                                 f"{format_bytes(planning)}: {error}")
        if made.predicted_peak_bytes >= planned.predicted_peak_bytes:
            return self._give_up(f"{over}, and re-planning for {format_bytes(planning)} does not "
                                 "lower the peak")
        self.rounds.append(Round(planning, made.predicted_peak_bytes))
        self.planning = Budget(bytes=planning)
        return True

    def _give_up(self, why: str) -> bool:
        self.settled = True
        warnings.warn(f"memfit: {why.rstrip('.')}. Lower the budget you pass, or shrink the batch.",
                      BudgetWarning, stacklevel=4)
        return False


def _tighter(plan_for: PlanFor, planning_bytes: int, predicted_bytes: int) -> tuple[Planned, int]:
    """A plan for ``planning_bytes``; if none fits, the smallest one under ``predicted_bytes``.
    Returns the plan and the budget it was made for.

    Note:
        The excess is what the last plan measured over its prediction; the next plan may swap or
        recompute the very tensors that caused it, so the tightest plan is worth one measured
        try before giving up.
    """
    try:
        return plan_for(max(planning_bytes, 1)), planning_bytes
    except BudgetError as error:
        if error.minimum_bytes >= predicted_bytes:
            raise
        return plan_for(error.minimum_bytes), error.minimum_bytes
