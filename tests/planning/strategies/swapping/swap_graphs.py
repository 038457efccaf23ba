"""Graphs and plan readers shared by the swap strategy's tests (test_swap*.py)."""

from __future__ import annotations

from dataclasses import replace

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import PROFILES
from memfit.data.plan import Plan, Swap
from memfit.model.synthetic import Node, from_forward

HW = PROFILES["h100-pcie"]
MIB = 1 << 20


def swapped(plan: Plan) -> set[str]:
    return set(plan.swapped)


def control_ops(plan: Plan, tensor: str) -> list[str]:
    decision = plan.decision(tensor)
    assert isinstance(decision, Swap)
    return [swap_in.after for swap_in in decision.swap_ins]


def unet(depth: int = 3, skip_bytes: int = 8 * MIB) -> CostGraph:
    """A U-Net: big encoder outputs read again by the decoder through long forward skip edges.

    Gradients are made small (1 MiB) so that the forward phase, holding every skip tensor, sets
    the peak: the case TFLMS's swap_branches is for.
    """
    nodes, previous = [], ()
    for i in range(depth):
        nodes.append(Node(f"enc{i}", previous, skip_bytes, scope=f"down.{i}"))
        for j in range(2):
            nodes.append(Node(f"enc{i}_c{j}", (nodes[-1].name,), MIB, scope=f"down.{i}"))
        previous = (nodes[-1].name,)
    nodes.append(Node("mid", previous, MIB, scope="mid"))
    for i in reversed(range(depth)):
        nodes.append(Node(f"dec{i}", (nodes[-1].name, f"enc{i}"), MIB, kind="aten.cat",
                          scope=f"up.{i}"))
        for j in range(2):
            nodes.append(Node(f"dec{i}_c{j}", (nodes[-1].name,), MIB, scope=f"up.{i}"))
    graph = from_forward(nodes, name="unet")
    tensors = [replace(t, consumers=(), size_bytes=min(t.size_bytes, MIB))
               if t.role == "gradient" else replace(t, consumers=()) for t in graph.tensors.values()]
    return CostGraph.build(graph.ops, tensors, name="unet")
