"""Lowering of ``Recompute`` decisions: which producers re-run, where, reading what.

A recomputed tensor's producer re-runs once, right before the first backward op that needs it,
directly or through another recomputed tensor (the rebuild of a segment runs in one go, as in
Chen et al.'s sqrt(n) checkpointing). A re-run reads the rebuilt copy of each recomputed input
and the original of everything else, which stretches those originals' lifetimes to the re-run:
that is what makes them checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memfit.core.costgraph import CostGraph
from memfit.core.plan import Plan, Recompute


def rebuilt_buffer(tensor: str) -> str:
    """The name of the device buffer that holds the rebuilt copy of ``tensor``."""
    return f"{tensor}#re"


@dataclass(frozen=True)
class RecomputeLowering:
    """What the recompute decisions add to the program.

    Args:
        reruns_before: backward op -> producers re-run right before it, in execution order.
        reads: re-run op -> the buffers it reads (rebuilt copies where its inputs are recomputed).
        redirect: backward consumer -> {recomputed tensor: rebuilt buffer it reads instead}.
        buffer_bytes: size of every rebuilt buffer.
    """

    reruns_before: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    reads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    redirect: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    buffer_bytes: Mapping[str, int] = field(default_factory=dict)


def lower_recompute(graph: CostGraph, plan: Plan) -> RecomputeLowering:
    """Where each recomputed tensor's producer re-runs, and what the backward ops then read."""
    recomputed = {name for name, d in plan.decisions.items() if isinstance(d, Recompute)}
    if not recomputed:
        return RecomputeLowering()
    deadline = _deadlines(graph, recomputed)
    reruns_before: dict[str, list[str]] = {}
    for producer in sorted(deadline, key=graph.index.__getitem__):
        reruns_before.setdefault(graph.ops[deadline[producer]].name, []).append(producer)
    reads = {
        producer: tuple(rebuilt_buffer(t) if t in recomputed else t for t in graph.op(producer).inputs)
        for producer in deadline
    }
    redirect: dict[str, dict[str, str]] = {}
    for name in recomputed:
        for consumer in graph.tensors[name].consumers:
            if graph.op(consumer).phase != "forward":
                redirect.setdefault(consumer, {})[name] = rebuilt_buffer(name)
    buffer_bytes = {
        rebuilt_buffer(t): graph.tensors[t].size_bytes
        for producer in deadline
        for t in graph.op(producer).outputs
    }
    return RecomputeLowering(
        {op: tuple(names) for op, names in reruns_before.items()}, reads, redirect, buffer_bytes
    )


def _deadlines(graph: CostGraph, recomputed: set[str]) -> dict[str, int]:
    """Producer -> position of the first backward op needing it (directly or through a re-run)."""
    deadline: dict[str, int] = {}
    pending: list[tuple[str, int]] = []
    for name in recomputed:
        tensor = graph.tensors[name]
        late = [graph.index[c] for c in tensor.consumers if graph.op(c).phase != "forward"]
        if late and tensor.producer is not None:
            pending.append((tensor.producer, min(late)))
    while pending:  # an explicit stack: segments can be thousands of ops long
        producer, position = pending.pop()
        if deadline.get(producer, len(graph.ops)) <= position:
            continue
        deadline[producer] = position
        for source in graph.op(producer).inputs:
            if source in recomputed:
                pending.append((graph.tensors[source].producer, position))  # type: ignore[arg-type]
    return deadline
