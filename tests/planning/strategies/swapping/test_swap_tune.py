"""The TFLMS swap strategy tuned to a budget, and its properties on random graphs (the tuner's
incremental model against the exact one)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import PROFILES
from memfit.data.plan import Plan, Swap
from memfit.model.profile import BaseProfile
from memfit.model.schedule import check_plan, lower, memory_profile, peak_bytes
from memfit.model.simulate import simulate
from memfit.model.synthetic import chain, random_dag
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.swapping._swap_control import OpGraph
from memfit.planning.strategies.swapping.tflms import plan as swap
from tests.planning.strategies.swapping.swap_graphs import HW, MIB, unet

# ---- tuning to a budget ----------------------------------------------------------------------------


@pytest.mark.parametrize("size_bytes", [MIB, 64 * MIB])  # copies hidden; copies stall compute
def test_budget_between_swap_all_and_keep_fits_and_is_no_slower(size_bytes):
    graph = chain(64, size_bytes=size_bytes)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    swap_all = swap(graph, HW)
    floor = peak_bytes(graph, swap_all)
    for budget in (floor, (floor + keep_peak) // 2, keep_peak - 1):
        plan = swap(graph, HW, budget_bytes=budget)
        assert memory_profile(lower(graph, plan)).peak_bytes <= budget
        assert simulate(graph, plan, HW).step_time_s <= simulate(graph, swap_all, HW).step_time_s
        assert plan.budget_bytes == budget
        assert swap(graph, HW, **plan.params).decisions == plan.decisions  # params reproduce it
    assert 0 < swap(graph, HW, budget_bytes=(floor + keep_peak) // 2).params["n_tensors"] < 63


def test_budget_above_the_unplanned_peak_swaps_nothing():
    graph = chain(16)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    plan = swap(graph, HW, budget_bytes=keep_peak)
    assert plan.swapped == () and plan.params["n_tensors"] == 0


def test_budget_below_the_minimum_raises_with_the_swap_all_peak():
    graph = chain(32)
    floor = peak_bytes(graph, swap(graph, HW))
    with pytest.raises(BudgetError) as error:
        swap(graph, HW, budget_bytes=floor - 1)
    assert error.value.minimum_bytes == floor and error.value.strategy == "swap"
    assert error.value.dominant and error.value.dominant[0][1] == MIB


def test_tuning_keeps_given_parameters():
    graph = chain(64)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    budget = (peak_bytes(graph, swap(graph, HW)) + keep_peak) // 2
    plan = swap(graph, HW, budget_bytes=budget, lb=3, ctrld_strategy="direct_order")
    assert plan.params["lb"] == 3 and plan.params["ctrld_strategy"] == "direct_order"
    assert peak_bytes(graph, plan) <= budget
    fixed = swap(graph, HW, budget_bytes=budget, n_tensors=-1)
    assert fixed.params["n_tensors"] == -1 and len(fixed.swapped) == 63
    with pytest.raises(BudgetError):  # too few tensors to fit, and n_tensors is not tuned
        swap(graph, HW, budget_bytes=budget, n_tensors=2)
    narrow = swap(graph, HW, budget_bytes=budget, ub=2)
    assert narrow.params["lb"] <= 2


def test_tuning_turns_on_swap_branches_only_when_needed():
    graph = unet()
    without = peak_bytes(graph, swap(graph, HW))
    with_branches = peak_bytes(graph, swap(graph, HW, swap_branches=True, branch_threshold=1))
    assert with_branches < without
    plan = swap(graph, HW, budget_bytes=(without + with_branches) // 2)
    assert plan.params["swap_branches"] is True and plan.params["branch_threshold"] == 1
    assert peak_bytes(graph, plan) <= (without + with_branches) // 2
    assert swap(graph, HW, budget_bytes=without).params["swap_branches"] is False
    with pytest.raises(BudgetError) as error:
        swap(graph, HW, budget_bytes=without - 1, swap_branches=False)
    assert error.value.minimum_bytes == without
    with pytest.raises(BudgetError) as error:
        swap(graph, HW, budget_bytes=with_branches - 1)
    assert error.value.minimum_bytes == with_branches


# ---- properties on random graphs ------------------------------------------------------------------

PARAMS = st.fixed_dictionaries({}, optional={
    "threshold": st.integers(0, 8),
    "n_tensors": st.integers(-1, 40),
    "lb": st.integers(0, 6),
    "ctrld_strategy": st.sampled_from(["chain_rule", "direct_order"]),
    "fuse_swapins": st.booleans(),
    "fuse_distance": st.integers(0, 12),
    "swap_branches": st.booleans(),
    "branch_threshold": st.integers(0, 5),
    "excl_types": st.sampled_from([[], ["relu"], ["aten.add"]]),
    "incl_scopes": st.sampled_from([[], ["block1*"], ["block0", "block2"]]),
})


def check_swap_ins(graph: CostGraph, plan: Plan) -> None:
    """Every swap-in runs after the original's last read and before each consumer it serves."""
    check_plan(graph, plan)
    for name in plan.swapped:
        tensor, decision = graph.tensors[name], plan.decision(name)
        assert isinstance(decision, Swap)
        served = {c: s.after for s in decision.swap_ins for c in s.consumers}
        original_last = max([graph.index[str(tensor.producer)],
                             *(graph.index[c] for c in tensor.consumers if c not in served)])
        for consumer, after in served.items():
            assert original_last <= graph.index[after] < graph.index[consumer]
        for consumer in tensor.consumers:  # backward readers: a copy issued before, or the original
            if graph.op(consumer).phase == "backward" and consumer not in served:
                assert graph.index[consumer] <= original_last


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), params=PARAMS)
def test_random_plans_are_valid_and_the_tuner_models_are_exact(size, seed, params):
    graph = random_dag(size, seed=seed)
    params = dict(params)
    if params.get("lb", 1) > 1 and "ub" not in params:
        params["ub"] = params["lb"] + seed % 4
    plan = swap(graph, HW, **params)
    check_swap_ins(graph, plan)
    model = BaseProfile.of(graph)
    delta = model.swaps(list(plan.decisions.items()))
    assert model.peak_bytes(delta) == peak_bytes(graph, plan)
    slow_link = HW.with_(d2h_bytes_per_s=1e8, h2d_bytes_per_s=1e8)  # copies stall compute
    for hardware in (HW, PROFILES["cpu"], slow_link, slow_link.with_(duplex=False)):
        assert model.step_time_s(delta, hardware) == simulate(graph, plan, hardware).step_time_s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), fraction=st.floats(0.5, 1.1),
       params=PARAMS)
def test_random_budgets_fit_or_raise(size, seed, fraction, params):
    graph = random_dag(size, seed=seed)
    budget = max(1, int(fraction * peak_bytes(graph, get_strategy("keep")(graph, HW))))
    try:
        plan = swap(graph, HW, budget_bytes=budget, **params)
    except BudgetError as error:
        assert error.minimum_bytes > budget
        return
    check_swap_ins(graph, plan)
    assert simulate(graph, plan, HW).peak_bytes <= budget
    assert memory_profile(lower(graph, plan)).peak_bytes <= budget


@settings(max_examples=30, deadline=None)
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), fan_in=st.integers(1, 4))
def test_forward_levels_are_breadth_first_levels(size, seed, fan_in):
    ops = OpGraph(random_dag(size, seed=seed, max_inputs=fan_in))
    for producer, phase in enumerate(ops.phase):
        if phase != "forward":
            continue
        level, seen, depth = [producer], {producer}, 0
        while level:
            assert sorted(ops.forward_level(producer, depth)) == level
            level = sorted({u for op in level for u in ops.forward_users[op]} - seen)
            seen.update(level)
            depth += 1
        assert ops.forward_level(producer, depth) == ops.forward_level(producer, depth + 9) == []


def test_tuning_scales_to_ten_thousand_ops():
    """A loose bound that catches a quadratic slip, not noise (about 1 s here)."""
    graph = chain(5000)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    budget = (peak_bytes(graph, swap(graph, HW)) + keep_peak) // 2
    start = time.perf_counter()
    plan = swap(graph, HW, budget_bytes=budget)
    assert time.perf_counter() - start < 20
    assert simulate(graph, plan, HW, record_intervals=False).peak_bytes <= budget
