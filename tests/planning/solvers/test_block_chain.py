"""Revolve over the separator blocks: the chain DP's schedule lowered to re-runs."""

import pytest

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Rerun
from memfit.model import synthetic
from memfit.model.profile import BaseProfile
from memfit.model.schedule import check_plan
from memfit.model.simulate import simulate
from memfit.planning.solvers.block_chain import BlockChain, NestedSchedule, next_chain_budget
from memfit.planning.solvers.chain import solve_chain_costs
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.recomputing.optimal_recompute import (
    _least_fitting,
    nested_reruns,
    priced_segments,
)

HARDWARE = get_hardware("h100-pcie")
GRAPHS = {"chain30": lambda: synthetic.chain(30), "resnet12": lambda: synthetic.resnet_like(12)}


def band(graph):
    """memory-poor's peak and the segment DP's smallest: the budgets nested blocks are for."""
    poor = simulate(graph, get_strategy("memory-poor")(graph, HARDWARE), HARDWARE)
    return poor, _least_fitting(graph, BaseProfile.of(graph), 1)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("share", [0.9, 0.5])
def test_fits_below_the_segment_dp_for_a_fraction_of_memory_poors_recompute(name, share):
    graph = GRAPHS[name]()
    poor, smallest = band(graph)
    budget = int(poor.peak_bytes + share * (smallest - poor.peak_bytes))
    blocks, _ = priced_segments(graph)
    made = nested_reruns(graph, HARDWARE, blocks, budget)
    assert made is not None and made.reruns and not made.decisions
    check_plan(graph, made)
    timeline = simulate(graph, made, HARDWARE)
    assert timeline.peak_bytes <= budget
    assert timeline.recompute_s < poor.recompute_s / 3
    chosen = get_strategy("optimal-recompute")(graph, HARDWARE, budget, method="segments")
    assert chosen.params["solver"] == "nested blocks" and chosen.reruns == made.reruns


def test_the_lowering_is_the_chain_schedule():
    """On a chain every block is one step with nothing inside: the plan re-runs exactly the
    schedule's forward steps, and its peak is the chain's plus the resident bytes and one
    activation (the chain model frees a step's input as its backward allocates the gradient;
    program order holds both for one op)."""
    graph = synthetic.chain(30)
    blocks, _ = priced_segments(graph)
    chain = BlockChain.from_blocks(graph, blocks)
    assert chain.largest_inner_bytes == 0
    largest = max(chain.costs.activation_bytes)
    for chain_budget in (4 * largest, 6 * largest, 9 * largest):
        schedule = solve_chain_costs(chain.costs, chain_budget, memory_units=200)
        assert schedule is not None
        reruns = tuple(Rerun(op, before) for op, before in chain.reruns(schedule.operations))
        made = Plan("nested", graph_hash=graph.structure_hash, reruns=reruns)
        timeline = simulate(graph, made, HARDWARE)
        assert timeline.recompute_s == pytest.approx(schedule.recompute_time_s)
        extra = timeline.peak_bytes - graph.resident_bytes - schedule.peak_bytes
        assert 0 <= extra <= largest + 4096


def test_no_plan_below_what_the_chain_can_reach():
    graph = synthetic.chain(30)
    blocks, _ = priced_segments(graph)
    assert nested_reruns(graph, HARDWARE, blocks, graph.resident_bytes + 1) is None


def test_a_repeated_schedule_is_cut_from_what_it_uses():
    """The tightening's next chain budget: lowered by the excess, but from the schedule's own
    peak when the last cut found the same schedule (the DP returns it down to that peak)."""
    first, same = NestedSchedule((), chain_peak_bytes=700), NestedSchedule((), chain_peak_bytes=700)
    assert next_chain_budget(1000, 50, first, None) == 950
    assert next_chain_budget(950, 50, same, first) == 650
    assert next_chain_budget(950, 50, NestedSchedule((), 690), first) == 900
