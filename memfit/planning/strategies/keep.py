"""The unplanned step: every tensor stays on the device."""

from __future__ import annotations

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import require_fit


def check_params(**params) -> None:
    """keep takes no parameters."""
    if params:
        raise ValueError(f"strategy 'keep' takes no parameters, got {sorted(params)}")


@register("keep")
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params) -> Plan:
    """Keep every tensor: the plan of the unmodified step.

    Raises:
        ValueError: if any parameter is given (keep has none).
        BudgetError: if a budget is given and the unplanned peak exceeds it.
    """
    check_params(**params)
    result = Plan("keep", graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                  hardware=hardware.name)
    return require_fit(graph, result, budget_bytes)
