"""Random valid swap plans for property tests of the schedule and the simulator."""

from __future__ import annotations

import random

from memfit.data.costgraph import CostGraph, Tensor
from memfit.data.plan import Plan, Recompute, Swap, SwapIn


def random_swap_plan(
    graph: CostGraph,
    rng: random.Random,
    swap_probability: float = 0.5,
    disjoint: bool = False,
) -> Plan:
    """A plan that swaps a random subset of the saved tensors, valid by construction.

    Args:
        graph: the graph to plan for.
        rng: the source of randomness (seed it for a reproducible plan).
        swap_probability: the chance that each saved tensor is swapped.
        disjoint: ``False`` groups the backward consumers at random, may leave some groups
            reading the original buffer, and puts each control op anywhere strictly between the
            producer and the group's first consumer. ``True`` serves every backward consumer with
            copies that never overlap: contiguous groups, each issued no earlier than the tensor's
            last forward consumer and the previous group's last consumer. Such a plan can never
            raise the peak above keep's.
    """
    decisions = {}
    for tensor in graph.saved_tensors():
        if tensor.is_output or rng.random() >= swap_probability:
            continue  # an output lives to the end of the step: swapping it frees nothing
        swap_ins = _swap_ins(graph, tensor, rng, disjoint)
        if swap_ins:
            decisions[tensor.name] = Swap(swap_ins, reason="random")
    return Plan("random", decisions, graph_hash=graph.structure_hash)


def _swap_ins(
    graph: CostGraph, tensor: Tensor, rng: random.Random, disjoint: bool
) -> tuple[SwapIn, ...]:
    index = graph.index
    assert tensor.producer is not None
    backward = [c for c in tensor.consumers if graph.op(c).phase == "backward"]
    forward = [index[c] for c in tensor.consumers if graph.op(c).phase != "backward"]
    groups = _contiguous_groups(backward, rng) if disjoint else _random_groups(backward, rng)
    lowest = index[tensor.producer] + 1
    if disjoint:
        lowest = max([lowest, *forward])
    swap_ins = []
    for group in groups:
        first = index[group[0]]
        if lowest > first - 1:
            return ()  # no op strictly between: leave the tensor kept
        after = graph.ops[rng.randint(lowest, first - 1)].name
        swap_ins.append(SwapIn(after, tuple(group)))
        if disjoint:
            lowest = index[group[-1]]
    if not disjoint:
        served = [s for s in swap_ins if rng.random() < 0.8]
        swap_ins = served or swap_ins[:1]
    return tuple(swap_ins)


def _random_groups(consumers: list[str], rng: random.Random) -> list[list[str]]:
    """Assign each consumer to one of a random number of groups; each group in program order."""
    count = rng.randint(1, len(consumers))
    groups: list[list[str]] = [[] for _ in range(count)]
    for consumer in consumers:
        groups[rng.randrange(count)].append(consumer)
    return [group for group in groups if group]


def _contiguous_groups(consumers: list[str], rng: random.Random) -> list[list[str]]:
    """Cut the consumers (in program order) into runs at random places."""
    groups = [[consumers[0]]]
    for consumer in consumers[1:]:
        if rng.random() < 0.5:
            groups.append([])
        groups[-1].append(consumer)
    return groups


def random_recompute_plan(graph: CostGraph, seed: int) -> Plan:
    """Recompute a random half of the forward tensors (a valid plan: ``lower`` re-runs what
    each rebuild needs)."""
    forward = sorted(name for name, tensor in graph.tensors.items()
                     if tensor.producer is not None and not tensor.is_output
                     and graph.op(tensor.producer).phase == "forward")
    chosen = random.Random(seed).sample(forward, len(forward) // 2)
    return Plan("recompute", {name: Recompute("random") for name in sorted(chosen)})
