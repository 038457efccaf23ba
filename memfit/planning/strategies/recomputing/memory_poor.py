"""The memory-poor strategy of the gradient-checkpointing article: keep nothing, rebuild all.

Right before every backward op, each forward value it reads is rebuilt from the graph inputs,
so activations need O(1) memory on a chain, for O(n^2) recomputation. It is the far end of the
trade-off that the other strategies interpolate, and it exercises re-runs that rebuild one value
many times (``Plan.reruns``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Rerun
from memfit.model.recompute import memory_poor_reruns
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import require_fit
from memfit.planning.strategies._strategy_config import StrategyConfig


@dataclass(frozen=True)
class MemoryPoorConfig(StrategyConfig):
    """memory-poor takes no parameters."""

    strategy: ClassVar[str] = "memory-poor"


@register("memory-poor", config=MemoryPoorConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params) -> Plan:
    """Rebuild every forward value from the inputs before each backward op that reads it.

    Raises:
        ValueError: if any parameter is given.
        BudgetError: if even this does not fit ``budget_bytes``.
    """
    MemoryPoorConfig.from_params(params)
    reruns = tuple(Rerun(op, before) for op, before in memory_poor_reruns(graph))
    made = Plan("memory-poor", {}, graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, reruns=reruns)
    return require_fit(graph, made, budget_bytes)
