"""A chain-shaped CostGraph as ``ChainCosts``: how the chain DP and the MILP are compared."""

from __future__ import annotations

from memfit.core.costgraph import CostGraph, Op
from memfit.solvers.chain import ChainCosts


def chain_costs_from_graph(graph: CostGraph) -> ChainCosts:
    """The ``ChainCosts`` of a chain-shaped CostGraph (``memfit.core.synthetic.chain``).

    Forward ops F_1..F_l then the loss op; backward ops: the seed, then B_l..B_1. Sizes are the
    ops' output storages: B_i's outputs that the step returns (weight gradients) are
    ``output_bytes``, the rest is g_{i-1}. Resident storages (input, parameters) are left out, so
    a graph budget B corresponds to a chain budget B - ``graph.resident_bytes``.

    Raises:
        ValueError: if the graph is not such a chain.
    """
    forward = [op for op in graph.ops if op.phase == "forward"]
    backward = [op for op in graph.ops if op.phase == "backward"]
    if len(forward) < 2 or len(backward) != len(forward) or len(graph.ops) != 2 * len(forward):
        raise ValueError(f"{graph.name} is not a chain: expected l forward ops, a loss, a seed and l backward ops")
    *steps, loss = forward
    seed, *reverse = backward
    for index, op in enumerate(steps):
        if op.depends_on != tuple(s.name for s in steps[index - 1: index] if index):
            raise ValueError(f"{op.name} does not read only the previous step: not a chain")
    if loss.depends_on != (steps[-1].name,) or seed.depends_on != (loss.name,):
        raise ValueError(f"{graph.name}: the loss must read the last step and the seed the loss")
    in_order = reverse[::-1]  # B_1..B_l
    activations = [_bytes(graph, op, outputs=False) for op in steps]
    gradients = [_bytes(graph, op, outputs=False) for op in in_order[1:]] + [_bytes(graph, seed, outputs=False)]
    for index, op in enumerate(in_order):
        needed = {t for t in op.inputs if graph.tensors[t].role == "activation"}
        expected = set(steps[index - 1].outputs) if index else set()
        if needed != expected:
            raise ValueError(f"{op.name} reads activations {sorted(needed)}, not {sorted(expected)}")
    return ChainCosts(
        forward_time_s=tuple(op.time_s for op in steps),
        backward_time_s=tuple(op.time_s for op in in_order),
        activation_bytes=tuple(activations),
        gradient_bytes=tuple(gradients),
        output_bytes=tuple(_bytes(graph, op, outputs=True) for op in in_order),
        loss_bytes=_bytes(graph, loss, outputs=True) + _bytes(graph, loss, outputs=False),
    )


def _bytes(graph: CostGraph, op: Op, outputs: bool) -> int:
    """Bytes of ``op``'s storages that the step returns (``outputs``) or that die (not)."""
    return sum(graph.tensors[t].size_bytes for t in op.outputs if graph.tensors[t].is_output == outputs)
