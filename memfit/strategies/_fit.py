"""The one budget check the fixed-plan strategies share."""

from __future__ import annotations

from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.plan import Plan
from memfit.core.schedule import live_buffers, lower, memory_profile


def live_at_peak(graph: CostGraph, plan: Plan) -> tuple[int, tuple[tuple[str, int], ...]]:
    """``plan``'s peak and the ``(tensor, bytes)`` live at it, largest first: what a
    ``BudgetError`` reports."""
    schedule = lower(graph, plan)
    profile = memory_profile(schedule)
    return profile.peak_bytes, tuple(live_buffers(schedule, profile.peak_index))


def require_fit(graph: CostGraph, plan: Plan, budget_bytes: int | None) -> Plan:
    """Return ``plan`` if its peak fits ``budget_bytes`` (or there is none), else raise.

    Raises:
        BudgetError: with the plan's peak as the minimum and the largest tensors live at it.
    """
    if budget_bytes is None:
        return plan
    peak, dominant = live_at_peak(graph, plan)
    if peak > budget_bytes:
        raise BudgetError(budget_bytes, peak, dominant, strategy=plan.strategy)
    return plan
