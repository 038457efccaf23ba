"""lower, check_plan, memory_profile and live_buffers on the hand-checked tiny step."""

from __future__ import annotations

import pytest

from memfit.data.plan import Keep, Plan, Recompute, Rerun, Swap, SwapIn
from memfit.model import synthetic
from memfit.model.schedule import (
    Action,
    PlanError,
    check_plan,
    copy_buffer,
    live_buffers,
    lower,
    memory_profile,
    peak_bytes,
)
from tests.model.tiny import RESIDENT_BYTES, tiny_graph

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


# ---- swap-ins that feed re-runs (swap + recompute) --------------------------------------------

# f1 leaves the device in the forward pass and comes back after loss_backward, both for the
# re-run of f2 (which rebuilds the recomputed f2 before f3_backward) and for f2_backward.
FED = {"f1": Swap((SwapIn("loss_backward", ("f2", "f2_backward")),)), "f2": Recompute()}


def test_a_swap_in_feeds_the_rerun_of_the_op_it_names():
    schedule = lower(synthetic.chain(4), Plan("test", FED))
    labels = [action.label for action in schedule.actions]
    assert labels[labels.index("loss_backward"):] == [
        "loss_backward", "swap_in(f1#0)", "wait(f1#0)", "recompute(f2#0)", "f3_backward",
        "f2_backward", "f1_backward", "f0_backward",
    ]  # one wait: the re-run waits for the copy, f2_backward finds it landed
    by_label = dict(zip(labels, schedule.actions, strict=True))
    assert by_label["recompute(f2#0)"].reads == ("f1#in0", "w_f2")
    assert by_label["f2_backward"].reads == ("df2@f3", "f1#in0", "w_f2")
    assert by_label["f2"].reads == ("f1", "w_f2")  # the forward pass reads the original


def test_a_fed_rerun_frees_the_original_checkpoint_in_the_forward_pass():
    graph = synthetic.chain(4)
    recompute_only = Plan("test", {"f2": Recompute()})
    fed = lower(graph, Plan("test", FED))
    f1_bytes = graph.tensors["f1"].size_bytes
    live = memory_profile(fed).live_bytes
    at = {action.label: index for index, action in enumerate(fed.actions)}
    unfed = memory_profile(lower(graph, recompute_only)).live_bytes
    # after f3 the original f1 is gone (its swap-out read it last), which recompute-only keeps
    assert unfed[3] - live[at["f3"]] == f1_bytes
    assert "f1" not in dict(live_buffers(fed, at["loss_backward"]))
    assert "f1#in0" in dict(live_buffers(fed, at["recompute(f2#0)"]))


def test_a_rerun_of_an_op_no_swap_in_names_reads_the_original():
    # f1 is swapped for f2_backward only: the re-run of f2 reads the device original, which
    # therefore lives until it (as any consumer no swap-in names)
    graph = synthetic.chain(4)
    plan = Plan("test", {"f1": Swap((SwapIn("loss_backward", ("f2_backward",)),)),
                         "f2": Recompute()})
    schedule = lower(graph, plan)
    at = {action.label: index for index, action in enumerate(schedule.actions)}
    assert schedule.actions[at["recompute(f2#0)"]].reads == ("f1", "w_f2")
    assert "f1" in dict(live_buffers(schedule, at["loss_backward"]))


@pytest.mark.parametrize(
    "decisions, message",
    [
        ({"f1": Swap((SwapIn("f3_backward", ("f2", "f2_backward")),)), "f2": Recompute()},
         "swap-in of 'f1' after 'f3_backward' is issued too late for the re-run of 'f2' before "
         "'f3_backward'"),
        ({"f1": Swap((SwapIn("loss_backward", ("f2", "f2_backward")),))},
         "names 'f2', which runs before it, but no re-run of 'f2' comes after it"),
        ({"f1": Swap((SwapIn("loss_backward", ("f2",)), SwapIn("loss_backward", ("f2",)))),
          "f2": Recompute()}, "re-runs of 'f2' are served by two swap-ins of 'f1'"),
        ({"f1": Swap((SwapIn("f1_backward", ("f2_backward",)),))},  # not a forward op: no re-run
         "swap-in of 'f1' is issued after 'f1_backward', too late for 'f2_backward'"),
    ],
    ids=["too-late-for-the-rerun", "no-rerun-to-feed", "fed-twice", "backward-reader-too-late"],
)
def test_check_plan_rejects_swap_ins_that_cannot_feed_their_reruns(decisions, message):
    with pytest.raises(PlanError, match=message):
        check_plan(synthetic.chain(4), Plan("test", decisions))
    with pytest.raises(PlanError, match=message):
        lower(synthetic.chain(4), Plan("test", decisions))


def test_explicit_reruns_read_the_latest_copy_issued_before_them():
    graph = synthetic.chain(4)
    plan = Plan("test", {"f1": Swap((SwapIn("loss", ("f2",)), SwapIn("f3_backward", ("f2",))))},
                reruns=(Rerun("f2", "f3_backward"), Rerun("f2", "f1_backward")))
    check_plan(graph, plan)
    recomputes = [a for a in lower(graph, plan).actions if a.kind == "recompute"]
    assert [a.reads[0] for a in recomputes] == ["f1#in0", "f1#in1"]
