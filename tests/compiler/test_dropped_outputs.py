"""A region planned for a loop that keeps only its loss (``dropped_outputs_graph``), on a
hand-checked step: the output the loop drops is freed when the forward ends; its tangent, which
nothing passes, is made before its first reader where the backward takes ``None`` (aot_eager),
and stays resident where autograd makes it as zeros before the backward (inductor)."""

from __future__ import annotations

from memfit.compiler.region_lifetimes import dropped_outputs_graph
from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Plan
from memfit.model.schedule import lower, memory_profile

KIB = 1024


def step() -> CostGraph:
    """forward: f1 makes a (8 KiB, saved), f2 reads a, makes the logits y (4 KiB) and f3 the
    loss (4 B); backward: b1 reads a, makes g (1 KiB); b2 reads g and y's tangent t (4 KiB),
    makes w."""
    ops = [Op("f1", "aten.mm", "forward", outputs=("a",)),
           Op("f2", "aten.relu", "forward", inputs=("a",), outputs=("y",)),
           Op("f3", "aten.sum", "forward", inputs=("y",), outputs=("loss",)),
           Op("b1", "aten.mm", "backward", inputs=("a",), outputs=("g",)),
           Op("b2", "aten.mm", "backward", inputs=("g", "t"), outputs=("w",))]
    tensors = [Tensor("t", 4 * KIB, "input"), Tensor("a", 8 * KIB, "activation"),
               Tensor("y", 4 * KIB, "activation", is_output=True),
               Tensor("loss", 4, "activation", is_output=True),
               Tensor("g", 1 * KIB, "gradient"), Tensor("w", 16, "gradient", is_output=True)]
    return CostGraph.build(ops, tensors, name="step")


def live_bytes(graph: CostGraph) -> list[int]:
    """Bytes alive while each op runs (its outputs made, nothing freed yet)."""
    return list(memory_profile(lower(graph, Plan("keep"))).high_bytes)


def test_without_a_tangent_passed_the_zeros_are_made_before_their_first_reader():
    graph, released = dropped_outputs_graph(step(), ["y", "loss"], ["t", None])
    assert released == {"y"}
    # captured, t counts from the step's start and y to its end; here, y is freed when the
    # forward ends and t made just before b2 reads it (counted with b1's allocations)
    assert live_bytes(step()) == [12 * KIB, 16 * KIB, 16 * KIB + 4, 17 * KIB + 4, 9 * KIB + 20]
    assert live_bytes(graph) == [8 * KIB, 12 * KIB, 12 * KIB + 4, 13 * KIB + 4, 5 * KIB + 20]


def test_where_autograd_makes_the_zeros_the_tangent_stays_resident_as_captured():
    """Made as a value of the forward, the tangent would be one a plan could swap or re-run: it
    stays an input, counted from the step's start (more than autograd holds, never less)."""
    graph, released = dropped_outputs_graph(step(), ["y", "loss"], ["t", None],
                                            tangents_as_none=False)
    assert released == {"y"}
    assert live_bytes(graph) == [12 * KIB, 16 * KIB, 16 * KIB + 4, 13 * KIB + 4, 5 * KIB + 20]


def test_a_refusal_at_the_loops_smaller_minimum_says_what_holding_the_outputs_needs():
    """Where neither plan fits, the error is the smaller minimum's, the loop's; it says that the
    minimum is for a loop keeping only the loss, and names the minimum with the outputs held
    (a Hugging Face loop holding ``out`` with its logits and key/value cache was told 10.30 MiB,
    then refused at it with 13.30 MiB one iteration later)."""
    import pytest

    from memfit.compiler.loop_lifetimes import planned_for_the_loop
    from memfit.data.errors import BudgetError
    from memfit.data.hardware import get_hardware
    from memfit.data.units import Budget, format_bytes
    from memfit.planning.step import plan_step

    hardware = get_hardware("h100-pcie")
    held = step()
    loop, _ = dropped_outputs_graph(held, ["y", "loss"], ["t", None])
    with pytest.raises(BudgetError) as held_refusal:
        plan_step(held, hardware, Budget(bytes=1), "keep", {}, 0)
    held_minimum = held_refusal.value.minimum_bytes
    with pytest.raises(BudgetError) as refused:
        planned_for_the_loop(loop, hardware, held_refusal.value, "keep", {}, 0)
    assert refused.value.minimum_bytes < held_minimum
    assert "keeps only the loss" in str(refused.value)
    assert f"needs {format_bytes(held_minimum)}" in str(refused.value)
