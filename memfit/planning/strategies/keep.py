"""The unplanned step: every tensor stays on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import require_fit
from memfit.planning.strategies._strategy_config import StrategyConfig


@dataclass(frozen=True)
class KeepConfig(StrategyConfig):
    """keep takes no parameters."""

    strategy: ClassVar[str] = "keep"


@register("keep", config=KeepConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params) -> Plan:
    """Keep every tensor: the plan of the unmodified step.

    Raises:
        ValueError: if any parameter is given (keep has none).
        BudgetError: if a budget is given and the unplanned peak exceeds it.
    """
    KeepConfig.from_params(params)
    result = Plan("keep", graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                  hardware=hardware.name)
    return require_fit(graph, result, budget_bytes)
