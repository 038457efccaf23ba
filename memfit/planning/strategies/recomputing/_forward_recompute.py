"""Recomputation in the forward pass: free a value across a forward peak and re-run it after.

Backward-only recomputation cannot help a branchy graph whose peak is in the forward pass: a
U-Net skip connection, or a value read by an early and a late branch, is live across the middle
of the forward pass because a *forward* op reads it again. The article's last extension is to
forget such a value after its early readers and compute it again right before its late one. A
``Rerun(op, before)`` whose ``before`` is a forward op does exactly that (see
``memfit.model.recompute``): later readers read the new instance, and the original dies after its
last reader before the re-run. So forward recomputation is a choice of such re-runs.

Note:
    The search is greedy and checked by simulation: while the peak is above the budget and in
    the forward pass, re-run the value live across the peak that frees the most bytes per second
    of re-run time, together with the producers of its inputs that would otherwise have to be
    kept alive for it (a *segment*, at most ``TUNING.forward_segment_max_ops`` ops). A move is
    taken only if it lowers the peak (or the number of actions at it), so the result never has
    a higher peak.
    A move that only shrank a plateau may turn out unneeded once the peak is lower, so at the
    end each added re-run is dropped again if the peak stays as low without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from memfit.data.costgraph import CostGraph, Op
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Rerun
from memfit.model.schedule import (
    MemoryProfile,
    PlanError,
    Schedule,
    live_buffers,
    lower,
    memory_profile,
)
from memfit.planning.tuning import TUNING


@dataclass(frozen=True)
class _State:
    """A plan with its program and memory profile: what each move is judged on."""

    plan: Plan
    schedule: Schedule
    profile: MemoryProfile

    @property
    def score(self) -> tuple[int, int]:
        """Lower is better: the peak, then how many actions reach it (a plateau shrinks)."""
        peak = self.profile.peak_bytes
        return peak, sum(1 for high in self.profile.high_bytes if high == peak)


def recompute_in_forward(graph: CostGraph, plan: Plan, hardware: Hardware,
                         budget_bytes: int | None) -> Plan:
    """``plan`` plus forward re-runs that lower a peak sitting in the forward pass.

    Args:
        graph: the step.
        plan: a plan to extend (a checkpoint plan, say); its decisions and re-runs are kept.
        hardware: the profile the plan is for; op times come from ``graph``.
        budget_bytes: stop as soon as the peak fits; ``None``: lower the peak as far as forward
            re-runs go.

    Returns:
        ``plan`` unchanged when its peak fits, is not in the forward pass or no re-run lowers it;
        else a plan with the same decisions and more re-runs, whose peak is lower (maybe still
        above the budget: the caller checks).

    Raises:
        PlanError: if ``plan`` itself does not fit ``graph``.

    Example:
        >>> made = recompute_in_forward(graph, checkpoint_plan, get_hardware("cpu"), 2 << 20)
        >>> [(r.op, r.before) for r in made.reruns]   # doctest: +SKIP
        [('side1', 'late1'), ...]
    """
    del hardware  # the signature of a strategy step; times are the graph's
    schedule = lower(graph, plan)
    state = _State(plan, schedule, memory_profile(schedule))
    for _ in range(TUNING.forward_max_moves):
        if budget_bytes is not None and state.profile.peak_bytes <= budget_bytes:
            break
        if _peak_phase(graph, state) != "forward":
            break
        moved = _best_move(graph, state)
        if moved is None:
            break
        state = moved
    if state.plan is plan:
        return plan
    return _pruned(graph, state.plan, keep=set(plan.reruns))


def _pruned(graph: CostGraph, plan: Plan, keep: set[Rerun]) -> Plan:
    """``plan`` without the added re-runs its peak does not need (latest first)."""
    target_bytes = memory_profile(lower(graph, plan)).peak_bytes
    reruns = list(plan.reruns)
    for rerun in reversed(plan.reruns):
        if rerun in keep:
            continue
        fewer = [r for r in reruns if r != rerun]
        tried = _state(graph, replace(plan, reruns=tuple(fewer)))
        if tried is not None and tried.profile.peak_bytes <= target_bytes:
            reruns = fewer
    return replace(plan, reruns=tuple(reruns))


def _state(graph: CostGraph, plan: Plan) -> _State | None:
    try:
        schedule = lower(graph, plan)
    except PlanError:
        return None
    return _State(plan, schedule, memory_profile(schedule))


def _peak_phase(graph: CostGraph, state: _State) -> str:
    """The phase of the op whose slot holds the peak (a re-run sits in the slot of its ``before``)."""
    actions = state.schedule.actions
    for action in actions[max(state.profile.peak_index, 0):]:
        if action.kind == "compute":
            return graph.op(action.op).phase
    return "update"


def _best_move(graph: CostGraph, state: _State) -> _State | None:
    """The first candidate, best bytes per second first, whose re-runs improve the score."""
    ranked = sorted(_moves(graph, state), key=lambda move: -move[0])
    for _, reruns in ranked[:TUNING.forward_tries_per_move]:
        merged = _merged(graph, state.plan.reruns, reruns)
        tried = _state(graph, replace(state.plan, reruns=merged))
        if tried is not None and tried.score < state.score:
            return tried
    return None


def _merged(graph: CostGraph, old: tuple[Rerun, ...], new: list[Rerun]) -> tuple[Rerun, ...]:
    """Re-runs in program order: by the op they precede, then producers before their readers."""
    index = graph.index
    return tuple(sorted((*old, *new), key=lambda r: (index[r.before], index[r.op])))


@dataclass(frozen=True)
class _Instances:
    """Which tensor each device buffer holds, where each is allocated and read."""

    tensor: dict[str, str]
    read_at: dict[str, list[int]]
    allocations: dict[str, list[tuple[int, str]]]  # tensor -> (position, buffer), in order

    @staticmethod
    def of(graph: CostGraph, schedule: Schedule) -> _Instances:
        tensor: dict[str, str] = {}
        read_at: dict[str, list[int]] = {}
        allocations: dict[str, list[tuple[int, str]]] = {}
        for position, action in enumerate(schedule.actions):
            for buffer in action.reads:
                read_at.setdefault(buffer, []).append(position)
            if action.kind in ("compute", "recompute"):
                outputs = graph.op(action.op).outputs
                for name, buffer in zip(outputs, action.allocates, strict=True):
                    tensor[buffer] = name
                    allocations.setdefault(name, []).append((position, buffer))
        return _Instances(tensor, read_at, allocations)

    def newest(self, name: str, position: int) -> str | None:
        """The last buffer holding ``name`` allocated before ``position`` (what a re-run reads)."""
        found = [buffer for at, buffer in self.allocations.get(name, ()) if at < position]
        return found[-1] if found else None


def _moves(graph: CostGraph, state: _State) -> Iterator[tuple[float, list[Rerun]]]:
    """(bytes freed at the peak per second of re-run, re-runs) for each value live across it.

    A value qualifies when it is read before the peak and again by a forward op after it, but
    not by the action at the peak; it is re-run right before that later reader.
    """
    peak = state.profile.peak_index
    actions = state.schedule.actions
    instances = _Instances.of(graph, state.schedule)
    for buffer, size_bytes in live_buffers(state.schedule, peak):
        name = instances.tensor.get(buffer)
        if name is None or not _rerunnable(graph, graph.tensors[name].producer):
            continue
        later = [at for at in instances.read_at.get(buffer, ()) if at >= peak]
        if not later or later[0] == peak or actions[later[0]].kind != "compute":
            continue
        before = actions[later[0]].op
        if graph.op(before).phase != "forward":
            continue  # a backward reader: backward recomputation's business
        producer = graph.tensors[name].producer
        assert producer is not None
        for ops in _variants(graph, producer, later[0], instances):
            time_s = sum(graph.op(op).time_s for op in ops)
            yield size_bytes / max(time_s, 1e-12), [Rerun(op, before) for op in ops]


def _variants(graph: CostGraph, producer: str, position: int,
              instances: _Instances) -> list[list[str]]:
    """The producer alone, and the producer with the ops that rebuild its dead inputs."""
    segment = _segment(graph, producer, position, instances)
    return [segment] if segment == [producer] else [segment, [producer]]


def _segment(graph: CostGraph, producer: str, position: int, instances: _Instances) -> list[str]:
    """``producer`` and, up to ``TUNING.forward_segment_max_ops`` ops, the producers of inputs
    dead by ``position``.

    An input is alive anyway when it is resident, returned by the step, or its newest buffer is
    read at or after ``position``; re-running from such inputs costs no memory for them.
    """
    chosen: set[str] = set()
    pending = [producer]
    while pending and len(chosen) < TUNING.forward_segment_max_ops:
        name = pending.pop()
        if name in chosen:
            continue
        chosen.add(name)
        for source in graph.op(name).inputs:
            tensor = graph.tensors[source]
            if tensor.producer is None or tensor.is_output:
                continue
            buffer = instances.newest(source, position)
            if buffer is not None and max(instances.read_at.get(buffer, [-1])) >= position:
                continue
            if _rerunnable(graph, tensor.producer):
                pending.append(tensor.producer)
    return sorted(chosen, key=graph.index.__getitem__)


def _rerunnable(graph: CostGraph, name: str | None) -> bool:
    """A forward op that allocates, writes nothing the step returns and mutates nothing.

    Buffer updates (BatchNorm's running statistics) are functionalized into step outputs, so
    an op that returns one is never re-run; an in-place kind (``aten.add_``) is excluded too.
    """
    if name is None:
        return False
    op: Op = graph.op(name)
    return (
        op.phase == "forward"
        and bool(op.outputs)
        and not op.kind.endswith("_")
        and not any(graph.tensors[t].is_output for t in op.outputs)
    )
