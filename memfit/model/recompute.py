"""Re-runs: which forward ops run again, right before which op, and whose readers they serve.

Two sources feed one list. A ``Recompute`` decision re-runs its tensor's producer once, right
before the first backward op that needs it, directly or to rebuild another recomputed tensor (a
segment is rebuilt in one go, as in Chen et al.'s sqrt(n) checkpointing). ``Plan.reruns`` lists
explicit re-runs (schedules from the optimal solvers), which may rebuild a value many times.

A re-run makes a new *instance* of its op's outputs; ``schedule.lower`` points later readers at
the newest instance of every output a re-run *replaces*, and the liveness walk frees each
instance after its last reader. A kept input read by a re-run lives until then: that is what
makes it a checkpoint.
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.data.costgraph import CostGraph
from memfit.data.plan import Plan, Recompute


def rebuilt_buffer(tensor: str, instance: int) -> str:
    """The name of the device buffer holding re-run number ``instance``'s copy of ``tensor``."""
    return f"{tensor}#re{instance}"


class PlannedRerun(NamedTuple):
    """One re-run: ``op`` runs again right before ``before``; later readers of the tensors in
    ``replaces`` read its new instance (its other outputs die unread). A named tuple: pricing
    makes hundreds of thousands."""

    op: str
    before: str
    replaces: frozenset[str]


def planned_reruns(graph: CostGraph, plan: Plan) -> dict[str, list[PlannedRerun]]:
    """Re-runs grouped by the op they precede, in program order."""
    grouped: dict[str, list[PlannedRerun]] = {}
    for rerun in _decided_reruns(graph, plan) + [
        PlannedRerun(r.op, r.before, frozenset(graph.op(r.op).outputs)) for r in plan.reruns
    ]:
        grouped.setdefault(rerun.before, []).append(rerun)
    return grouped


def _decided_reruns(graph: CostGraph, plan: Plan) -> list[PlannedRerun]:
    """The re-runs ``Recompute`` decisions imply: each producer once, before its first need."""
    recomputed = {name for name, d in plan.decisions.items() if isinstance(d, Recompute)}
    return decided_reruns(graph, recomputed) if recomputed else []


def decided_reruns(graph: CostGraph, recomputed: set[str],
                   first_late_reader: dict[str, int] | None = None) -> list[PlannedRerun]:
    """The re-runs that recomputing ``recomputed`` implies, in program order.

    Args:
        first_late_reader: tensor -> position of its first reader outside the forward pass
            (computed here when not given; planners pricing many plans pass it in).
    """
    deadline = rerun_deadlines(graph, recomputed, first_late_reader)
    names, outputs_of = _names_and_outputs(graph)
    # rerun_deadlines settles producers in reverse program order: reversed, in program order
    return [
        PlannedRerun(producer, names[position],
                     frozenset(recomputed.intersection(outputs_of[producer])))
        for producer, position in reversed(deadline.items())
    ]


def first_late_readers(graph: CostGraph) -> dict[str, int]:
    """Tensor -> position of its first reader outside the forward pass (tensors read there)."""
    found: dict[str, int] = {}
    for position, op in enumerate(graph.ops):
        if op.phase != "forward":
            for tensor in op.inputs:
                found.setdefault(tensor, position)
    return found


def late_readers(graph: CostGraph) -> dict[str, int]:
    """``first_late_readers(graph)``, once per graph (shared: its readers must not change it)."""
    return graph.remembered("first late readers", lambda: first_late_readers(graph))


def rerun_deadlines(graph: CostGraph, recomputed: set[str],
               first_late_reader: dict[str, int] | None = None) -> dict[str, int]:
    """Producer -> position of the first backward op needing it (directly or through a re-run),
    in reverse program order of the producers.

    One sweep in reverse program order: a producer's deadline is the earliest late reader of
    its recomputed outputs, or the earliest deadline of a re-run reading them, and every such
    re-run comes later in the program, so it is settled first.
    """
    late_reader = late_readers(graph) if first_late_reader is None else first_late_reader
    produced_at, consumers_of = _producers_and_consumers(graph)
    ops, end = graph.ops, len(graph.ops)
    late, consumed = late_reader.get, consumers_of.__getitem__
    deadline: dict[str, int] = {}
    settled = deadline.get
    # the hot loop of recompute pricing: comparisons, not min(), and no per-tensor lookups
    for position in sorted({produced_at[name] for name in recomputed if name in produced_at},
                           reverse=True):
        op = ops[position]
        earliest = end
        for name in op.outputs:
            if name not in recomputed:
                continue
            found = late(name, end)
            if found < earliest:
                earliest = found
            for consumer in consumed(name):
                found = settled(consumer, end)
                if found < earliest:
                    earliest = found
        if earliest < end:
            deadline[op.name] = earliest
    return deadline


def _names_and_outputs(graph: CostGraph) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """Op names in program order, and op name -> its outputs (once per graph)."""
    return graph.remembered("op names and outputs", lambda: (
        [op.name for op in graph.ops], {op.name: op.outputs for op in graph.ops}))


def _producers_and_consumers(graph: CostGraph) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """Tensor -> its producer's position (tensors with a producer), and tensor -> its consumers
    (once per graph: the recompute planners price thousands of sets of one graph)."""

    def make() -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
        index = graph.index
        return ({name: index[t.producer] for name, t in graph.tensors.items()
                 if t.producer is not None},
                {name: tuple(t.consumers) for name, t in graph.tensors.items()})

    return graph.remembered("producers and consumers", make)


def memory_poor_reruns(graph: CostGraph) -> tuple[tuple[str, str], ...]:
    """``(op, before)`` re-runs that rebuild, right before every backward op, what it reads from
    the forward pass, from the graph inputs up: the article's memory-poor strategy, O(1) memory
    for O(n^2) compute on a chain. Useful as the far end of the trade-off and as a test of
    re-runs that rebuild a value many times.
    """
    phase = {op.name: op.phase for op in graph.ops}
    reruns: list[tuple[str, str]] = []
    for op in graph.ops:
        if op.phase == "forward":
            continue
        needed = {
            producer
            for t in op.inputs
            if not graph.tensors[t].is_output
            and (producer := graph.tensors[t].producer) is not None
            and phase[producer] == "forward"
        }
        for producer in _ancestors(graph, needed):
            reruns.append((producer, op.name))
    return tuple(reruns)


def _ancestors(graph: CostGraph, producers: set[str]) -> list[str]:
    """``producers`` and every forward op they need, in execution order."""
    found: set[str] = set()
    pending = list(producers)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        for tensor in graph.op(name).inputs:
            producer = graph.tensors[tensor].producer
            if producer is not None:
                pending.append(producer)
    return sorted((n for n in found if graph.op(n).outputs), key=graph.index.__getitem__)
