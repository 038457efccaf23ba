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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.errors import PlanError
from memfit.data.plan import Plan, Recompute, Swap
from memfit.model.actions import Action
from memfit.model.inlining import (
    action_phase,
    in_place_writes,
    inlined_buffers,
    pinned_and_anchors,
    stored_last_reads,
)
from memfit.model.kernels import fusible
from memfit.model.lifetimes import RETAINED_SAVES
from memfit.model.plan_memo import remembered_profile, remembered_schedule
from memfit.model.recompute import PlannedRerun, planned_reruns, rebuilt_buffer


def copy_buffer(tensor: str, copy: int) -> str:
    """The name of the device buffer that swap-in number ``copy`` of ``tensor`` allocates."""
    return f"{tensor}#in{copy}"


@dataclass(frozen=True)
class Schedule:
    """Actions in program order and the size of every device buffer they touch.

    Args:
        inlined: the buffers the compiler never stores (``memfit.model.inlining``: inductor's
            pointwise values), each with the stored buffers its readers read instead; empty
            for ``aot_eager``, which stores every op's output.
        kernel_starts: per action, the first action of the fused kernel it may run in
            (inductor: ``_fused_spans``); such a kernel allocates what any of its actions
            allocates at its start and frees what it reads last at its end. Empty: every
            action is its own kernel (``aot_eager``).
        in_place: the buffers a kernel writes into the storage of a buffer it reads last
            (``memfit.model.inlining.in_place_writes``), each with that buffer: it allocates
            nothing, and the storage lives until the last reader of either.
    """

    actions: tuple[Action, ...]
    buffer_bytes: Mapping[str, int]
    resident_bytes: int
    outputs: frozenset[str]
    inlined: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    kernel_starts: tuple[int, ...] = ()
    in_place: Mapping[str, str] = field(default_factory=dict)


def check_plan(graph: CostGraph, plan: Plan) -> None:
    """Raise ``PlanError`` unless every decision of ``plan`` can run on ``graph``.

    A swap-in must follow its tensor's producer, precede each consumer it serves, and serve only
    real consumers, each at most once. A swap-in that feeds re-runs (it names a forward reader
    that runs at or before its control op, see ``SwapIn``) must serve at least one re-run of that
    reader, and every re-run of that reader must come after some swap-in naming it.
    """
    rerun_copies = _check_plan(graph, plan)
    if rerun_copies:
        _check_rerun_copies(graph, rerun_copies, planned_reruns(graph, plan))


def _check_plan(graph: CostGraph, plan: Plan) -> RerunCopies:
    """``check_plan`` but the timing of the swap-ins that feed re-runs; returns those swap-ins
    (``lower`` checks their timing against the re-runs it computes anyway)."""
    if plan.graph_hash and plan.graph_hash != graph.structure_hash:
        raise PlanError(
            f"this plan was made for graph {plan.graph_hash}, not {graph.structure_hash}: "
            "plan again for this model and input shape"
        )
    _check_reruns(graph, plan)
    rerun_copies: RerunCopies = {}
    for name, decision in plan.decisions.items():
        if name not in graph.tensors:
            raise PlanError(f"the plan names tensor {name!r}, which is not in the graph")
        if isinstance(decision, Recompute):
            _check_recompute(graph, name)
        if isinstance(decision, Swap):
            _check_swap(graph, name, decision, rerun_copies)
    return rerun_copies


def _check_swap(graph: CostGraph, name: str, decision: Swap, rerun_copies: RerunCopies) -> None:
    """Check one swapped tensor's swap-ins; note in ``rerun_copies`` those that feed re-runs."""
    tensor = graph.tensors[name]
    if tensor.producer is None:
        raise PlanError(f"{name!r} is a graph input (parameter or user input) and cannot be swapped")
    if tensor.is_output:
        raise PlanError(f"{name!r} is returned by the step and lives to its end: swapping it saves nothing")
    produced_at = graph.index[tensor.producer]
    served: set[str] = set()
    for copy, swap_in in enumerate(decision.swap_ins):
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
            if graph.index[consumer] > issued_at:
                if consumer in served:
                    raise PlanError(f"{consumer!r} is served by two swap-ins of {name!r}")
                served.add(consumer)
            elif graph.op(consumer).phase == "forward":  # it stands for its re-runs
                _note_rerun_copy(rerun_copies, consumer, RerunCopy(issued_at, name, copy, swap_in.after))
            else:
                raise PlanError(
                    f"swap-in of {name!r} is issued after {swap_in.after!r}, too late for {consumer!r}"
                )


class RerunCopy(NamedTuple):
    """A swap-in that feeds the re-runs of a forward reader: copy ``copy`` of ``tensor``, issued
    after op ``after`` (at position ``issued_at``)."""

    issued_at: int
    tensor: str
    copy: int
    after: str


RerunCopies = dict[str, list[RerunCopy]]  # forward op -> the copies its re-runs read, in issue order


def _note_rerun_copy(rerun_copies: RerunCopies, op: str, copy: RerunCopy) -> None:
    copies = rerun_copies.setdefault(op, [])
    if any(c.tensor == copy.tensor and c.issued_at == copy.issued_at for c in copies):
        raise PlanError(f"the re-runs of {op!r} are served by two swap-ins of {copy.tensor!r} "
                        f"issued after {copy.after!r}")
    copies.append(copy)
    copies.sort()


def copy_for_rerun(copies: list[RerunCopy], tensor: str, before_at: int) -> RerunCopy | None:
    """The copy of ``tensor`` a re-run placed before position ``before_at`` reads: the latest
    issued before it (``None``: none is)."""
    found = None
    for copy in copies:
        if copy.issued_at >= before_at:
            break
        if copy.tensor == tensor:
            found = copy
    return found


def _check_rerun_copies(graph: CostGraph, rerun_copies: RerunCopies,
                        reruns: dict[str, list[PlannedRerun]]) -> None:
    """Every re-run of an op whose re-runs are fed by swap-ins comes after one of each tensor;
    every such swap-in feeds some re-run."""
    fed: set[RerunCopy] = set()
    for before, group in reruns.items():
        before_at = graph.index[before]
        for rerun in group:
            for copy in rerun_copies.get(rerun.op, ()):
                found = copy_for_rerun(rerun_copies[rerun.op], copy.tensor, before_at)
                if found is None:
                    raise PlanError(
                        f"swap-in of {copy.tensor!r} after {copy.after!r} is issued too late for "
                        f"the re-run of {rerun.op!r} before {before!r}: issue it after an op "
                        f"that runs before {before!r}"
                    )
                fed.add(found)
    for op, copies in rerun_copies.items():
        for copy in copies:
            if copy not in fed:
                raise PlanError(
                    f"swap-in of {copy.tensor!r} after {copy.after!r} names {op!r}, which runs "
                    f"before it, but no re-run of {op!r} comes after it: name the ops that read "
                    "this copy, or re-run that op later"
                )


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


def _check_recompute(graph: CostGraph, name: str) -> None:
    tensor = graph.tensors[name]
    if tensor.producer is None:
        raise PlanError(f"{name!r} is a graph input (parameter or user input): nothing to recompute")
    if tensor.is_output:
        raise PlanError(f"{name!r} is returned by the step and lives to its end: keep it")
    if graph.op(tensor.producer).phase != "forward":
        raise PlanError(f"{name!r} is made in the backward pass; only forward tensors are recomputed")


def lower(graph: CostGraph, plan: Plan) -> Schedule:
    """The actions of ``graph`` rewritten by ``plan``, in program order (computed once per plan
    inside ``memfit.model.plan_memo.plans_remembered``).

    A re-run that reads a swapped tensor through a swap-in (see ``SwapIn``) reads the copy's
    buffer, after a wait for that copy; the copy lives until its last reader, re-run or not.

    Raises:
        PlanError: if the plan does not fit the graph (see ``check_plan``).
    """
    return remembered_schedule(graph, plan, lambda: _lowered(graph, plan))


def _lowered(graph: CostGraph, plan: Plan) -> Schedule:
    rerun_copies = _check_plan(graph, plan)
    redirect: dict[str, dict[str, str]] = {}  # consumer op -> {tensor: copy buffer it reads}
    waits_before: dict[str, list[Action]] = {}
    swap_ins_after: dict[str, list[Action]] = {}
    buffer_bytes = dict(tensor_bytes(graph))  # this plan's own: copies and re-runs add buffers
    swapped = {name for name, d in plan.decisions.items() if isinstance(d, Swap)}
    for name, decision in plan.decisions.items():
        if isinstance(decision, Swap):
            _lower_swap(graph, name, decision, redirect, waits_before, swap_ins_after, buffer_bytes)
    reruns = planned_reruns(graph, plan)
    fed = _FedReruns(rerun_copies) if rerun_copies else None
    if rerun_copies:
        _check_rerun_copies(graph, rerun_copies, reruns)
    newest: dict[str, str] = {}  # tensor -> the instance later readers read (re-runs replace)
    actions: list[Action] = []
    instances = 0
    backward_at: int | None = None  # the first backward action's index, once found
    unchanged = _compute_actions(graph)
    for position, op in enumerate(graph.ops):  # the hot loop of every simulation
        if backward_at is None and op.phase == "backward":
            backward_at = len(actions)
        for rerun in reruns.get(op.name, ()):
            actions.extend(_rerun_actions(graph, rerun, instances, newest, buffer_bytes,
                                          fed, position))
            instances += 1
        if op.name in waits_before:
            waits = waits_before[op.name]
            actions.extend(fed.not_waited(waits) if fed else waits)
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
    if RETAINED_SAVES in graph.tensors and backward_at is not None:
        outputs |= _read_across(actions, backward_at)
    if graph.compiler != "inductor":
        return Schedule(tuple(actions), MappingProxyType(buffer_bytes), graph.resident_bytes,
                        outputs)
    pins = pinned_and_anchors(graph, actions, buffer_bytes)
    inlined = inlined_buffers(graph, actions, outputs, pins)
    return Schedule(tuple(actions), MappingProxyType(buffer_bytes), graph.resident_bytes, outputs,
                    MappingProxyType(inlined), _fused_spans(graph, actions, pins),
                    MappingProxyType(in_place_writes(graph, actions, outputs, inlined,
                                                     buffer_bytes)))


def _fused_spans(graph: CostGraph, actions: list[Action],
                 pins: Mapping[int, tuple[int, ...]]) -> tuple[int, ...]:
    """For each action, the index of the first action of the fused kernel it may run in (itself
    where it is its own). Inductor fuses a pinned re-run chain (``pins``: each with its anchors)
    with its anchors, along the ordering dependency ``memfit.lowering.inductor.pin_planned_order``
    gives it, so the chain's values are made while what the anchors' ops read is still held:
    such a kernel runs from the pin's earliest anchor to the end of the chain's run of generated
    kernels (one pass's fusible ops in a row, no library call, copy or wait between them), never
    before that run's start. Any other op is priced as its own kernel."""
    spans = list(range(len(actions)))
    start, phase, first = -1, "", -1  # the run's start, pass, and its earliest fused anchor
    for index in range(len(actions) + 1):  # past the last action, the last run ends
        action = actions[index] if index < len(actions) else None
        made_here, pinned_rerun = "", False  # the pass of a generated kernel's op
        if action is not None and action.kind in ("compute", "recompute") and (
                not action.allocates or fusible(graph.op(action.op))):
            made_here = action_phase(graph, action)
            pinned_rerun = action.kind == "recompute" and index in pins
            if start >= 0 and made_here == phase:
                if pinned_rerun:
                    earliest = max(start, min(pins[index], default=index))
                    first = earliest if first < 0 else min(first, earliest)
                continue
        if first >= 0:
            spans[first:index] = [first] * (index - first)
        start = index if made_here and action is not None and action.allocates else -1
        first = index if start >= 0 and pinned_rerun else -1
        phase = made_here if start >= 0 else ""
    return tuple(spans)


def _read_across(actions: list[Action], backward_at: int) -> frozenset[str]:
    """Buffers allocated by an action before ``backward_at`` and read by one at or after it: the
    saves a backward reads (``memfit.model.lifetimes.with_retained_saves``)."""
    made_before = {buffer for action in actions[:backward_at] for buffer in action.allocates}
    return frozenset(buffer for action in actions[backward_at:] for buffer in action.reads
                     if buffer in made_before)


def tensor_bytes(graph: CostGraph) -> Mapping[str, int]:
    """Tensor -> its bytes, once per graph (shared: its readers must not change it)."""
    return graph.remembered("tensor bytes", lambda: {
        name: t.size_bytes for name, t in graph.tensors.items()})


def _lower_swap(graph: CostGraph, name: str, decision: Swap, redirect: dict[str, dict[str, str]],
                waits_before: dict[str, list[Action]], swap_ins_after: dict[str, list[Action]],
                buffer_bytes: dict[str, int]) -> None:
    """One swapped tensor's swap-ins, the wait before each copy's first consumer, and the
    consumers pointed at the copies (re-runs a copy feeds are pointed by ``_rerun_actions``)."""
    for copy, swap_in in enumerate(decision.swap_ins):
        buffer = copy_buffer(name, copy)
        buffer_bytes[buffer] = graph.tensors[name].size_bytes
        swap_ins_after.setdefault(swap_in.after, []).append(
            Action("swap_in", swap_in.after, name, copy, allocates=(buffer,))
        )
        issued_at = graph.index[swap_in.after]
        readers = [c for c in swap_in.consumers if graph.index[c] > issued_at]
        if not readers:
            continue  # it feeds re-runs only
        first = min(readers, key=graph.index.__getitem__)
        waits_before.setdefault(first, []).append(Action("wait", first, name, copy))
        for consumer in readers:
            redirect.setdefault(consumer, {})[name] = buffer


class _FedReruns:
    """The swap-ins that feed re-runs, and which copies the compute stream has waited for (a
    copy read first by a re-run is waited for there, not again before its first consumer)."""

    def __init__(self, copies: RerunCopies):
        self.copies = copies
        self.waited: set[tuple[str, int]] = set()

    def not_waited(self, waits: list[Action]) -> list[Action]:
        fresh = [w for w in waits if (w.tensor, w.copy) not in self.waited]
        self.waited.update((w.tensor, w.copy) for w in fresh)
        return fresh


def _compute_actions(graph: CostGraph) -> tuple[Action, ...]:
    """Each op's compute action in the unplanned step, built once per graph."""
    return graph.remembered("compute actions", lambda: tuple(
        Action("compute", op.name, reads=op.inputs, allocates=op.outputs) for op in graph.ops))


def _rerun_actions(graph: CostGraph, rerun: PlannedRerun, instance: int, newest: dict[str, str],
                   buffer_bytes: dict[str, int], fed: _FedReruns | None,
                   position: int) -> list[Action]:
    """A re-run reads the newest instance of each input, or the swap-in that feeds it (after a
    wait for that copy), and makes a new instance of its outputs."""
    op = graph.op(rerun.op)
    copies = fed.copies.get(rerun.op) if fed else None
    actions: list[Action] = []
    if fed and copies:
        reads_list = []
        for tensor in op.inputs:
            found = copy_for_rerun(copies, tensor, position)
            if found is None:
                reads_list.append(newest.get(tensor, tensor))
                continue
            reads_list.append(copy_buffer(tensor, found.copy))
            actions.extend(fed.not_waited([Action("wait", rerun.before, tensor, found.copy)]))
        reads = tuple(reads_list)
    else:
        reads = tuple(newest.get(t, t) for t in op.inputs)
    allocates = tuple(rebuilt_buffer(t, instance) for t in op.outputs)
    for tensor, buffer in zip(op.outputs, allocates, strict=True):
        buffer_bytes[buffer] = graph.tensors[tensor].size_bytes
        if tensor in rerun.replaces:
            newest[tensor] = buffer
    actions.append(Action("recompute", rerun.op, copy=instance, reads=reads, allocates=allocates))
    return actions


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
    """Walk the actions with liveness: allocate, note the high-water mark, then free dead buffers
    (once per schedule inside ``memfit.model.plan_memo.plans_remembered``)."""
    return remembered_profile(schedule, lambda: _profiled(schedule))


def _profiled(schedule: Schedule) -> MemoryProfile:
    actions = schedule.actions
    size = dict(schedule.buffer_bytes)  # a plain dict: this runs once per simulated plan
    outputs = schedule.outputs
    last_read = _last_reads(schedule)
    size.update(dict.fromkeys(schedule.inlined, 0))
    size.update(dict.fromkeys(schedule.in_place, 0))
    allocated = [0] * len(actions)  # bytes each action allocates
    freed = [0] * len(actions)  # bytes freed right after each action
    read_last = last_read.get
    if schedule.kernel_starts:
        _by_kernel(schedule, size, read_last, allocated, freed)
    else:
        for index, action in enumerate(actions):  # the hot loop of every simulation
            for buffer in action.allocates:
                buffer_bytes = size[buffer]
                allocated[index] += buffer_bytes
                if buffer not in outputs:
                    end = read_last(buffer, index)
                    freed[end if end > index else index] += buffer_bytes
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


def _by_kernel(schedule: Schedule, size: Mapping[str, int], read_last, allocated: list[int],
               freed: list[int]) -> None:
    """``_profiled``'s allocations and frees where actions share fused kernels: a kernel
    allocates what any of its actions allocates at its first action and frees what it reads
    last after its last."""
    starts, ends = schedule.kernel_starts, _kernel_ends(schedule.kernel_starts)
    for index, action in enumerate(schedule.actions):
        for buffer in action.allocates:
            buffer_bytes = size[buffer]
            allocated[starts[index]] += buffer_bytes
            if buffer not in schedule.outputs:
                end = read_last(buffer, index)
                freed[ends[end if end > index else index]] += buffer_bytes


def _kernel_ends(starts: tuple[int, ...]) -> list[int]:
    """Per action, the last action of its fused kernel (``Schedule.kernel_starts``)."""
    last_of: dict[int, int] = {}
    for index, start in enumerate(starts):
        last_of[start] = index
    return [last_of[start] for start in starts]


def _last_reads(schedule: Schedule) -> dict[str, int]:
    """Each buffer's last reader, an inlined buffer's readers reading what it stands for; a
    buffer written over in place is read until its last value's last reader."""
    last_read = stored_last_reads(schedule.actions, schedule.inlined)
    for written, taken in reversed(list(schedule.in_place.items())):  # later writes first
        last_read[taken] = max(last_read[taken], last_read.get(written, -1))
    return last_read


def live_buffers(schedule: Schedule, index: int) -> list[tuple[str, int]]:
    """``(buffer, bytes)`` live while action ``index`` runs, largest first: what dominates a peak
    (a buffer the compiler never stores is none)."""
    last_read = _last_reads(schedule)
    starts = schedule.kernel_starts
    if starts:
        ends = _kernel_ends(starts)
        last_read = {buffer: ends[at] for buffer, at in last_read.items()}
    allocated_at: dict[str, int] = {}
    for position, action in enumerate(schedule.actions):
        for buffer in action.allocates:
            if buffer not in schedule.inlined and buffer not in schedule.in_place:
                allocated_at[buffer] = starts[position] if starts else position
    live = [
        (buffer, schedule.buffer_bytes[buffer])
        for buffer, start in allocated_at.items()
        if start <= index
        and (buffer in schedule.outputs or max(start, last_read.get(buffer, start)) >= index)
    ]
    return sorted(live, key=lambda item: -item[1])
