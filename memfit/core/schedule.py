"""Lower a Plan to the program-order sequence of actions that the rewritten graph executes.

The simulator and the fx rewriter both consume ``lower(graph, plan)``, so what is predicted and
what is run cannot drift apart. ``memory_profile`` walks the actions with buffer liveness: a
device buffer is allocated by one action and freed right after the last action that reads it.

Note:
    Memory is counted in *program order*, not in device time. The CUDA caching allocator lowers
    ``allocated_bytes`` when a block is freed by the host, even if a copy stream still uses it
    (``record_stream`` only delays reuse), so ``torch.cuda.max_memory_allocated`` follows program
    order; on CPU the executor is synchronous and the two orders coincide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, NamedTuple

import numpy as np

from memfit.core.costgraph import CostGraph
from memfit.core.plan import Plan, Recompute, Swap
from memfit.core.recompute import planned_reruns, rebuilt_buffer

ActionKind = Literal["compute", "swap_out", "swap_in", "wait", "recompute"]


class PlanError(ValueError):
    """A plan that cannot be executed on its graph (a swap-in after its consumer, say)."""


class Action(NamedTuple):
    """One step of the rewritten program.

    A named tuple, not a dataclass: ``lower`` makes tens of thousands per simulated plan, and a
    frozen dataclass costs three times as much to build.

    Args:
        kind: ``"compute"`` runs ``op``; ``"swap_out"`` copies ``tensor`` to the host after its
            producer ``op``; ``"swap_in"`` issues copy number ``copy`` of ``tensor`` after the control
            op ``op``; ``"wait"`` makes the compute stream wait for that copy before ``op``.
        reads: device buffers the action reads.
        allocates: device buffers the action allocates.
    """

    kind: ActionKind
    op: str
    tensor: str = ""
    copy: int = -1
    reads: tuple[str, ...] = ()
    allocates: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "compute":
            return self.op
        if self.kind == "recompute":
            return f"recompute({self.op}#{self.copy})"
        suffix = f"#{self.copy}" if self.copy >= 0 else ""
        return f"{self.kind}({self.tensor}{suffix})"


def copy_buffer(tensor: str, copy: int) -> str:
    """The name of the device buffer that swap-in number ``copy`` of ``tensor`` allocates."""
    return f"{tensor}#in{copy}"


@dataclass(frozen=True)
class Schedule:
    """Actions in program order and the size of every device buffer they touch."""

    actions: tuple[Action, ...]
    buffer_bytes: Mapping[str, int]
    resident_bytes: int
    outputs: frozenset[str]


def check_plan(graph: CostGraph, plan: Plan) -> None:
    """Raise ``PlanError`` unless every decision of ``plan`` can run on ``graph``.

    A swap-in must follow its tensor's producer, precede each consumer it serves, and serve only
    real consumers, each at most once.
    """
    if plan.graph_hash and plan.graph_hash != graph.structure_hash:
        raise PlanError(
            f"this plan was made for graph {plan.graph_hash}, not {graph.structure_hash}: "
            "plan again for this model and input shape"
        )
    _check_reruns(graph, plan)
    for name, decision in plan.decisions.items():
        if name not in graph.tensors:
            raise PlanError(f"the plan names tensor {name!r}, which is not in the graph")
        if isinstance(decision, Recompute):
            _check_recompute(graph, plan, name)
        if not isinstance(decision, Swap):
            continue
        tensor = graph.tensors[name]
        if tensor.producer is None:
            raise PlanError(f"{name!r} is a graph input (parameter or user input) and cannot be swapped")
        if tensor.is_output:
            raise PlanError(f"{name!r} is returned by the step and lives to its end: swapping it saves nothing")
        produced_at = graph.index[tensor.producer]
        served: set[str] = set()
        for swap_in in decision.swap_ins:
            if swap_in.after not in graph.index:
                raise PlanError(f"swap-in of {name!r} names unknown control op {swap_in.after!r}")
            issued_at = graph.index[swap_in.after]
            if not swap_in.consumers:
                raise PlanError(
                    f"swap-in of {name!r} after {swap_in.after!r} serves no consumer: "
                    "name the ops that read this copy, or drop the SwapIn"
                )
            if issued_at < produced_at:
                raise PlanError(f"swap-in of {name!r} after {swap_in.after!r} precedes its producer")
            for consumer in swap_in.consumers:
                if consumer not in tensor.consumers:
                    raise PlanError(f"{consumer!r} does not read {name!r}")
                if consumer in served:
                    raise PlanError(f"{consumer!r} is served by two swap-ins of {name!r}")
                if graph.index[consumer] <= issued_at:
                    raise PlanError(
                        f"swap-in of {name!r} is issued after {swap_in.after!r}, too late for {consumer!r}"
                    )
                served.add(consumer)


def _check_reruns(graph: CostGraph, plan: Plan) -> None:
    for rerun in plan.reruns:
        for name in (rerun.op, rerun.before):
            if name not in graph.index:
                raise PlanError(f"a re-run names unknown op {name!r}")
        op = graph.op(rerun.op)
        if op.phase != "forward" or not op.outputs:
            raise PlanError(f"only forward ops that allocate can be re-run, not {rerun.op!r}")
        if graph.index[rerun.before] <= graph.index[rerun.op]:
            raise PlanError(f"re-run of {rerun.op!r} before {rerun.before!r}, which runs earlier")
        if any(isinstance(plan.decision(t), Swap) for t in op.inputs):
            raise PlanError(f"re-running {rerun.op!r} reads a swapped tensor: not supported yet")


def _check_recompute(graph: CostGraph, plan: Plan, name: str) -> None:
    tensor = graph.tensors[name]
    if tensor.producer is None:
        raise PlanError(f"{name!r} is a graph input (parameter or user input): nothing to recompute")
    if tensor.is_output:
        raise PlanError(f"{name!r} is returned by the step and lives to its end: keep it")
    if graph.op(tensor.producer).phase != "forward":
        raise PlanError(f"{name!r} is made in the backward pass; only forward tensors are recomputed")
    for source in graph.op(tensor.producer).inputs:
        if isinstance(plan.decision(source), Swap):
            raise PlanError(
                f"recomputing {name!r} reads {source!r}, which the plan swaps: swapping a "
                "recompute source is not supported yet; keep or recompute the source"
            )


def lower(graph: CostGraph, plan: Plan) -> Schedule:
    """The actions of ``graph`` rewritten by ``plan``, in program order.

    Raises:
        PlanError: if the plan does not fit the graph (see ``check_plan``).
    """
    check_plan(graph, plan)
    redirect: dict[str, dict[str, str]] = {}  # consumer op -> {tensor: copy buffer it reads}
    waits_before: dict[str, list[Action]] = {}
    swap_ins_after: dict[str, list[Action]] = {}
    buffer_bytes = {name: t.size_bytes for name, t in graph.tensors.items()}
    swapped = {name for name, d in plan.decisions.items() if isinstance(d, Swap)}
    for name, decision in plan.decisions.items():
        if not isinstance(decision, Swap):
            continue
        for copy, swap_in in enumerate(decision.swap_ins):
            buffer = copy_buffer(name, copy)
            buffer_bytes[buffer] = graph.tensors[name].size_bytes
            swap_ins_after.setdefault(swap_in.after, []).append(
                Action("swap_in", swap_in.after, name, copy, allocates=(buffer,))
            )
            first = min(swap_in.consumers, key=graph.index.__getitem__)
            waits_before.setdefault(first, []).append(Action("wait", first, name, copy))
            for consumer in swap_in.consumers:
                redirect.setdefault(consumer, {})[name] = buffer
    reruns = planned_reruns(graph, plan)
    newest: dict[str, str] = {}  # tensor -> the instance later readers read (re-runs replace)
    actions: list[Action] = []
    instances = 0
    unchanged = _compute_actions(graph)
    for position, op in enumerate(graph.ops):  # the hot loop of every simulation
        for rerun in reruns.get(op.name, ()):
            actions.append(_rerun_action(graph, rerun, instances, newest, buffer_bytes))
            instances += 1
        if op.name in waits_before:
            actions.extend(waits_before[op.name])
        renamed = redirect.get(op.name)
        if newest and not newest.keys().isdisjoint(op.inputs):
            renamed = {**{t: newest[t] for t in op.inputs if t in newest}, **(renamed or {})}
        if renamed:
            reads = tuple(renamed.get(t, t) for t in op.inputs)
            actions.append(Action("compute", op.name, reads=reads, allocates=op.outputs))
        else:  # most ops of most plans: the action the unplanned step has
            actions.append(unchanged[position])
        if swapped:
            for tensor in op.outputs:
                if tensor in swapped:
                    actions.append(Action("swap_out", op.name, tensor, reads=(tensor,)))
        if op.name in swap_ins_after:
            actions.extend(swap_ins_after[op.name])
    outputs = frozenset(name for name, t in graph.tensors.items() if t.is_output)
    return Schedule(tuple(actions), MappingProxyType(buffer_bytes), graph.resident_bytes, outputs)


def _compute_actions(graph: CostGraph) -> tuple[Action, ...]:
    """Each op's compute action in the unplanned step, built once per graph."""
    return graph.remembered("compute actions", lambda: tuple(
        Action("compute", op.name, reads=op.inputs, allocates=op.outputs) for op in graph.ops))


def _rerun_action(graph: CostGraph, rerun, instance: int, newest: dict[str, str],
                  buffer_bytes: dict[str, int]) -> Action:
    """A re-run reads the newest instance of each input and makes a new one of its outputs."""
    op = graph.op(rerun.op)
    reads = tuple(newest.get(t, t) for t in op.inputs)
    allocates = tuple(rebuilt_buffer(t, instance) for t in op.outputs)
    for tensor, buffer in zip(op.outputs, allocates, strict=True):
        buffer_bytes[buffer] = graph.tensors[tensor].size_bytes
        if tensor in rerun.replaces:
            newest[tensor] = buffer
    return Action("recompute", rerun.op, copy=instance, reads=reads, allocates=allocates)


@dataclass(frozen=True)
class MemoryProfile:
    """Live device bytes over the program.

    Args:
        live_bytes: live bytes right after each action (dead buffers already freed).
        high_bytes: live bytes while each action runs (its allocations made, nothing freed yet).
        peak_bytes: the maximum of ``high_bytes`` (and of the resident bytes).
        peak_index: the action at which the peak happens.
    """

    live_bytes: tuple[int, ...]
    high_bytes: tuple[int, ...]
    peak_bytes: int
    peak_index: int


def memory_profile(schedule: Schedule) -> MemoryProfile:
    """Walk the actions with liveness: allocate, note the high-water mark, then free dead buffers."""
    actions = schedule.actions
    size = dict(schedule.buffer_bytes)  # a plain dict: this runs once per simulated plan
    outputs = schedule.outputs
    last_read: dict[str, int] = {}
    for index, action in enumerate(actions):
        for buffer in action.reads:
            last_read[buffer] = index
    allocated = [0] * len(actions)  # bytes each action allocates
    freed = [0] * len(actions)  # bytes freed right after each action
    for index, action in enumerate(actions):
        for buffer in action.allocates:
            allocated[index] += size[buffer]
            if buffer not in outputs:
                freed[max(index, last_read.get(buffer, index))] += size[buffer]
    freed_after = np.asarray(freed, dtype=np.int64)
    live = schedule.resident_bytes + np.cumsum(np.asarray(allocated, dtype=np.int64) - freed_after)
    high = live + freed_after
    peak_index = int(np.argmax(high)) if len(high) else -1
    if peak_index < 0 or high[peak_index] <= schedule.resident_bytes:
        peak_index = -1
    peak = int(high[peak_index]) if peak_index >= 0 else schedule.resident_bytes
    return MemoryProfile(tuple(live.tolist()), tuple(high.tolist()), peak, peak_index)


def peak_bytes(graph: CostGraph, plan: Plan) -> int:
    """The device peak of ``graph`` run under ``plan`` (program-order liveness)."""
    return memory_profile(lower(graph, plan)).peak_bytes


def live_buffers(schedule: Schedule, index: int) -> list[tuple[str, int]]:
    """``(buffer, bytes)`` live while action ``index`` runs, largest first: what dominates a peak."""
    last_read: dict[str, int] = {}
    allocated_at: dict[str, int] = {}
    for position, action in enumerate(schedule.actions):
        for buffer in action.reads:
            last_read[buffer] = position
        for buffer in action.allocates:
            allocated_at[buffer] = position
    live = [
        (buffer, schedule.buffer_bytes[buffer])
        for buffer, start in allocated_at.items()
        if start <= index
        and (buffer in schedule.outputs or max(start, last_read.get(buffer, start)) >= index)
    ]
    return sorted(live, key=lambda item: -item[1])
