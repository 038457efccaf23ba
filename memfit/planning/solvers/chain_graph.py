"""A chain-shaped CostGraph as ``ChainCosts``: how the chain DP and the MILP are compared."""

from __future__ import annotations

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.planning.solvers.chain import ChainCosts


def chain_costs_from_graph(graph: CostGraph) -> ChainCosts:
    """The ``ChainCosts`` of a chain-shaped CostGraph (``memfit.model.synthetic.chain``).

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


def chain_graph(costs: ChainCosts, name: str = "chain") -> CostGraph:
    """The CostGraph of a ``ChainCosts`` (the inverse of ``chain_costs_from_graph``).

    Ops F1..Fl, ``loss``, ``seed``, Bl..B1 with storages a0 (the resident input, 0 bytes),
    a1..al, ``loss``, g1..gl and w1..wl (B_i's returned outputs). The MILP on it optimises over
    the same schedules as ``simulate_chain`` with ``in_place_forward=False``.
    """
    if costs.in_place_forward:
        raise ValueError("a CostGraph has no in-place steps: use in_place_forward=False")
    steps = costs.steps
    tensors = [Tensor("a0", 0, "input"), Tensor("loss", costs.loss_bytes, "activation", is_output=True)]
    ops: list[Op] = []
    for step in range(1, steps + 1):
        tensors.append(Tensor(f"a{step}", costs.activation_bytes[step - 1], "activation"))
        ops.append(Op(f"F{step}", "chain.forward", "forward", inputs=(f"a{step - 1}",),
                      outputs=(f"a{step}",), depends_on=(f"F{step - 1}",) if step > 1 else (),
                      time_s=costs.forward_time_s[step - 1]))
    ops.append(Op("loss", "chain.loss", "forward", inputs=(f"a{steps}",), outputs=("loss",),
                  depends_on=(f"F{steps}",)))
    tensors.append(Tensor(f"g{steps}", costs.gradient_bytes[steps - 1], "gradient"))
    ops.append(Op("seed", "chain.seed", "backward", inputs=("loss",), outputs=(f"g{steps}",),
                  depends_on=("loss",)))
    for step in range(steps, 0, -1):
        tensors.append(Tensor(f"w{step}", costs.output_bytes[step - 1], "gradient", is_output=True))
        outputs: tuple[str, ...] = (f"w{step}",)
        if step > 1:
            tensors.append(Tensor(f"g{step - 1}", costs.gradient_bytes[step - 2], "gradient"))
            outputs = (f"g{step - 1}", f"w{step}")
        ops.append(Op(f"B{step}", "chain.backward", "backward", inputs=(f"g{step}", f"a{step - 1}"),
                      outputs=outputs, time_s=costs.backward_time_s[step - 1],
                      depends_on=("seed" if step == steps else f"B{step + 1}",
                                  *((f"F{step - 1}",) if step > 1 else ()))))
    return CostGraph.build(ops, tensors, name=name)
