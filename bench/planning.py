"""How long ``strategy="auto"`` takes to plan a 10,000-op step, on graph shapes that stress it.

Issue 4's goal: planning a 10,000-op graph takes under 10 s on this machine. Each shape is a
synthetic forward pass (``memfit.model.synthetic``) sized to about 10,000 ops with its backward
pass, planned for ``h100-pcie`` at 90/50/30% of its unplanned peak; each figure is the wall time
of one ``auto`` call on a freshly built graph (nothing cached from an earlier budget), after one
small plan that pays the imports. The shapes: a chain (every op an articulation point: the
separator counts and the segment table are largest), eight towers (no articulation points:
separator sets from the tree decomposition), a ResNet (a skip around every two convolutions)
and a random DAG (three inputs per op: few separators, and the recompute plans do not fit).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.data.tables import table
from memfit.model import synthetic
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy

PLANNING_TITLE = "## Planning time on 10,000-op graphs (auto)"
PLANNING_GOAL_S = 10.0
FRACTIONS = (0.9, 0.5, 0.3)
PROFILE = "h100-pcie"
HEADERS = ("graph", "ops", "budget", "auto's choice", "plan call", "goal (< 10 s)")


def shapes(forward_ops: int) -> dict[str, Callable[[], CostGraph]]:
    """The benchmarked shapes, each with about ``forward_ops`` forward ops (twice that in all)."""
    return {
        "chain": lambda: synthetic.chain(forward_ops),
        "8 towers": lambda: synthetic.multi_tower(8, forward_ops // 8),
        "ResNet-like": lambda: synthetic.resnet_like(round(forward_ops * 0.222)),
        "random DAG": lambda: synthetic.random_dag(round(forward_ops * 0.82)),
    }


def planning_rows(forward_ops: int = 5000, log: Callable[[str], None] = print) -> list[list]:
    """One row per shape and budget: ops, the candidate auto chose, its plan call's wall time."""
    hardware = get_hardware(PROFILE)
    warm = synthetic.chain(20)
    get_strategy("auto")(warm, hardware, _peak(warm, hardware) // 2)  # imports, first calls
    rows = []
    for name, build in shapes(forward_ops).items():
        for fraction in FRACTIONS:
            graph = build()
            budget_bytes = int(fraction * _peak(graph, hardware))
            started = time.perf_counter()
            try:
                chosen = get_strategy("auto")(graph, hardware, budget_bytes).params["solver"]
            except BudgetError:
                chosen = "no plan fits"
            seconds = time.perf_counter() - started
            log(f"planning {name} ({len(graph.ops)} ops) at {fraction:.0%}: {seconds:.1f} s")
            rows.append([name, len(graph.ops), f"{fraction:.0%}", chosen, f"{seconds:.1f} s",
                         "met" if seconds < PLANNING_GOAL_S else "not met"])
    return rows


def planning_section(log: Callable[[str], None] = print, forward_ops: int = 5000) -> str:
    """The Markdown section: what was measured, the table, the goal's verdict."""
    rows = planning_rows(forward_ops, log)
    met = all(row[-1] == "met" for row in rows)
    return "\n".join([
        PLANNING_TITLE,
        "",
        f"Wall time of one `auto` plan call per row, on a fresh graph, profile `{PROFILE}`, "
        "budgets as fractions of the unplanned simulated peak. \"no plan fits\" is a "
        "`BudgetError` (every candidate tried); its time counts too.",
        "",
        table(HEADERS, rows),
        "",
        f"Goal (issue 4, planning a 10,000-op graph in under {PLANNING_GOAL_S:.0f} s): "
        + ("met on every row." if met else "not met on every row."),
    ])


def _peak(graph: CostGraph, hardware) -> int:
    return simulate(graph, Plan("keep"), hardware, record_intervals=False).peak_bytes
