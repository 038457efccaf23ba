"""The incremental profile (a base profile plus the change of a set of swaps) equals the truth:
``memory_profile(lower(...))``'s peak to the byte for every prefix of the decisions (dense and
sparse evaluation both), and
``simulate``'s step time to the bit, on synthetic graphs and random or tuned swap plans."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import PROFILES, get_hardware
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.model import synthetic
from memfit.model.keys import RangeMax
from memfit.model.profile import BaseProfile
from memfit.model.recompute import planned_reruns
from memfit.model.schedule import check_plan, peak_bytes
from memfit.model.sharding import shard_graph
from memfit.model.simulate import simulate
from memfit.planning.strategies.swapping.tflms import plan as tflms
from tests.model.plans import random_recompute_plan, random_swap_plan
from tests.model.test_sharding import fsdp, layered

HARDWARE = get_hardware("h100-pcie")
SLOW_LINK = HARDWARE.with_(d2h_bytes_per_s=1e8, h2d_bytes_per_s=1e8)  # copies stall compute
CLOCKS = (HARDWARE, PROFILES["cpu"], SLOW_LINK, SLOW_LINK.with_(duplex=False))

GRAPHS = st.one_of(
    st.builds(synthetic.random_dag, st.integers(2, 60), st.integers(0, 10_000),
              st.integers(1, 4)),
    st.builds(synthetic.chain, st.integers(2, 40)),
    st.builds(synthetic.resnet_like, st.integers(1, 8)),
    st.builds(synthetic.multi_tower, st.integers(1, 4), st.integers(1, 8)),
)


def check_against_the_truth(graph: CostGraph, plan: Plan) -> int:
    """Every prefix's peak to the byte and the whole plan's step time on four clocks; returns
    how many prefixes moved the peak off the Keep plan's (so a test can show it saw some)."""
    check_plan(graph, plan)
    decisions = list(plan.decisions.items())
    base = BaseProfile.of(graph)
    delta = base.swaps(decisions)
    moved = 0
    for count in range(len(decisions) + 1):
        truth = peak_bytes(graph, Plan("prefix", dict(decisions[:count])))
        for method in ("dense", "sparse", "auto"):
            assert base.peak_bytes(delta, count, method) == truth, f"{method}, {count} decisions"
        moved += truth != base.keep_peak_bytes
    for hardware in CLOCKS:
        assert base.step_time_s(delta, hardware) == (
            simulate(graph, plan, hardware, record_intervals=False).step_time_s)
    return moved


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=GRAPHS, seed=st.integers(0, 10_000), probability=st.floats(0.1, 1.0))
def test_random_swap_plans_match_lowering_and_simulation(graph, seed, probability):
    """Copies anywhere between producer and reader, several per tensor, originals still read."""
    plan = random_swap_plan(graph, random.Random(seed), probability)
    check_against_the_truth(graph, plan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), lb=st.integers(0, 6),
       fuse=st.booleans(), branches=st.booleans(), threshold=st.integers(0, 6))
def test_tuned_swap_plans_match_lowering_and_simulation(size, seed, lb, fuse, branches, threshold):
    """The plans the TFLMS tuner prices, every prefix of its decision list (its binary search)."""
    graph = synthetic.random_dag(size, seed=seed)
    plan = tflms(graph, HARDWARE, n_tensors=-1, lb=lb, ub=lb + seed % 4, fuse_swapins=fuse,
                 swap_branches=branches, threshold=threshold)
    check_against_the_truth(graph, plan)


def test_the_checks_see_plans_that_move_the_peak():
    """Not vacuous: on these graphs most prefixes raise or lower the peak, and all still match."""
    moved = total = 0
    for seed in range(10):
        graph = synthetic.random_dag(30, seed=seed)
        plan = random_swap_plan(graph, random.Random(seed), 0.8)
        moved += check_against_the_truth(graph, plan)
        total += len(plan.decisions) + 1
    assert moved > total // 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=GRAPHS)
def test_the_tensors_live_across_an_op_are_its_live_bytes(graph):
    """``live_across`` (``CountBounds``' boundary) accounts for the truth's ``live_after`` of
    every op: resident bytes, the outputs made so far, and the freed buffers held across it."""
    base = BaseProfile.of(graph)
    for op in range(len(graph.ops)):
        outputs = sum(t.size_bytes for name, t in graph.tensors.items()
                      if t.is_output and base.produced_at.get(name, len(graph.ops)) <= op)
        held = sum(graph.tensors[t].size_bytes for t in base.live_across(graph.tensors, op))
        assert base.live_after[op] == graph.resident_bytes + outputs + held, f"after op {op}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=GRAPHS, seed=st.integers(0, 10_000))
def test_the_compute_clock_with_reruns_is_the_simulators(graph, seed):
    """``compute_clock`` (``free_swaps``' timeline) ends where ``simulate`` ends a recompute
    plan, to the bit; each op's slot starts where the previous one ended; no re-runs: Keep."""
    base = BaseProfile.of(graph)
    plan = random_recompute_plan(graph, seed)
    start_s, end_s = base.compute_clock(planned_reruns(graph, plan))
    assert end_s[-1] == simulate(graph, plan, HARDWARE, record_intervals=False).step_time_s
    assert start_s == [0.0, *end_s[:-1]]
    assert base.compute_clock()[1] == base.keep_end_s.tolist()


def test_nothing_swapped_is_the_keep_plan():
    graph = synthetic.resnet_like(4)
    base = BaseProfile.of(graph)
    delta = base.swaps([])
    assert base.peak_bytes(delta) == peak_bytes(graph, Plan("keep"))
    assert base.step_time_s(delta, HARDWARE) == simulate(graph, Plan("keep"), HARDWARE).step_time_s
    assert BaseProfile.of(graph) is base  # built once per graph


def test_a_swap_in_feeding_reruns_is_refused():
    """Not modelled yet (step 3 of the design): refused rather than priced wrong."""
    graph = synthetic.chain(6)
    tensor = graph.tensors["f1"]
    forward_reader = next(c for c in tensor.consumers if graph.op(c).phase == "forward")
    last = graph.ops[-1].name
    with pytest.raises(ValueError, match="feeds re-runs"):
        BaseProfile.of(graph).swaps([("f1", Swap((SwapIn(last, (forward_reader,)),)))])


def test_a_graph_with_collectives_is_refused_by_the_clock():
    graph = shard_graph(layered(), fsdp(), get_hardware("h100-sxm"))
    base = BaseProfile.of(graph)
    assert base.peak_bytes(base.swaps([])) == peak_bytes(graph, Plan("keep"))
    with pytest.raises(ValueError, match="collectives"):
        base.step_time_s(base.swaps([]), HARDWARE)


@given(values=st.lists(st.integers(-10**12, 10**12), min_size=0, max_size=70),
       ranges=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=20))
def test_range_maximum_is_the_maximum_of_the_slice(values, ranges):
    array = np.asarray(values, dtype=np.int64)
    low = np.asarray([min(a, len(values)) for a, _ in ranges], dtype=np.int64)
    high = np.asarray([min(b, len(values)) for _, b in ranges], dtype=np.int64)
    found = RangeMax(array)(low, high)
    for at, (start, stop) in enumerate(zip(low, high, strict=True)):
        if start < stop:
            assert found[at] == array[start:stop].max()
        else:
            assert found[at] < -10**15
