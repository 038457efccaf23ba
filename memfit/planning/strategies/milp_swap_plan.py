"""The swap + recompute MILP's schedule as a simulated memfit plan: the reference for ``auto``.

The solver (``memfit.planning.solvers.milp_swap``) returns POET's schedule in its own terms; here
it becomes a ``Plan`` named ``"milp-swap"`` (``Swap`` decisions with their ``SwapIn``s, queued in
the solver's order, and ``Rerun``s) and ``simulate`` prices it. Not a registered strategy: it is
for graphs of tens of ops, and ``auto`` and the benchmarks compare against it rather than pick it.

Example:
    >>> from memfit.model import synthetic
    >>> from memfit.data.hardware import get_hardware
    >>> from memfit.model.schedule import peak_bytes
    >>> graph = synthetic.chain(6)
    >>> budget_bytes = int(0.7 * peak_bytes(graph, Plan("keep")))
    >>> reference = plan_swap_milp(graph, get_hardware("h100-pcie"), budget_bytes)
    >>> reference.solution.status, reference.plan.swapped != (), reference.plan.reruns
    ('optimal', True, ())
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Decision, Plan, Rerun, Swap, SwapIn
from memfit.model.simulate import simulate
from memfit.planning.solvers.milp import NODE_LIMIT
from memfit.planning.solvers.milp_swap import SwapMilpSolution, solve_swap_milp

__all__ = ["SwapMilpPlan", "plan_swap_milp", "solution_plan"]


@dataclass(frozen=True)
class SwapMilpPlan:
    """The MILP's solution, the plan it decodes to, and what ``simulate`` makes of that plan.

    Args:
        solution: the solver's schedule, status and objective.
        plan: the decoded plan (``None`` when no schedule was found).
        simulated_step_time_s: ``simulate``'s step time of ``plan`` (inf when none).
        peak_bytes: ``simulate``'s peak of ``plan`` (-1 when none).
    """

    solution: SwapMilpSolution
    plan: Plan | None
    simulated_step_time_s: float = float("inf")
    peak_bytes: int = -1


def plan_swap_milp(graph: CostGraph, hardware: Hardware, budget_bytes: int, *,
                   node_limit: int = NODE_LIMIT, mip_rel_gap: float = 1e-4) -> SwapMilpPlan:
    """Solve the swap + recompute MILP (``solve_swap_milp``, whose arguments these are), build
    its plan and simulate it.

    An infeasible budget is not an error: ``solution.status`` says ``"infeasible"`` and ``plan``
    is ``None``.
    """
    solution = solve_swap_milp(graph, hardware, budget_bytes, node_limit=node_limit,
                               mip_rel_gap=mip_rel_gap)
    if not solution.found:
        return SwapMilpPlan(solution, None)
    plan = solution_plan(graph, hardware, budget_bytes, solution,
                          {"node_limit": node_limit, "mip_rel_gap": mip_rel_gap})
    timeline = simulate(graph, plan, hardware, record_intervals=False)
    return SwapMilpPlan(solution, plan, timeline.step_time_s, timeline.peak_bytes)


def solution_plan(graph: CostGraph, hardware: Hardware, budget_bytes: int,
                   solution: SwapMilpSolution, params: dict) -> Plan:
    """The solution in memfit's plan language: its re-runs, and per swapped tensor one ``Swap``
    whose ``SwapIn``s serve its readers; decisions in the solver's order, which is the order the
    swap-ins issued after one op queue."""
    decisions: dict[str, Decision] = {
        swapped.tensor: Swap(tuple(SwapIn(after, readers) for after, readers in swapped.swap_ins),
                             reason="swap+recompute MILP")
        for swapped in solution.swapped}
    return Plan("milp-swap", decisions, graph_hash=graph.structure_hash, params=params,
                budget_bytes=budget_bytes, hardware=hardware.name,
                reruns=tuple(Rerun(op, before) for op, before in solution.reruns))
