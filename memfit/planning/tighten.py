"""Tighten by the excess: plan again at a lower target while the exact peak is over the budget.

A planner whose fast model can miss the exact peak (the segment DP's decomposition where a value
is read across a separator, the chain DP's model of blocks) checks each plan with the exact
profiler or simulator and, while it is over the budget, plans again at a target lowered by the
excess. The loop is written once here; a caller gives its planner, its rounds and its policy for
the next target.

Note:
    The compiler's closed loop (``memfit.compiler.closed_loop``) lowers by the excess too, but
    one round per measured step, across steps, with a margin and a warning when it stops: a
    different loop, kept there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["by_the_excess", "tighten"]

PlanT = TypeVar("PlanT")

# (the target it was planned for, the excess bytes, the plan over budget, the round's before it or
# None) -> the next round's target
NextTarget = Callable[[int, int, PlanT, "PlanT | None"], int]


def by_the_excess(target_bytes: int, excess_bytes: int, planned: object,
                  previous: object | None) -> int:
    """The plain policy: the next target is this one lowered by the excess."""
    return target_bytes - excess_bytes


def tighten(budget_bytes: int, plan_at: Callable[[int], tuple[PlanT, int] | None], *,
            rounds: int, start_bytes: int | None = None,
            next_target: NextTarget[PlanT] = by_the_excess) -> PlanT | None:
    """The first plan whose exact peak fits ``budget_bytes``, planning at ever lower targets.

    Args:
        budget_bytes: what the exact peak must fit.
        plan_at: plans for a target in bytes; returns the plan and its exact peak in bytes, or
            ``None`` when nothing is planned at that target (the loop stops there).
        rounds: plans tried at most; then ``None``.
        start_bytes: the first round's target (default ``budget_bytes``: a planner whose own
            accounting has a different origin, like the chain DP's, starts elsewhere).
        next_target: the policy for the next target (default: lowered by the excess).

    Returns:
        The first plan that fits, or ``None`` if none did within ``rounds``.
    """
    target_bytes = budget_bytes if start_bytes is None else start_bytes
    previous: PlanT | None = None
    for _ in range(rounds):
        attempt = plan_at(target_bytes)
        if attempt is None:
            return None
        planned, peak_bytes = attempt
        if peak_bytes <= budget_bytes:
            return planned
        target_bytes = next_target(target_bytes, peak_bytes - budget_bytes, planned, previous)
        previous = planned
    return None
