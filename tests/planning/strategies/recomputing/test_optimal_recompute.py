"""optimal-recompute: the MILP's schedule as re-runs; it fits, and never recomputes more."""

import pytest

from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.model import synthetic
from memfit.model.simulate import simulate
from memfit.planning.solvers.milp import solve_milp
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.recomputing import optimal_recompute

HARDWARE = get_hardware("h100-pcie")


def keep_peak(graph):
    return simulate(graph, Plan("keep"), HARDWARE).peak_bytes


@pytest.mark.parametrize("graph", [synthetic.chain(8), synthetic.resnet_like(2)],
                         ids=["chain8", "resnet2"])
def test_fits_equals_the_milp_and_beats_checkpointing(graph):
    budget = int(0.8 * keep_peak(graph))
    made = get_strategy("optimal-recompute")(graph, HARDWARE, budget)
    timeline = simulate(graph, made, HARDWARE)
    assert timeline.peak_bytes <= budget
    assert timeline.recompute_s == pytest.approx(solve_milp(graph, budget).recompute_time_s)
    try:
        checkpointed = get_strategy("checkpoint")(graph, HARDWARE, budget)
    except BudgetError:
        return  # checkpointing cannot even fit: nothing to compare
    assert timeline.recompute_s <= simulate(graph, checkpointed, HARDWARE).recompute_s + 1e-12


def test_errors_say_what_to_do():
    graph = synthetic.chain(4)
    strategy = get_strategy("optimal-recompute")
    with pytest.raises(ValueError, match="needs a budget"):
        strategy(graph, HARDWARE)
    with pytest.raises(ValueError, match="max_ops"):
        strategy(graph, HARDWARE, keep_peak(graph), method="milp", max_ops=5)
    with pytest.raises(ValueError, match="method must be one of"):
        strategy(graph, HARDWARE, keep_peak(graph), method="fastest")
    with pytest.raises(ValueError, match="unknown parameters"):
        strategy(graph, HARDWARE, keep_peak(graph), speed=1)
    with pytest.raises(BudgetError):
        strategy(graph, HARDWARE, graph.resident_bytes)


def test_large_graphs_go_to_the_segment_dp_and_fit():
    graph = synthetic.resnet_like(12)  # 112 ops: above the MILP's default max_ops
    budget = int(0.7 * keep_peak(graph))
    made = get_strategy("optimal-recompute")(graph, HARDWARE, budget)
    assert made.params["solver"] in ("segments", "checkpoint speed", "checkpoint memory")
    timeline = simulate(graph, made, HARDWARE)
    assert timeline.peak_bytes <= budget
    for mode in ("memory", "speed"):
        try:
            fixed = get_strategy("checkpoint")(graph, HARDWARE, budget, checkpoints=mode)
        except BudgetError:
            continue
        assert timeline.recompute_s <= simulate(graph, fixed, HARDWARE).recompute_s + 1e-12


def test_segment_dp_budget_error_names_its_smallest_fit():
    graph = synthetic.chain(30)
    strategy = get_strategy("optimal-recompute")
    with pytest.raises(BudgetError) as error:
        strategy(graph, HARDWARE, graph.resident_bytes + 1, method="segments")
    smallest = error.value.minimum_bytes
    assert graph.resident_bytes < smallest < keep_peak(graph)
    made = strategy(graph, HARDWARE, smallest, method="segments")
    assert simulate(graph, made, HARDWARE).peak_bytes <= smallest


def test_below_the_dp_reach_memory_poor_still_fits():
    graph = synthetic.resnet_like(12)
    strategy = get_strategy("optimal-recompute")
    poor = simulate(graph, get_strategy("memory-poor")(graph, HARDWARE), HARDWARE).peak_bytes
    with pytest.raises(BudgetError) as error:
        strategy(graph, HARDWARE, poor - 1)
    assert error.value.minimum_bytes == poor
    made = strategy(graph, HARDWARE, poor)
    assert made.params["solver"] == "memory-poor"
    assert simulate(graph, made, HARDWARE).peak_bytes <= poor


def test_memory_poor_is_not_planned_on_large_graphs(monkeypatch):
    """Its O(n^2) re-runs are never worth lowering on a big graph: the budget that only it
    fits gets a BudgetError naming a peak the other plans reach."""
    graph = synthetic.resnet_like(12)
    strategy = get_strategy("optimal-recompute")
    poor = simulate(graph, get_strategy("memory-poor")(graph, HARDWARE), HARDWARE).peak_bytes
    monkeypatch.setattr(optimal_recompute, "POOR_MAX_FORWARD_OPS", len(graph.forward_ops) - 1)
    with pytest.raises(BudgetError) as error:
        strategy(graph, HARDWARE, poor)
    assert error.value.minimum_bytes > poor
    assert simulate(graph, strategy(graph, HARDWARE, error.value.minimum_bytes),
                    HARDWARE).peak_bytes <= error.value.minimum_bytes
