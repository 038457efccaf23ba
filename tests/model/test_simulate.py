"""The simulator on a fake clock: exact timelines on tiny graphs, invariants on random DAGs."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware, get_hardware
from memfit.data.plan import Plan, Recompute, Swap, SwapIn
from memfit.data.timeline import Interval, Timeline
from memfit.model import synthetic
from memfit.model.schedule import PlanError, lower, memory_profile, peak_bytes
from memfit.model.simulate import simulate
from tests.model.plans import random_swap_plan

# 1 byte/s links, no latency, no overhead: a copy of n bytes takes exactly n seconds.
FAKE = Hardware(
    name="fake",
    flops_per_s={"float32": 1.0},
    memory_bytes_per_s=1.0,
    d2h_bytes_per_s=1.0,
    h2d_bytes_per_s=1.0,
    op_overhead_s=0.0,
    copy_latency_s=0.0,
)


def unit_chain(length: int = 4, size_bytes: int = 2) -> CostGraph:
    """A chain whose ops all take 1 s. Ops: f0..f3, loss, loss_backward, f3_backward..f0_backward."""
    graph = synthetic.chain(length, size_bytes=size_bytes, input_bytes=1000, weight_bytes=1)
    return graph.with_times({op.name: 1.0 for op in graph.ops})


def swap_plan(**swap_ins: tuple[str, ...]) -> Plan:
    """``swap_plan(f0=("f1", "f1_backward"))``: swap f0 once, after f1, for f1_backward."""
    decisions = {
        tensor: Swap((SwapIn(after, tuple(consumers)),))
        for tensor, (after, *consumers) in swap_ins.items()
    }
    return Plan("test", decisions)


def spans(timeline: Timeline, stream: str) -> list[tuple[str, float, float]]:
    return [(i.label, i.start_s, i.end_s) for i in timeline.intervals if i.stream == stream]


def interval(timeline: Timeline, label: str) -> Interval:
    (found,) = [i for i in timeline.intervals if i.label == label]
    return found


# ---- exact timelines -----------------------------------------------------------------------


def test_keep_runs_ops_back_to_back_with_nothing_exposed():
    graph = unit_chain()
    timeline = simulate(graph, Plan("keep"), FAKE)
    assert timeline.source == "simulated"
    assert timeline.step_time_s == 10.0
    assert timeline.exposed_transfer_s == 0.0
    names = [op.name for op in graph.ops]
    assert spans(timeline, "compute") == [(name, i, i + 1) for i, name in enumerate(names)]
    assert spans(timeline, "d2h") == spans(timeline, "h2d") == []


def test_keep_step_time_is_the_sum_of_op_times_on_a_real_profile():
    graph = synthetic.chain(6)
    timeline = simulate(graph, Plan("keep"), get_hardware("h100-pcie"))
    assert timeline.step_time_s == pytest.approx(graph.step_time_s, rel=1e-12)
    assert timeline.exposed_transfer_s == 0.0


@pytest.mark.parametrize(
    "control_op, exposed_s",
    [
        ("f1", 0.0),  # copy [3, 5) long before f1_backward starts at 8
        ("f3_backward", 1.0),  # copy [7, 9): f2_backward covers one of its two seconds
        ("f2_backward", 2.0),  # copy [8, 10): issued right before its consumer, all exposed
    ],
)
def test_swap_in_stalls_by_the_copy_time_not_hidden_by_compute(control_op, exposed_s):
    graph = unit_chain(size_bytes=2)
    timeline = simulate(graph, swap_plan(f0=(control_op, "f1_backward")), FAKE)
    assert spans(timeline, "d2h") == [("swap_out(f0)", 1.0, 3.0)]
    swap_in = interval(timeline, "swap_in(f0#0)")
    assert swap_in.end_s - swap_in.start_s == 2.0
    assert timeline.exposed_transfer_s == exposed_s
    assert timeline.step_time_s == 10.0 + exposed_s
    assert interval(timeline, "f1_backward").start_s == max(8.0, swap_in.end_s)
    waits = [i for i in timeline.intervals if i.kind == "wait"]
    assert [(w.start_s, w.end_s) for w in waits] == ([(8.0, 8.0 + exposed_s)] if exposed_s else [])


def test_swap_in_waits_for_its_swap_out():
    graph = unit_chain(size_bytes=20)  # swap-out [1, 21): longer than the whole forward pass
    timeline = simulate(graph, swap_plan(f0=("f1", "f1_backward")), FAKE)
    assert interval(timeline, "swap_in(f0#0)") == Interval(
        "h2d", "swap_in(f0#0)", 21, 41, "swap_in"
    )
    assert interval(timeline, "f1_backward").start_s == 41.0
    assert timeline.exposed_transfer_s == 33.0  # f1_backward was ready at 8
    assert timeline.step_time_s == 43.0


def test_cpu_profile_serializes_copies_with_compute_and_exposes_them_all():
    graph = unit_chain(size_bytes=2)
    timeline = simulate(graph, swap_plan(f0=("f1", "f1_backward")), FAKE.with_(async_copies=False))
    assert [(i.stream, i.label, i.start_s, i.end_s) for i in timeline.intervals[:5]] == [
        ("compute", "f0", 0.0, 1.0),
        ("d2h", "swap_out(f0)", 1.0, 3.0),
        ("compute", "f1", 3.0, 4.0),
        ("h2d", "swap_in(f0#0)", 4.0, 6.0),
        ("compute", "f2", 6.0, 7.0),
    ]
    assert timeline.exposed_transfer_s == 4.0
    assert timeline.step_time_s == 14.0
    assert simulate(graph, swap_plan(f0=("f1", "f1_backward")), FAKE).step_time_s == 10.0


def test_cpu_profile_exposes_copies_with_their_latency():
    graph = unit_chain(size_bytes=2)
    cpu = get_hardware("cpu")
    timeline = simulate(graph, swap_plan(f0=("f1", "f1_backward")), cpu)
    copies_s = cpu.d2h_time_s(2) + cpu.h2d_time_s(2)
    assert timeline.exposed_transfer_s == pytest.approx(copies_s, rel=1e-12)
    assert timeline.step_time_s == pytest.approx(10.0 + copies_s, rel=1e-12)


def test_half_duplex_link_serializes_the_two_directions():
    graph = unit_chain(size_bytes=2)
    plan = swap_plan(f0=("f1", "f1_backward"), f1=("f3", "f2_backward"))
    full = simulate(graph, plan, FAKE)
    assert spans(full, "d2h") == [("swap_out(f0)", 1, 3), ("swap_out(f1)", 3, 5)]
    assert spans(full, "h2d") == [("swap_in(f0#0)", 3, 5), ("swap_in(f1#0)", 5, 7)]
    assert (full.exposed_transfer_s, full.step_time_s) == (0.0, 10.0)
    half = simulate(graph, plan, FAKE.with_(duplex=False))
    assert spans(half, "d2h") == [("swap_out(f0)", 1, 3), ("swap_out(f1)", 3, 5)]
    assert spans(half, "h2d") == [("swap_in(f0#0)", 5, 7), ("swap_in(f1#0)", 7, 9)]
    assert (half.exposed_transfer_s, half.step_time_s) == (2.0, 12.0)  # f2_backward waits 7 -> 9


# ---- memory --------------------------------------------------------------------------------


def test_memory_is_the_program_order_profile_of_the_schedule():
    graph = unit_chain(size_bytes=100)
    plan = swap_plan(f0=("f2_backward", "f1_backward"))
    timeline = simulate(graph, plan, FAKE)
    schedule = lower(graph, plan)
    profile = memory_profile(schedule)
    assert timeline.memory_bytes == profile.high_bytes
    assert timeline.memory_labels == tuple(a.label for a in schedule.actions)
    assert timeline.peak_bytes == profile.peak_bytes
    assert timeline.peak_label == schedule.actions[profile.peak_index].label


def test_swapping_a_chain_activation_lowers_the_peak_by_its_bytes():
    graph = synthetic.chain(4, size_bytes=100, input_bytes=1000, weight_bytes=1)
    keep = simulate(graph, Plan("keep"), FAKE)
    # resident 1004 (x, four weights) + f0, f1, f2 + loss + df3@loss + dw_f3 + df2@f3
    assert (keep.peak_bytes, keep.peak_label) == (1509, "f3_backward")
    swapped = simulate(graph, swap_plan(f0=("f2_backward", "f1_backward")), FAKE)
    assert (swapped.peak_bytes, swapped.peak_label) == (1409, "f3_backward")


def test_overlapping_copies_of_one_tensor_can_raise_the_peak_above_keep():
    """Why the no-higher-peak property below only holds for copies that never overlap."""
    nodes = [
        synthetic.Node("stem", (), 1000),
        synthetic.Node("a", ("stem",), 10),
        synthetic.Node("b", ("stem",), 10),
    ]
    graph = synthetic.from_forward(nodes, input_bytes=1, weight_bytes=1)
    two_copies = Swap(
        (SwapIn("loss_backward", ("b_backward",)), SwapIn("loss_backward", ("a_backward",)))
    )
    one_copy = Swap((SwapIn("loss_backward", ("b_backward", "a_backward")),))
    keep_peak = simulate(graph, Plan("keep"), FAKE).peak_bytes
    assert keep_peak == 3020
    assert simulate(graph, Plan("t", {"stem": two_copies}), FAKE).peak_bytes == 3029
    assert simulate(graph, Plan("t", {"stem": one_copy}), FAKE).peak_bytes == 3020


# ---- the interface -------------------------------------------------------------------------


def test_without_intervals_the_figures_are_the_same():
    graph = unit_chain(size_bytes=2)
    plan = swap_plan(f0=("f2_backward", "f1_backward"))
    full = simulate(graph, plan, FAKE)
    lean = simulate(graph, plan, FAKE, record_intervals=False)
    assert (lean.intervals, lean.memory_labels) == ((), ())
    assert (lean.step_time_s, lean.exposed_transfer_s) == (12.0, 2.0)
    assert (lean.step_time_s, lean.exposed_transfer_s) == (
        full.step_time_s,
        full.exposed_transfer_s,
    )
    assert (lean.peak_bytes, lean.peak_label, lean.memory_bytes) == (
        full.peak_bytes,
        full.peak_label,
        full.memory_bytes,
    )


def test_an_invalid_plan_raises_plan_error():
    with pytest.raises(PlanError, match="too late for 'f1_backward'"):
        simulate(unit_chain(), swap_plan(f0=("f1_backward", "f1_backward")), FAKE)


def test_timeline_round_trips_through_json(tmp_path):
    timeline = simulate(unit_chain(), swap_plan(f0=("f1", "f1_backward")), FAKE)
    timeline.save(tmp_path / "timeline.json")
    assert Timeline.load(tmp_path / "timeline.json") == timeline


def test_simulating_ten_thousand_ops_is_fast():
    graph = synthetic.chain(5000)
    assert len(graph.ops) == 10_002
    plan = random_swap_plan(graph, random.Random(0), swap_probability=0.2)
    simulate(graph, plan, FAKE)  # warm the graph's cached index and hash
    elapsed_s = []
    for _ in range(3):
        start = time.perf_counter()
        simulate(graph, plan, FAKE, record_intervals=False)
        elapsed_s.append(time.perf_counter() - start)
    # 0.06-0.3 s on the noisy 2-core VM this was written on (GC pauses included); the bound
    # catches a quadratic slip (tens of seconds here), not a few percent
    assert min(elapsed_s) < 1.0


# ---- properties on random DAGs -------------------------------------------------------------

MID = Hardware(
    name="mid",  # copies of the random DAGs' 16 KiB..1 MiB tensors take about as long as ops
    flops_per_s={"float32": 1e12},
    memory_bytes_per_s=1e12,
    d2h_bytes_per_s=1e9,
    h2d_bytes_per_s=5e8,
    copy_latency_s=1e-5,
)
HARDWARE = [MID, MID.with_(duplex=False), get_hardware("cpu"), get_hardware("h100-pcie")]
graphs = st.builds(synthetic.random_dag, size=st.integers(2, 60), seed=st.integers(0, 2**20))


def _end(timeline: Timeline) -> dict[str, Interval]:
    return {i.label: i for i in timeline.intervals}


def _assert_no_overlap(intervals: list[Interval]) -> None:
    for before, after in itertools.pairwise(intervals):
        assert before.start_s <= before.end_s <= after.start_s, (before, after)


@settings(max_examples=50, deadline=None)
@given(graph=graphs, plan_seed=st.integers(0, 2**20), hardware=st.sampled_from(HARDWARE))
def test_random_plans_give_consistent_timelines(graph, plan_seed, hardware):
    plan = random_swap_plan(graph, random.Random(plan_seed))
    timeline = simulate(graph, plan, hardware)
    by_label = _end(timeline)
    on = {s: [i for i in timeline.intervals if i.stream == s] for s in ("compute", "d2h", "h2d")}
    assert [i.label for i in on["compute"] if i.kind == "compute"] == [op.name for op in graph.ops]
    _assert_no_overlap(on["compute"])
    _assert_no_overlap(on["d2h"])
    _assert_no_overlap(on["h2d"])
    if not hardware.duplex:
        _assert_no_overlap([i for i in timeline.intervals if i.stream != "compute"])
    if not hardware.async_copies:
        _assert_no_overlap(list(timeline.intervals))
    for name, decision in plan.decisions.items():
        assert isinstance(decision, Swap)
        swap_out = by_label[f"swap_out({name})"]
        assert swap_out.start_s >= by_label[graph.tensors[name].producer].end_s
        for copy, swap_in in enumerate(decision.swap_ins):
            copied = by_label[f"swap_in({name}#{copy})"]
            assert copied.start_s >= max(swap_out.end_s, by_label[swap_in.after].end_s)
            for consumer in swap_in.consumers:
                assert by_label[consumer].start_s >= copied.end_s
    assert timeline.step_time_s >= graph.step_time_s * (1 - 1e-12)
    assert timeline.step_time_s == max(i.end_s for i in timeline.intervals)
    exposed_s = timeline.exposed_transfer_s
    if hardware.async_copies:  # the compute stream only ever waits for swap-ins
        assert on["compute"][-1].end_s == pytest.approx(graph.step_time_s + exposed_s, rel=1e-9)
    else:  # every copy sits on the one clock
        copies_s = sum(i.end_s - i.start_s for i in timeline.intervals if i.stream != "compute")
        assert exposed_s == pytest.approx(copies_s, rel=1e-9)
        assert timeline.step_time_s == pytest.approx(graph.step_time_s + exposed_s, rel=1e-9)
    assert timeline.peak_bytes == peak_bytes(graph, plan)
    assert timeline.memory_bytes == memory_profile(lower(graph, plan)).high_bytes


@settings(max_examples=50, deadline=None)
@given(graph=graphs, plan_seed=st.integers(0, 2**20))
def test_copies_that_never_overlap_never_raise_the_peak(graph, plan_seed):
    plan = random_swap_plan(graph, random.Random(plan_seed), swap_probability=0.7, disjoint=True)
    keep = simulate(graph, Plan("keep"), MID, record_intervals=False)
    swapped = simulate(graph, plan, MID, record_intervals=False)
    assert swapped.peak_bytes <= keep.peak_bytes


def test_a_rerun_fed_by_a_swap_in_waits_for_the_copy():
    # f1 (2 bytes: 2 s each way) comes back after loss_backward (ends at 6 s) for the re-run of
    # the recomputed f2 before f3_backward: the compute stream stalls from 6 s to 8 s
    plan = Plan("test", {"f1": Swap((SwapIn("loss_backward", ("f2", "f2_backward")),)),
                         "f2": Recompute()})
    timeline = simulate(unit_chain(), plan, FAKE)
    by_label = {interval.label: interval for interval in timeline.intervals}
    assert (by_label["swap_in(f1#0)"].start_s, by_label["swap_in(f1#0)"].end_s) == (6.0, 8.0)
    assert (by_label["wait(f1#0)"].start_s, by_label["wait(f1#0)"].end_s) == (6.0, 8.0)
    assert by_label["recompute(f2#0)"].start_s == 8.0
    assert (timeline.exposed_transfer_s, timeline.recompute_s) == (2.0, 1.0)
    assert timeline.step_time_s == 10.0 + 1.0 + 2.0  # ten ops, one re-run, the stall
