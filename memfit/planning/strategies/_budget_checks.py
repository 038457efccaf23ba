"""The budget checks the strategies share: the device budget and the host's memory limit."""

from __future__ import annotations

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.data.units import format_bytes
from memfit.model.host_memory import host_peak_bytes, over_host
from memfit.model.schedule import live_buffers, lower, memory_profile

HOST_DROPPED = "host_dropped"  # plan param: swaps a strategy left out to stay within host_bytes


def live_at_peak(graph: CostGraph, plan: Plan) -> tuple[int, tuple[tuple[str, int], ...]]:
    """``plan``'s peak and the ``(tensor, bytes)`` live at it, largest first: what a
    ``BudgetError`` reports."""
    schedule = lower(graph, plan)
    profile = memory_profile(schedule)
    return profile.peak_bytes, tuple(live_buffers(schedule, profile.peak_index))


def fits(timeline: Timeline, budget_bytes: int | None, host_bytes: int | None) -> bool:
    """Whether a simulated plan fits both limits: its device peak the budget (``None``: any)
    and what it holds on the host at once ``host_bytes`` (``None``: any)."""
    return ((budget_bytes is None or timeline.peak_bytes <= budget_bytes)
            and not over_host(timeline.host_peak_bytes, host_bytes))


def host_params(dropped: tuple[str, ...]) -> dict[str, int]:
    """The plan param that records swaps left out for the host limit (none: no param)."""
    return {HOST_DROPPED: len(dropped)} if dropped else {}


def require_host(graph: CostGraph, plan: Plan, host_bytes: int | None,
                 budget_bytes: int | None = None) -> Plan:
    """Return ``plan`` if what it holds on the host at once fits ``host_bytes`` (``None``: no
    limit), else raise: the one check that no plan, whatever strategy made it, swaps more than
    the host holds.

    Raises:
        BudgetError: naming ``host_bytes``, with the plan's device peak as the minimum.
    """
    if host_bytes is None:
        return plan
    host_peak = host_peak_bytes(graph, plan)
    if not over_host(host_peak, host_bytes):
        return plan
    peak, dominant = live_at_peak(graph, plan)
    raise BudgetError(budget_bytes if budget_bytes is not None else peak, peak, dominant,
                      strategy=plan.strategy, host_bytes=host_bytes,
                      note=f"Its plan holds {format_bytes(host_peak)} on the host at once.")


def require_fit(graph: CostGraph, plan: Plan, budget_bytes: int | None,
                host_bytes: int | None = None) -> Plan:
    """Return ``plan`` if its peak fits ``budget_bytes`` (or there is none) and its host peak
    ``host_bytes`` (or there is none), else raise.

    Raises:
        BudgetError: with the plan's peak as the minimum and the largest tensors live at it;
            naming ``host_bytes`` where the plan swaps more than it, or where the strategy left
            swaps out for it (``params["host_dropped"]``).
    """
    require_host(graph, plan, host_bytes, budget_bytes)
    if budget_bytes is None:
        return plan
    peak, dominant = live_at_peak(graph, plan)
    if peak > budget_bytes:
        limited = host_bytes if plan.params.get(HOST_DROPPED) else None
        raise BudgetError(budget_bytes, peak, dominant, strategy=plan.strategy, host_bytes=limited)
    return plan
