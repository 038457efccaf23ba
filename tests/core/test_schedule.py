"""lower, check_plan, memory_profile and live_buffers on the hand-checked tiny step."""

from __future__ import annotations

import pytest

from memfit.core.plan import Keep, Plan, Swap, SwapIn
from memfit.core.schedule import (
    Action,
    PlanError,
    check_plan,
    copy_buffer,
    live_buffers,
    lower,
    memory_profile,
    peak_bytes,
)
from tests.core.tiny import RESIDENT_BYTES, tiny_graph

# Swap ``a`` out after it is made and back in after ``d``, for its backward consumer ``e``.
SWAP_A = Plan("test", {"a": Swap((SwapIn("d", ("e",)),))})


def kinds_and_labels(plan: Plan) -> list[tuple[str, str]]:
    return [(action.kind, action.label) for action in lower(tiny_graph(), plan).actions]


def test_keep_lowers_to_the_ops_in_order():
    schedule = lower(tiny_graph(), Plan("keep"))
    assert schedule.actions == tuple(
        Action("compute", op.name, reads=op.inputs, allocates=op.outputs) for op in tiny_graph().ops
    )
    assert schedule.resident_bytes == RESIDENT_BYTES
    assert schedule.outputs == frozenset({"loss", "dw"})


def test_swap_lowers_to_swap_out_swap_in_and_wait_around_the_consumer():
    assert kinds_and_labels(SWAP_A) == [
        ("compute", "a"),
        ("swap_out", "swap_out(a)"),
        ("compute", "b"),
        ("compute", "c"),
        ("compute", "d"),
        ("swap_in", "swap_in(a#0)"),
        ("wait", "wait(a#0)"),
        ("compute", "e"),
    ]
    schedule = lower(tiny_graph(), SWAP_A)
    assert schedule.actions[5].allocates == (copy_buffer("a", 0),) == ("a#in0",)
    assert schedule.actions[7].reads == ("db", "a#in0")  # e reads the copy
    assert schedule.actions[2].reads == ("a",)  # b, a forward consumer, reads the original
    assert schedule.buffer_bytes["a#in0"] == 100


def test_keep_memory_profile_by_hand():
    profile = memory_profile(lower(tiny_graph(), Plan("keep")))
    # a: 3+100; b: +200; c: +4 (loss); d: +10, then b dies; e: +20, then db and a die
    assert profile.high_bytes == (103, 303, 307, 317, 137)
    assert profile.live_bytes == (103, 303, 307, 117, 27)
    assert (profile.peak_bytes, profile.peak_index) == (317, 3)


def test_swap_memory_profile_by_hand():
    profile = memory_profile(lower(tiny_graph(), SWAP_A))
    # a dies after b (its last forward reader) and comes back as a#in0 after d
    assert profile.high_bytes == (103, 103, 303, 207, 217, 117, 117, 137)
    assert profile.live_bytes == (103, 103, 203, 207, 17, 117, 117, 27)
    # the peak moves to b, which still reads the original a: 303, not 317 - 100
    assert (profile.peak_bytes, profile.peak_index) == (303, 2)
    assert peak_bytes(tiny_graph(), SWAP_A) == 303


def test_an_unserved_consumer_keeps_the_original_buffer_alive():
    # the copy serves only b; e still reads the original a, so both are live at b
    plan = Plan("test", {"a": Swap((SwapIn("a", ("b",)),))})
    profile = memory_profile(lower(tiny_graph(), plan))
    assert profile.high_bytes == (103, 103, 203, 203, 403, 307, 317, 137)
    assert (profile.peak_bytes, profile.peak_index) == (403, 4)


@pytest.mark.parametrize("plan", [Plan("keep"), SWAP_A], ids=["keep", "swap"])
def test_live_buffers_and_resident_bytes_add_up_to_the_profile(plan):
    schedule = lower(tiny_graph(), plan)
    profile = memory_profile(schedule)
    for index, high in enumerate(profile.high_bytes):
        live = live_buffers(schedule, index)
        assert sum(size for _, size in live) + RESIDENT_BYTES == high
        assert [size for _, size in live] == sorted((size for _, size in live), reverse=True)


def test_live_buffers_at_the_keep_peak():
    schedule = lower(tiny_graph(), Plan("keep"))
    assert live_buffers(schedule, 3) == [("b", 200), ("a", 100), ("db", 10), ("loss", 4)]


def test_action_labels():
    assert Action("compute", "mm").label == "mm"
    assert Action("swap_out", "mm", "t").label == "swap_out(t)"
    assert Action("swap_in", "relu", "t", 2).label == "swap_in(t#2)"
    assert Action("wait", "add", "t", 0).label == "wait(t#0)"


def test_a_plan_made_for_this_graph_is_accepted():
    graph = tiny_graph()
    check_plan(graph, Plan("keep", graph_hash=graph.structure_hash))
    check_plan(graph, Plan("keep", {"a": Keep()}))


def swap(tensor: str, *swap_ins: tuple[str, tuple[str, ...]]) -> Plan:
    return Plan("test", {tensor: Swap(tuple(SwapIn(after, c) for after, c in swap_ins))})


@pytest.mark.parametrize(
    "plan, message",
    [
        (Plan("test", {"zz": Keep()}), "names tensor 'zz', which is not in the graph"),
        (swap("w", ("a", ("a",))), "'w' is a graph input .* cannot be swapped"),
        (swap("b", ("a", ("d",))), "swap-in of 'b' after 'a' precedes its producer"),
        (swap("a", ("e", ("e",))), "swap-in of 'a' is issued after 'e', too late for 'e'"),
        (swap("a", ("c", ("e",)), ("d", ("e",))), "'e' is served by two swap-ins of 'a'"),
        (swap("a", ("b", ("d",))), "'d' does not read 'a'"),
        (swap("a", ("zz", ("e",))), "unknown control op 'zz'"),
        (swap("a", ("b", ())), "swap-in of 'a' after 'b' serves no consumer"),
        (
            Plan("test", graph_hash="0123456789abcdef"),
            "made for graph 0123456789abcdef.* plan again",
        ),
    ],
    ids=[
        "unknown-tensor",
        "graph-input",
        "before-producer",
        "too-late",
        "served-twice",
        "non-consumer",
        "unknown-control-op",
        "no-consumer",
        "graph-hash",
    ],
)
def test_check_plan_rejects_with_a_useful_message(plan, message):
    with pytest.raises(PlanError, match=message):
        check_plan(tiny_graph(), plan)
    with pytest.raises(PlanError, match=message):
        lower(tiny_graph(), plan)


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)
