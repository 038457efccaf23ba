"""The swap + recompute MILP: the reference optimum that the planners are measured against."""

from __future__ import annotations

import pytest

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware, get_hardware
from memfit.data.plan import Plan, Swap
from memfit.model import synthetic
from memfit.model.schedule import check_plan, peak_bytes
from memfit.model.simulate import simulate
from memfit.planning.solvers.milp import solve_milp
from memfit.planning.solvers.milp_swap import solve_swap_milp
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.milp_swap_plan import SwapMilpPlan, plan_swap_milp

H100 = get_hardware("h100-pcie")
SLOW_LINK = H100.with_(name="slow-link", d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9)
SHARED_LINK = H100.with_(name="shared-link", d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9,
                         duplex=False)
OBJECTIVE_TOLERANCE = 1e-6  # the MILP's step time is the simulated one on every case below


def keep_peak(graph: CostGraph) -> int:
    return peak_bytes(graph, Plan("keep"))


def assert_valid(graph: CostGraph, hardware: Hardware, reference: SwapMilpPlan,
                 budget_bytes: int) -> None:
    """The decoded plan runs, fits, and its simulated step time is the MILP's, or a bit less
    (the MILP lands an early swap-in before the next op, the simulator before its reader)."""
    solution = reference.solution
    assert solution.found and reference.plan is not None, solution.status
    check_plan(graph, reference.plan)
    timeline = simulate(graph, reference.plan, hardware, record_intervals=False)
    assert timeline.peak_bytes == reference.peak_bytes <= budget_bytes
    assert timeline.step_time_s == reference.simulated_step_time_s
    assert reference.simulated_step_time_s <= solution.step_time_s * (1 + 1e-9)
    assert solution.step_time_s <= reference.simulated_step_time_s * (1 + OBJECTIVE_TOLERANCE)
    assert reference.plan.swapped == tuple(swapped.tensor for swapped in solution.swapped)
    assert [(r.op, r.before) for r in reference.plan.reruns] == list(solution.reruns)


def test_with_a_free_link_it_swaps_and_recomputes_nothing():
    graph = synthetic.chain(10, time_s=1e-2)
    fast = H100.with_(name="fast", d2h_bytes_per_s=1e13, h2d_bytes_per_s=1e13, copy_latency_s=0.0)
    budget_bytes = int(0.6 * keep_peak(graph))
    reference = plan_swap_milp(graph, fast, budget_bytes)
    assert_valid(graph, fast, reference, budget_bytes)
    assert reference.plan is not None and reference.plan.swapped and not reference.plan.reruns
    assert reference.solution.recompute_time_s == 0.0
    assert reference.solution.step_time_s == pytest.approx(graph.step_time_s, rel=1e-6)
    assert reference.simulated_step_time_s == pytest.approx(graph.step_time_s)


def test_with_a_very_slow_link_it_only_recomputes():
    graph = synthetic.chain(6)
    slow = H100.with_(name="very-slow", d2h_bytes_per_s=5e7, h2d_bytes_per_s=5e7)  # 21 ms a copy
    budget_bytes = int(0.7 * keep_peak(graph))
    reference = plan_swap_milp(graph, slow, budget_bytes)
    assert_valid(graph, slow, reference, budget_bytes)
    assert reference.plan is not None and not reference.plan.swapped and reference.plan.reruns
    recompute_only = solve_milp(graph, budget_bytes)
    assert reference.solution.recompute_time_s == pytest.approx(recompute_only.recompute_time_s)
    assert reference.solution.stall_s == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("graph", [synthetic.chain(8), synthetic.resnet_like(2)],
                         ids=lambda graph: graph.name)
def test_without_budget_pressure_it_keeps_everything(graph):
    reference = plan_swap_milp(graph, H100, keep_peak(graph))
    assert_valid(graph, H100, reference, keep_peak(graph))
    assert reference.plan is not None
    assert not reference.plan.decisions and not reference.plan.reruns
    assert reference.solution.step_time_s == pytest.approx(graph.step_time_s)


def test_below_the_smallest_peak_it_says_infeasible():
    graph = synthetic.chain(6)
    solution = solve_swap_milp(graph, H100, graph.resident_bytes + 1)
    assert solution.status == "infeasible" and not solution.swapped and not solution.reruns
    assert plan_swap_milp(graph, H100, graph.resident_bytes + 1).plan is None


def test_on_a_shared_slow_link_it_mixes_swaps_and_recomputation():
    """Swap-ins that would each outlast an op share the one link with the swap-outs; the
    optimum swaps what it can hide and recomputes the rest."""
    graph = synthetic.chain(8)
    budget_bytes = int(0.5 * keep_peak(graph))
    reference = plan_swap_milp(graph, SHARED_LINK, budget_bytes)
    assert_valid(graph, SHARED_LINK, reference, budget_bytes)
    plan = reference.plan
    assert plan is not None and plan.swapped and plan.reruns
    assert all(isinstance(plan.decision(t), Swap) for t in plan.swapped)


CASES = [
    (synthetic.chain(12), SLOW_LINK, 0.6),
    (synthetic.resnet_like(2), get_hardware("gh200"), 0.7),
    (synthetic.multi_tower(3, 3), H100, 0.75),
    (synthetic.multi_tower(3, 3), SHARED_LINK, 0.8),
]


@pytest.mark.slow
@pytest.mark.parametrize(("graph", "hardware", "fraction"), CASES,
                         ids=[f"{g.name}-{h.name}-{f}" for g, h, f in CASES])
def test_never_slower_than_recompute_only_or_the_swap_strategy(graph, hardware, fraction):
    budget_bytes = int(fraction * keep_peak(graph))
    reference = plan_swap_milp(graph, hardware, budget_bytes)
    assert_valid(graph, hardware, reference, budget_bytes)
    solution = reference.solution
    assert 20 <= len(graph.ops) <= 40 and solution.solve_time_s < 20
    recompute_only = solve_milp(graph, budget_bytes)
    if recompute_only.found:  # the recompute-only MILP is a feasible point of this one
        assert solution.step_time_s <= graph.step_time_s + recompute_only.recompute_time_s + 1e-12
    swap_plan = get_strategy("swap")(graph, hardware, budget_bytes)
    swap_time_s = simulate(graph, swap_plan, hardware, record_intervals=False).step_time_s
    assert reference.simulated_step_time_s <= swap_time_s * (1 + 1e-9)
