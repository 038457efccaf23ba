"""The least recomputation that fits a budget: Checkmate's MILP, solved by HiGHS, as re-runs.

The MILP (``memfit.solvers.milp``) decides, before every op of the step, which forward ops to run
again; each such decision becomes a ``Rerun(op, before)`` in the plan, so a value may be rebuilt
many times, as the optimum often wants. Its memory accounting is memfit's own (program order,
resident bytes included), and the plan is checked by simulation before it is returned.

Note:
    The MILP has one binary per (stage, op) pair, so it is for graphs of up to a few hundred ops
    (``max_ops``); a captured transformer or ResNet is larger. For those, a dynamic program over
    the chain of separator blocks is the next step; until then this strategy refuses them with a
    clear error instead of running for hours.
"""

from __future__ import annotations

from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.hardware import Hardware
from memfit.core.plan import Plan, Rerun
from memfit.core.simulate import simulate
from memfit.solvers.milp import solve_milp
from memfit.strategies import register


def check_params(max_ops: int = 250, time_limit_s: float = 60.0, **unknown) -> None:
    """Validate optimal-recompute's parameters without a graph."""
    if unknown:
        raise ValueError(f"strategy 'optimal-recompute' got unknown parameters {sorted(unknown)}; "
                         "it accepts max_ops= and time_limit_s=")
    if not isinstance(max_ops, int) or isinstance(max_ops, bool) or max_ops < 1:
        raise ValueError(f"max_ops must be a positive int, got {max_ops!r}")
    if not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


@register("optimal-recompute")
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, *,
         max_ops: int = 250, time_limit_s: float = 60.0, **unknown) -> Plan:
    """The recomputation schedule with the least recompute time whose peak fits ``budget_bytes``.

    Args:
        max_ops: the largest graph handed to the MILP (default 250 ops, about a minute here).
        time_limit_s: HiGHS's time limit; a schedule found but not proven optimal is still used.

    Raises:
        ValueError: for bad parameters, no budget, or a graph larger than ``max_ops``.
        BudgetError: if no recomputation schedule fits the budget.
    """
    check_params(max_ops, time_limit_s, **unknown)
    if budget_bytes is None:
        raise ValueError("optimal-recompute needs a budget: memfit.compile(..., budget='0.5')")
    if len(graph.ops) > max_ops:
        raise ValueError(
            f"this graph has {len(graph.ops)} ops, more than the MILP's max_ops={max_ops}; "
            "raise max_ops (the solve grows fast) or use strategy='checkpoint' with a budget"
        )
    solution = solve_milp(graph, budget_bytes, time_limit_s=time_limit_s)
    if not solution.found:
        minimum = simulate(graph, _memory_poor(graph), hardware, record_intervals=False).peak_bytes
        raise BudgetError(budget_bytes, minimum, strategy="optimal-recompute")
    reruns = tuple(
        Rerun(op, stage[-1]) for stage in solution.computed for op in stage[:-1]
        if graph.op(op).outputs  # views allocate nothing; the rewriter replays them anyway
    )
    made = Plan("optimal-recompute", graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, reruns=reruns,
                params={"max_ops": max_ops, "time_limit_s": time_limit_s,
                        "milp_status": solution.status})
    predicted = simulate(graph, made, hardware, record_intervals=False).peak_bytes
    if predicted > budget_bytes:  # the MILP's accounting is an upper bound; this is a safeguard
        raise BudgetError(budget_bytes, predicted, strategy="optimal-recompute")
    return made


def _memory_poor(graph: CostGraph) -> Plan:
    from memfit.strategies.memory_poor import plan as memory_poor

    return memory_poor(graph, Hardware("none", {"float32": 1.0}, 1.0, 1.0, 1.0))
