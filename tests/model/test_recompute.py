"""Recompute lowering: each producer re-runs once, before its first backward reader."""

import math

import pytest

from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Recompute, Rerun, Swap, SwapIn
from memfit.model import synthetic
from memfit.model.recompute import memory_poor_reruns
from memfit.model.schedule import PlanError, lower, memory_profile
from memfit.model.simulate import simulate

UNIT = Hardware("unit", {"float32": 1.0}, 1.0, 1.0, 1.0, op_overhead_s=0.0, copy_latency_s=0.0)


def checkpointed(graph, kept):
    """Recompute every forward activation but ``kept``."""
    decisions = {
        name: Recompute()
        for name, t in graph.tensors.items()
        if t.role == "activation" and not t.is_output and name not in kept
    }
    return Plan("test", decisions, graph_hash=graph.structure_hash)


def test_each_producer_reruns_once_before_its_first_backward_reader():
    graph = synthetic.chain(8)
    plan = checkpointed(graph, {"f3"})
    actions = lower(graph, plan).actions
    reruns = [a for a in actions if a.kind == "recompute"]
    assert sorted(a.op for a in reruns) == ["f0", "f1", "f2", "f4", "f5", "f6"]  # f7 feeds only the loss
    position = {a.label: i for i, a in enumerate(actions)}
    for action in reruns:
        readers = [c for c in graph.tensors[action.op].consumers if graph.op(c).phase == "backward"]
        assert position[action.label] < min(position[r] for r in readers)
    # a segment is rebuilt in one go, in forward order, from the checkpoint f3
    assert [a.op for a in reruns][:3] == ["f4", "f5", "f6"]
    f5 = next(a for a in reruns if a.op == "f5")
    assert f5.reads[0].startswith("f4#re") and "f3" in next(a for a in reruns if a.op == "f4").reads


def test_recompute_time_is_the_rerun_ops_time():
    graph = synthetic.chain(8, time_s=1.0)
    timeline = simulate(graph, checkpointed(graph, {"f3"}), UNIT)
    assert timeline.recompute_s == 6.0
    assert timeline.step_time_s == pytest.approx(graph.step_time_s + 6.0)


@pytest.mark.parametrize("length", [16, 64, 100])
def test_pebble_game_on_a_chain(length):
    """Default O(n) memory; sqrt(n) checkpoints O(sqrt n) memory for at most one extra forward."""
    unit = 1 << 20
    graph = synthetic.chain(length, size_bytes=unit, time_s=1.0, weight_bytes=0)
    resident = graph.resident_bytes
    keep = simulate(graph, Plan("keep"), UNIT)
    assert keep.peak_bytes - resident >= length * unit  # every activation alive at the loss
    step = round(math.sqrt(length))
    kept = {f"f{i}" for i in range(step - 1, length, step)}
    timeline = simulate(graph, checkpointed(graph, kept), UNIT)
    activations = (timeline.peak_bytes - resident) / unit
    assert activations <= 2 * 2 * math.sqrt(length)  # within 2x of 2 sqrt(n) outputs
    assert timeline.recompute_s <= length * 1.0  # at most one extra forward pass


def test_recompute_errors_say_what_to_do():
    graph = synthetic.chain(4)
    cases = {
        "x": "graph input",
        "loss": "returned by the step",
        "df2@f3": "backward pass",
    }
    for name, message in cases.items():
        with pytest.raises(PlanError, match=message):
            lower(graph, Plan("t", {name: Recompute()}))
    late = Swap((SwapIn("f3_backward", ("f2", "f2_backward")),))  # f2 re-runs before f3_backward
    with pytest.raises(PlanError, match="issued too late for the re-run of 'f2' before "
                                        "'f3_backward': issue it after an op that runs before"):
        lower(graph, Plan("t", {"f1": late, "f2": Recompute()}))


def test_recompute_lowers_the_peak_and_memory_profile_agrees_with_simulate():
    graph = synthetic.resnet_like(4)
    plan = checkpointed(graph, {f"b{b}_add" for b in range(4)} | {"stem"})
    keep_peak = memory_profile(lower(graph, Plan("keep"))).peak_bytes
    assert simulate(graph, plan, UNIT).peak_bytes == memory_profile(lower(graph, plan)).peak_bytes
    assert simulate(graph, plan, UNIT).peak_bytes < keep_peak


@pytest.mark.parametrize("length", [4, 16, 32])
def test_memory_poor_reruns_need_constant_memory_and_quadratic_compute(length):
    """The article's memory-poor strategy, as explicit re-runs: each value rebuilt many times."""
    graph = synthetic.chain(length, size_bytes=1 << 20, time_s=1.0, weight_bytes=0)
    plan = Plan("poor", reruns=tuple(Rerun(op, b) for op, b in memory_poor_reruns(graph)))
    timeline = simulate(graph, plan, UNIT)
    assert (timeline.peak_bytes - graph.resident_bytes) >> 20 == 3  # whatever the length
    assert timeline.recompute_s == pytest.approx(length * (length - 1) / 2)
    assert sum(a.kind == "recompute" and a.op == "f0" for a in lower(graph, plan).actions) == length - 1


def test_a_rerun_must_follow_its_op_and_be_a_forward_op_that_allocates():
    graph = synthetic.chain(4)
    for rerun, message in [(Rerun("f2", "f1"), "runs earlier"), (Rerun("f0_backward", "f0_backward"),
                           "only forward ops"), (Rerun("nope", "f1"), "unknown op")]:
        with pytest.raises(PlanError, match=message):
            lower(graph, Plan("t", reruns=(rerun,)))
