"""The one budget check the fixed-plan strategies share."""

from __future__ import annotations

from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.plan import Plan
from memfit.core.schedule import live_buffers, lower, memory_profile


def require_fit(graph: CostGraph, plan: Plan, budget_bytes: int | None) -> Plan:
    """Return ``plan`` if its peak fits ``budget_bytes`` (or there is none), else raise.

    Raises:
        BudgetError: with the plan's peak as the minimum and the largest tensors live at it.
    """
    if budget_bytes is None:
        return plan
    schedule = lower(graph, plan)
    profile = memory_profile(schedule)
    if profile.peak_bytes > budget_bytes:
        dominant = live_buffers(schedule, profile.peak_index)
        raise BudgetError(budget_bytes, profile.peak_bytes, dominant, strategy=plan.strategy)
    return plan
