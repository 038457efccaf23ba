"""auto against the reference optimum: the swap + recompute MILP (``plan_swap_milp``).

The acceptance: wherever the MILP solves, auto's simulated step time is within 5% of it, at every
budget from 90% of the unplanned peak down to the feasible minimum. The graphs are small enough
for HiGHS to prove optimality in about a second; both sides are priced by ``simulate``. Near
auto's minimum the MILP is often infeasible: its memory rows free an op's outputs together
(``milp_swap.MISMATCHES``), so auto's per-storage plans reach lower than the MILP can.
"""

import pytest

from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.model import synthetic
from memfit.model.simulate import simulate
from memfit.planning.solvers.milp_swap import solve_swap_milp
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.milp_swap_plan import plan_swap_milp

WITHIN = 0.05
GRAPHS = {
    "chain": lambda: synthetic.chain(12),
    "chain_fast_ops": lambda: synthetic.chain(12, time_s=2e-4),  # copies barely hide
    "resnet_like": lambda: synthetic.resnet_like(3),
    "towers": lambda: synthetic.multi_tower(2, 4),
    "random_dag": lambda: synthetic.random_dag(14, seed=2),
}


def budgets(graph, hardware):
    """90/70/50% of the unplanned peak where feasible, and auto's own minimum."""
    keep_peak = simulate(graph, Plan("keep"), hardware, record_intervals=False).peak_bytes
    with pytest.raises(BudgetError) as refused:
        get_strategy("auto")(graph, hardware, 1)
    minimum = refused.value.minimum_bytes
    fractions = [int(f * keep_peak) for f in (0.9, 0.7, 0.5) if f * keep_peak > minimum]
    return sorted({*fractions, minimum}, reverse=True), minimum


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["h100-pcie", "gh200"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_auto_is_within_five_percent_of_the_milp(name, profile):
    graph, hardware = GRAPHS[name](), get_hardware(profile)
    chosen, _ = budgets(graph, hardware)
    compared = 0
    for budget_bytes in chosen:
        made = get_strategy("auto")(graph, hardware, budget_bytes)
        timeline = simulate(graph, made, hardware, record_intervals=False)
        assert timeline.peak_bytes <= budget_bytes
        optimum = plan_swap_milp(graph, hardware, budget_bytes)
        if optimum.solution.status == "infeasible":
            continue  # the MILP counts memory per op, not per storage: auto reaches lower
        assert optimum.solution.status == "optimal", (budget_bytes, optimum.solution.status)
        compared += 1
        assert timeline.step_time_s <= optimum.simulated_step_time_s * (1 + WITHIN), (
            budget_bytes, made.params["solver"], timeline.step_time_s,
            optimum.simulated_step_time_s)
    assert compared >= 1  # the 90% budget at least is the MILP's to solve


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_below_autos_minimum_the_milp_finds_nothing_either(name):
    """auto's feasible minimum is the true one, to 5%: the MILP cannot fit 95% of it."""
    graph, hardware = GRAPHS[name](), get_hardware("h100-pcie")
    _, minimum = budgets(graph, hardware)
    assert solve_swap_milp(graph, hardware, int(0.95 * minimum)).status == "infeasible"
