"""Fixed chain schedules to compare the DP with (the article's three), and chains from CostGraphs.

Each schedule is a tuple of ``memfit.solvers.chain`` operations for a chain of ``steps`` steps;
``simulate_chain`` measures it. With unit activations and no gradient bytes (the pebble game):

| schedule          | peak (activations)         | extra forward steps            |
|-------------------|----------------------------|--------------------------------|
| ``default``       | l                          | 0                              |
| ``memory_poor``   | 2 (input and output of F)  | l (l - 1) / 2                  |
| ``sqrt``, k = ⌈√l⌉ | max(k + 1, 2k - 2) for l = k² | l - ⌈l / k⌉ (< one forward pass) |
"""

from __future__ import annotations

import math

from memfit.core.costgraph import CostGraph, Op
from memfit.solvers.chain import Backward, ChainCosts, Forward, Free, Loss, Operation


def default_schedule(steps: int) -> tuple[Operation, ...]:
    """Keep every activation: the forward pass, the loss, the backward pass (O(l) memory)."""
    return (*(Forward(step) for step in range(1, steps + 1)), Loss(),
            *(Backward(step) for step in range(steps, 0, -1)))


def memory_poor_schedule(steps: int) -> tuple[Operation, ...]:
    """Keep nothing but the input: each B_i recomputes a_{i-1} from a_0 (O(1) memory, O(l²) time).

    This is the article's strategy (forget each node as soon as it is consumed), so even a_{l-1},
    which the forward pass has just made, is dropped and recomputed for B_l.
    """
    operations: list[Operation] = [*_advance(0, steps), Loss()]
    for step in range(steps, 0, -1):
        operations += _advance(0, step - 1)
        operations.append(Backward(step))
    return tuple(operations)


def sqrt_schedule(steps: int, every: int | None = None) -> tuple[Operation, ...]:
    """Checkpoints a_k, a_2k, ... (k = ⌈√l⌉ unless ``every`` is given); each segment recomputed once.

    The forward pass keeps only the checkpoints. The backward pass takes the segments last to
    first: it recomputes and keeps the segment's activations from its checkpoint, then runs its
    backward steps. Every F_i runs at most twice: one extra forward pass at most.
    """
    every = every or max(1, math.ceil(math.sqrt(steps)))
    checkpoints = [step for step in range(every, steps, every)]
    operations: list[Operation] = []
    for step in range(1, steps + 1):
        operations.append(Forward(step))
        if step - 1 >= 1 and step - 1 not in checkpoints:
            operations.append(Free(step - 1))
    operations.append(Loss())
    bounds = [0, *checkpoints, steps]
    for start, end in reversed(list(zip(bounds, bounds[1:], strict=False))):
        operations += [Forward(step) for step in range(start + 1, end)]
        operations += [Backward(step) for step in range(end, start, -1)]
    return tuple(operations)


def _advance(start: int, end: int) -> list[Operation]:
    operations: list[Operation] = []
    for step in range(start + 1, end + 1):
        operations.append(Forward(step))
        if step - 1 > start:
            operations.append(Free(step - 1))
    return operations


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
