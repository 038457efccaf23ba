"""The Checkmate MILP: the chain DP's optimum on chains, feasible schedules on residual graphs."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph, Tensor
from memfit.data.plan import Plan
from memfit.model import synthetic
from memfit.model.schedule import peak_bytes
from memfit.planning.solvers.chain import ChainCosts, solve_chain_costs
from memfit.planning.solvers.chain_graph import chain_costs_from_graph, chain_graph
from memfit.planning.solvers.milp import MilpSolution, solve_milp
from tests.planning.solvers.chain_brute_force import brute_force_recompute_time_s

SMALL = {"size_bytes": 1024, "weight_bytes": 16, "input_bytes": 1024}


def replay_tensors(graph: CostGraph, solution: MilpSolution) -> tuple[float, int]:
    """An independent check: run the stages' ops in order with storage-level liveness (a value
    lives from its computation to its last read before it is computed again) and return
    (recompute_time_s, peak_bytes); fail if an op reads a value never computed."""
    sequence = [name for stage in solution.computed for name in stage]
    assert [stage[-1] for stage in solution.computed] == [op.name for op in graph.ops]
    made_at: dict[str, int] = {}
    end_of: dict[tuple[str, int], int] = {}
    allocated = [0] * len(sequence)
    for position, name in enumerate(sequence):
        op = graph.op(name)
        for tensor in op.inputs:
            if graph.tensors[tensor].producer is not None:
                assert tensor in made_at, f"{name} reads {tensor} before it is computed"
                end_of[(tensor, made_at[tensor])] = position
        for tensor in op.outputs:
            made_at[tensor] = position
            end_of[(tensor, position)] = len(sequence) if graph.tensors[tensor].is_output else position
            allocated[position] += graph.tensors[tensor].size_bytes
    freed_after: dict[int, int] = defaultdict(int)
    for (tensor, _), end in end_of.items():
        freed_after[end] += graph.tensors[tensor].size_bytes
    live = peak = graph.resident_bytes
    for position in range(len(sequence)):
        live += allocated[position]
        peak = max(peak, live)
        live -= freed_after[position]
    total_time_s = sum(graph.op(name).time_s for name in sequence)
    return total_time_s - graph.step_time_s, peak


def assert_valid(graph: CostGraph, solution: MilpSolution, budget_bytes: int) -> None:
    assert solution.found, solution.status
    recompute_time_s, peak = replay_tensors(graph, solution)
    assert recompute_time_s == pytest.approx(solution.recompute_time_s, abs=1e-12)
    assert peak <= solution.peak_bytes <= budget_bytes


def budgets(graph: CostGraph, count: int) -> list[int]:
    """``count`` budgets from a third of the unmodified step's activation bytes up to all of them."""
    keep_all = peak_bytes(graph, Plan("keep"))
    low = graph.resident_bytes + (keep_all - graph.resident_bytes) // 3
    return sorted({low + (keep_all - low) * step // (count - 1) for step in range(count)})


@pytest.mark.parametrize("length", [2, 3, 4, 5, 6])
def test_milp_equals_chain_dp_on_uniform_chains(length):
    graph = synthetic.chain(length, **SMALL)
    costs = chain_costs_from_graph(graph)
    for budget_bytes in budgets(graph, 7):
        solution = solve_milp(graph, budget_bytes)
        schedule = solve_chain_costs(costs, budget_bytes - graph.resident_bytes, memory_units=5000)
        if schedule is None:
            assert solution.status == "infeasible", budget_bytes
            continue
        assert solution.status == "optimal"
        assert_valid(graph, solution, budget_bytes)
        assert solution.recompute_time_s == pytest.approx(schedule.recompute_time_s, abs=1e-9)


def test_milp_equals_chain_dp_on_an_eight_step_chain():
    graph = synthetic.chain(8, **SMALL)
    budget_bytes = graph.resident_bytes + 4 + 8 * 16 + 5 * 1024
    solution = solve_milp(graph, budget_bytes)
    schedule = solve_chain_costs(chain_costs_from_graph(graph), budget_bytes - graph.resident_bytes,
                                 memory_units=5000)
    assert solution.status == "optimal" and schedule is not None
    assert solution.recompute_time_s == pytest.approx(schedule.recompute_time_s, abs=1e-9) == 0.004


def least_chain_budget(costs: ChainCosts, high_bytes: int) -> int:
    """The least budget the chain DP finds a schedule for (bisection; exact memory units)."""
    low = 0
    while low < high_bytes:
        middle = (low + high_bytes) // 2
        if solve_chain_costs(costs, middle, memory_units=5000) is None:
            low = middle + 1
        else:
            high_bytes = middle
    return low


@pytest.mark.parametrize("seed", range(6))
def test_milp_equals_chain_dp_on_heterogeneous_chains(seed):
    rng = random.Random(seed)
    length = rng.randint(3, 5)
    nodes = [synthetic.Node(f"f{i}", (f"f{i - 1}",) if i else (), 64 * rng.randint(1, 8),
                            rng.choice([1e-3, 2e-3, 3e-3, 5e-3])) for i in range(length)]
    graph = synthetic.from_forward(nodes, input_bytes=64, weight_bytes=16)
    costs = chain_costs_from_graph(graph)
    keep_all = peak_bytes(graph, Plan("keep")) - graph.resident_bytes
    least = least_chain_budget(costs, keep_all)
    assert solve_milp(graph, graph.resident_bytes + least - 1).status == "infeasible"
    for chain_budget in sorted({least + (keep_all - least) * step // 4 for step in range(5)}):
        solution = solve_milp(graph, graph.resident_bytes + chain_budget)
        schedule = solve_chain_costs(costs, chain_budget, memory_units=5000)
        assert schedule is not None
        assert_valid(graph, solution, graph.resident_bytes + chain_budget)
        assert solution.recompute_time_s == pytest.approx(schedule.recompute_time_s, abs=1e-9)


def test_resnet_schedule_fits_and_recomputes_only_forward_ops():
    graph = synthetic.resnet_like(2, **SMALL)
    keep_all = peak_bytes(graph, Plan("keep"))
    assert solve_milp(graph, keep_all).recompute_time_s == 0.0
    budget_bytes = graph.resident_bytes + (keep_all - graph.resident_bytes) * 7 // 10
    solution = solve_milp(graph, budget_bytes)
    assert solution.status == "optimal"
    assert_valid(graph, solution, budget_bytes)
    assert solution.recompute_time_s > 0
    phases = {op.name: op.phase for op in graph.ops}
    for stage, ops in zip(graph.ops, solution.computed, strict=True):
        assert all(phases[name] == "forward" for name in ops[:-1]), stage.name
    backward_runs = [name for ops in solution.computed for name in ops if phases[name] == "backward"]
    assert len(backward_runs) == len(set(backward_runs))


def test_infeasible_budget_is_a_status_not_an_error():
    graph = synthetic.resnet_like(2, **SMALL)
    solution = solve_milp(graph, graph.resident_bytes + 1024)
    assert solution.status == "infeasible" and not solution.found
    assert solution.peak_bytes == -1 and solution.computed == ()


def test_a_node_limit_stops_the_search_without_claiming_infeasible():
    """One node (the root): a schedule found there, or ``"node_limit"``, never "infeasible"
    for a budget that fits; and the same answer twice (HiGHS is deterministic)."""
    graph = synthetic.chain(8, **SMALL)
    budget_bytes = graph.resident_bytes + 4 + 8 * 16 + 3 * 1024
    solution = solve_milp(graph, budget_bytes, node_limit=1)
    assert solution.status in ("node_limit", "feasible", "optimal")
    assert solve_milp(graph, budget_bytes, node_limit=1).computed == solution.computed


# ---- the MILP is the true optimum on small chains, persistent or not -------------------------------


@st.composite
def small_chains(draw):
    steps = draw(st.integers(1, 5))
    optional = st.one_of(st.just([]), st.lists(st.integers(0, 9), min_size=steps, max_size=steps))
    costs = ChainCosts(
        forward_time_s=tuple(draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.25, 3.0]),
                                           min_size=steps, max_size=steps))),
        backward_time_s=(1.0,) * steps,
        activation_bytes=tuple(draw(st.lists(st.integers(1, 9), min_size=steps, max_size=steps))),
        gradient_bytes=tuple(draw(optional)),
        output_bytes=tuple(draw(optional)),
        loss_bytes=draw(st.integers(0, 3)),
    )
    return costs, draw(st.integers(1, 12 * steps + 10))


@settings(max_examples=40, deadline=None)
@given(small_chains())
def test_milp_equals_exhaustive_search_over_all_chain_schedules(case):
    costs, budget_bytes = case
    graph = chain_graph(costs)
    assert chain_costs_from_graph(graph) == costs and graph.resident_bytes == 0
    solution = solve_milp(graph, budget_bytes)
    best = brute_force_recompute_time_s(costs, budget_bytes, persistent=False)
    if best == math.inf:
        assert solution.status == "infeasible"
        return
    assert solution.status == "optimal"
    assert_valid(graph, solution, budget_bytes)
    assert solution.recompute_time_s == pytest.approx(best, abs=1e-9)
    schedule = solve_chain_costs(costs, budget_bytes)
    assert schedule is not None and solution.recompute_time_s <= schedule.recompute_time_s + 1e-9


def test_milp_drops_a_checkpoint_early_where_the_dp_cannot():
    """The chain of test_chain.py's non-persistent case: keep a_1 from the forward pass, use it
    to make a_2 again, drop it before B_3, recompute it for B_2."""
    costs = ChainCosts((1.48, 1.59, 1.13, 1.36), (1.0,) * 4, (2, 5, 4, 4), output_bytes=(1, 0, 1, 3),
                       loss_bytes=2)
    solution = solve_milp(chain_graph(costs), 12)
    assert solution.recompute_time_s == pytest.approx(1.48 + 1.59)
    assert solution.computed[7:9] == (("F2", "B3"), ("F1", "B2"))
    assert solve_chain_costs(costs, 12).recompute_time_s == pytest.approx(1.48 + 1.59 + 1.48)


@pytest.mark.parametrize("graph", [
    synthetic.resnet_like(2, **SMALL), synthetic.multi_tower(2, 2, **SMALL),
    synthetic.random_dag(8, seed=1, weight_bytes=16),
], ids=lambda graph: graph.name)
def test_at_the_unmodified_peak_nothing_is_recomputed_and_the_peaks_agree(graph):
    """The MILP's memory accounting is memfit.model.schedule's on the unmodified step."""
    keep_all = peak_bytes(graph, Plan("keep"))
    solution = solve_milp(graph, keep_all)
    assert solution.recompute_time_s == 0.0 and solution.peak_bytes == keep_all
    tighter = solve_milp(graph, keep_all - 1)
    assert tighter.recompute_time_s > 0 or not tighter.found


def with_temporaries(graph: CostGraph, every: int, size_bytes: int) -> CostGraph:
    """``graph`` with a storage nothing reads on every ``every``-th op: a kernel's own buffer,
    as ``analyze(kernel_temporaries=True)`` adds it (live while the op runs, freed after)."""
    ops, tensors = [], list(graph.tensors.values())
    for position, op in enumerate(graph.ops):
        if position % every == 0 and op.outputs:
            name = f"{op.name}.temporary"
            tensors.append(Tensor(name, size_bytes,
                                  "activation" if op.phase == "forward" else "gradient"))
            op = replace(op, outputs=(*op.outputs, name))
        ops.append(op)
    return CostGraph.build(ops, [replace(t, producer=None, consumers=()) for t in tensors],
                           name=f"{graph.name}+temporaries")


@pytest.mark.parametrize("graph", [
    with_temporaries(synthetic.chain(5, **SMALL), every=2, size_bytes=1536),
    with_temporaries(synthetic.resnet_like(2, **SMALL), every=3, size_bytes=700),
], ids=lambda graph: graph.name)
def test_a_storage_nothing_reads_lives_only_while_its_op_runs(graph):
    """Not kept with its op's other outputs (the MILP's unit is the op): its accounting stays
    memfit.model.schedule's, and tight budgets give schedules the storage-level replay confirms."""
    keep_all = peak_bytes(graph, Plan("keep"))
    solution = solve_milp(graph, keep_all)
    assert solution.recompute_time_s == 0.0 and solution.peak_bytes == keep_all
    for budget in budgets(graph, 4)[1:]:
        found = solve_milp(graph, budget)
        if found.found:
            assert_valid(graph, found, budget)
