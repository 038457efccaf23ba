"""Lifetimes outside a region's joint graph (memfit.model.lifetimes), on a hand-checked step:
what each op's live bytes become, op by op."""

from __future__ import annotations

import pytest

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.model.lifetimes import with_loop_lifetimes, with_retained_saves, with_storage_from
from memfit.model.schedule import lower, memory_profile

KIB = 1024


def step(tangent_read: bool = True) -> CostGraph:
    """forward: f1 makes a (8 KiB, saved), f2 reads a, makes the output y (4 KiB); backward: b1
    reads a and the tangent t (2 KiB; or not), makes g (1 KiB); b2 reads g, makes w."""
    ops = [Op("f1", "aten.mm", "forward", outputs=("a",)),
           Op("f2", "aten.relu", "forward", inputs=("a",), outputs=("y",)),
           Op("b1", "aten.mm", "backward", inputs=("a", "t") if tangent_read else ("a",),
              outputs=("g",)),
           Op("b2", "aten.mm", "backward", inputs=("g",), outputs=("w",))]
    tensors = [Tensor("t", 2 * KIB, "input"), Tensor("a", 8 * KIB, "activation"),
               Tensor("y", 4 * KIB, "activation", is_output=True),
               Tensor("g", 1 * KIB, "gradient"), Tensor("w", 16, "gradient", is_output=True)]
    return CostGraph.build(ops, tensors, name="step")


def live_bytes(graph: CostGraph) -> list[int]:
    """Bytes alive while each op runs (its outputs made, nothing freed yet)."""
    return list(memory_profile(lower(graph, Plan("keep"))).high_bytes)


def test_the_step_as_captured_holds_the_tangent_from_the_start_and_the_output_to_the_end():
    assert live_bytes(step()) == [10 * KIB, 14 * KIB, 15 * KIB, 7 * KIB + 16]


def test_a_storage_made_by_the_first_backward_op_counts_from_it_to_the_end():
    graph = with_storage_from(step(), "later", 32 * KIB, "b1")
    assert graph.tensors["later"].producer == "b1" and graph.tensors["later"].is_output
    assert live_bytes(graph) == [10 * KIB, 14 * KIB, 47 * KIB, 39 * KIB + 16]
    assert graph.saved_tensors() == step().saved_tensors()  # nothing new to swap or recompute


def test_a_storage_name_already_taken_is_refused():
    with pytest.raises(ValueError, match="already a tensor"):
        with_storage_from(step(), "a", KIB, "b1")


def test_the_loops_lifetimes_tangent_from_the_backward_and_the_dropped_output_freed():
    graph = with_loop_lifetimes(step(), arriving={"t": "f2"}, released={"y": "f2"},
                                held=frozenset({"t"}))
    # t made by f2 (the op before the backward) and held to the end; y freed after f2
    assert live_bytes(graph) == [8 * KIB, 14 * KIB, 11 * KIB, 3 * KIB + 16]


def test_an_output_the_loop_drops_stays_through_the_forward_that_returns_it():
    graph = with_loop_lifetimes(step(), arriving={}, released={"y": "f2"})
    assert graph.tensors["y"].consumers == () and not graph.tensors["y"].is_output
    early = with_loop_lifetimes(step(), arriving={}, released={"a": "f2"})
    assert early.tensors["a"].consumers == ("f2", "b1")  # read later anyway: held to its reader


def test_a_tangent_passed_as_none_and_read_by_nothing_counts_nothing():
    assert live_bytes(step(tangent_read=False)) == live_bytes(step())
    graph = with_loop_lifetimes(step(tangent_read=False), arriving={}, released={},
                                absent=frozenset({"t"}))
    assert live_bytes(graph) == [8 * KIB, 12 * KIB, 13 * KIB, 5 * KIB + 16]


def test_a_retained_backward_holds_the_saves_it_reads_not_the_copies_it_swaps_in():
    """``retain_graph=True``: a kept save lives to the backward's end; a swapped one's copy, made
    by the backward, still dies after its last reader, and the original after its swap-out."""
    ops = [Op("f1", "aten.mm", "forward", outputs=("a",)),
           Op("f2", "aten.mm", "forward", inputs=("a",), outputs=("b",)),
           Op("f3", "aten.relu", "forward", inputs=("b",), outputs=("y",)),
           Op("b1", "aten.mm", "backward", inputs=("b", "t"), outputs=("g",)),
           Op("b2", "aten.mm", "backward", inputs=("a", "g"), outputs=("w",)),
           Op("b3", "aten.mm", "backward", inputs=("w",), outputs=("v",))]
    tensors = [Tensor("t", 2 * KIB, "input"), Tensor("a", 8 * KIB, "activation"),
               Tensor("b", 4 * KIB, "activation"),
               Tensor("y", 1 * KIB, "activation", is_output=True),
               Tensor("g", 1 * KIB, "gradient"), Tensor("w", 16, "gradient"),
               Tensor("v", 16, "gradient", is_output=True)]
    graph = CostGraph.build(ops, tensors, name="step")
    retained = with_retained_saves(graph)
    assert with_retained_saves(retained) is retained and retained.saved_tensors() == \
        graph.saved_tensors()
    assert live_bytes(graph)[-1] == 3 * KIB + 32  # t, y, w, v
    assert live_bytes(retained)[-1] == 15 * KIB + 32  # and the saves a and b
    swap_a = Plan("test", {"a": Swap((SwapIn("b1", ("b2",)),))})

    def swapped(step: CostGraph) -> list[int]:
        return list(memory_profile(lower(step, swap_a)).high_bytes)

    # b's kept to the end; a's copy made after b1, freed after b2 as without retain_graph
    assert [h - s for h, s in zip(swapped(retained), swapped(graph), strict=True)] == \
        [0] * 5 + [4 * KIB] * 4
