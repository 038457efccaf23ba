"""The memory profile of a recomputation plan, fast: ``memory_profile(lower(graph, plan))`` as a
change to the Keep plan's profile that touches only the buffers the plan changes.

Why: the segment planner (``memfit.planning.solvers.segments``) prices hundreds of candidate segments,
each a plan that recomputes a few dozen tensors of a thousand-op step. Lowering the whole program
for each costs about 10 ms in Python; this walks only the recomputed tensors, their re-runs and
their readers, and adds the result to the Keep profile with numpy. It follows ``lower`` and
``memory_profile`` rule for rule (program order, newest instance read, freed after the last
reader), and a test holds the two equal on synthetic and captured graphs.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.plan import Plan
from memfit.model.profile import BaseProfile
from memfit.model.recompute import PlannedRerun, decided_reruns, first_late_readers, rerun_deadlines
from memfit.model.schedule import lower, memory_profile


@dataclass(frozen=True)
class RerunProfile:
    """Device bytes of one recomputation plan, per op of the original graph.

    Args:
        high_bytes: for op ``i``, the most bytes live while it runs or while a re-run placed
            right before it runs (``MemoryProfile.high_bytes`` folded onto the graph's ops).
        live_bytes: bytes live right after op ``i`` (its dead buffers freed).
        recompute_s: the run time of every re-run.
        reruns: how many re-runs the plan makes.
    """

    high_bytes: np.ndarray
    live_bytes: np.ndarray
    recompute_s: float
    reruns: int

    @property
    def peak_bytes(self) -> int:
        return int(self.high_bytes.max(initial=0))


class RerunProfiler:
    """Prices recomputation plans on one graph against a base plan's profile (computed once).

    Args:
        base: the plan the recomputation is added to: Keep (default) or a swap plan. Its swaps
            stay as they are; the tensors a priced plan recomputes, and those its re-runs read,
            must not be swapped by it (memfit does not recompute from a swapped value).

    Raises:
        ValueError: if ``base`` has re-runs or recomputes.
    """

    def __init__(self, graph: CostGraph, base: Plan | None = None) -> None:
        base = base or Plan("keep")
        if base.reruns or base.recomputed:
            raise ValueError("the base plan of a RerunProfiler may swap, not recompute")
        self.graph = graph
        self.base = base
        self.swapped = frozenset(base.swapped)
        self.resident_bytes = graph.resident_bytes
        self._base_high, self._base_live, self._group_of, self._compute = _base_actions(graph, base)
        self._group_start = np.searchsorted(self._group_of, np.arange(len(graph.ops)))
        self._group_end = np.append(self._group_start[1:], len(self._group_of)) - 1
        self.keep_high = np.maximum.reduceat(self._base_high, self._group_start)
        self.keep_live = self._base_live[self._group_end]
        self._live_before = np.concatenate(([self.resident_bytes], self._base_live))[self._group_start]
        index = graph.index
        self._readers = {
            name: sorted(index[c] for c in t.consumers) for name, t in graph.tensors.items()
        }
        self._produced_at = {
            name: index[t.producer] for name, t in graph.tensors.items() if t.producer is not None
        }
        self._first_late_reader = first_late_readers(graph)
        self._freed_bytes = {  # the tensors the liveness walk frees: made here, not returned
            name: t.size_bytes for name, t in graph.tensors.items()
            if t.producer is not None and not t.is_output
        }

    def profile(self, recomputed: Iterable[str]) -> RerunProfile:
        """The profile of the base plan plus ``Recompute()`` for every tensor of ``recomputed``."""
        graph = self.graph
        recomputed = set(recomputed)
        grouped = self._grouped(recomputed)
        if self.swapped:
            self._check_unswapped(recomputed, grouped)
        count = np.zeros(len(graph.ops), dtype=np.int64)
        for before, reruns in grouped.items():
            count[graph.index[before]] = len(reruns)
        offset = np.cumsum(count)  # re-runs placed before or in each op's group
        group_start = self._group_start + offset - count  # its re-runs come first
        changes = self._changes(grouped, (self._compute + offset).tolist(), group_start)
        length = len(self._base_high) + int(offset[-1])
        high = self._spread(count, offset, length) + _high_delta(changes, length)
        folded = np.maximum.reduceat(high, group_start)
        live = self.keep_live + _live_delta(changes, self._group_end + offset, length)
        return RerunProfile(folded, live, self._time_s(grouped), int(count.sum()))

    def delta(self, recomputed: Iterable[str]) -> RerunDelta:
        """What recomputing ``recomputed`` adds to the base plan's per-op high bytes, kept sparse:
        ``profile(recomputed).high_bytes - keep_high``, read at the ops asked for.

        Why: the separator-block DP prices every segment, a plan that changes the lifetimes of
        one segment's tensors only. ``profile`` spreads each over every op of the step (numpy
        passes over the whole program, and a list of every op's position), so the table's cost
        grew with the segments times the step's length; this walks the same re-runs and keeps
        the changed lifetimes as breakpoints, with positions found by bisection.
        """
        graph = self.graph
        recomputed = set(recomputed)
        grouped = self._grouped(recomputed)
        if self.swapped:
            self._check_unswapped(recomputed, grouped)
        shifts = _Shifts(sorted((graph.index[b], len(r)) for b, r in grouped.items()))
        changes = self._changes(grouped, _Shifted(self._compute, shifts),
                                _GroupStarts(self._group_start, shifts))
        return RerunDelta(self, shifts, changes, self._time_s(grouped))

    def _changes(self, grouped: dict[str, list[PlannedRerun]], compute_at: Sequence[int] | _Shifted,
                 group_start: np.ndarray | _Shifted) -> list[tuple[int, int, int]]:
        """The changed lifetimes (``_RerunWalk.changes``), given each op's compute action and
        the first action of its group (its re-runs first) in the new program."""
        index = self.graph.index
        walk = _RerunWalk(self, compute_at)
        for before in sorted(grouped, key=index.__getitem__):
            first = int(group_start[index[before]])
            for slot, rerun in enumerate(grouped[before]):
                walk.rerun(rerun, index[before], first + slot)
        return walk.changes()

    def recompute_s(self, recomputed: Iterable[str]) -> float:
        """The run time of the re-runs recomputing ``recomputed`` implies: ``profile``'s
        ``recompute_s`` (to rounding: summed in another order) without walking lifetimes, a
        fifth of its cost on a 48-layer GPT-2. For bounds that skip plans not worth pricing."""
        op = self.graph.op
        deadline = rerun_deadlines(self.graph, set(recomputed), self._first_late_reader)
        return sum(op(producer).time_s for producer in deadline)

    def _grouped(self, recomputed: set[str]) -> dict[str, list[PlannedRerun]]:
        grouped: dict[str, list[PlannedRerun]] = {}
        for rerun in decided_reruns(self.graph, recomputed, self._first_late_reader):
            grouped.setdefault(rerun.before, []).append(rerun)
        return grouped

    def _time_s(self, grouped: dict[str, list[PlannedRerun]]) -> float:
        op = self.graph.op
        return sum(op(r.op).time_s for reruns in grouped.values() for r in reruns)

    def _check_unswapped(self, recomputed: set[str], grouped: dict[str, list[PlannedRerun]]) -> None:
        read = {t for reruns in grouped.values() for r in reruns for t in self.graph.op(r.op).inputs}
        clash = (recomputed | read) & self.swapped
        if clash:
            raise ValueError(f"recomputing reads or drops swapped tensors {sorted(clash)[:4]}")

    def _spread(self, count: np.ndarray, offset: np.ndarray, length: int) -> np.ndarray:
        """The base profile spread over the new program: re-run slots hold the live bytes after
        the action before them."""
        spread = np.empty(length, dtype=np.int64)
        slots = np.repeat(self._group_start + offset - count, count) + _ranks(count)
        spread[slots] = np.repeat(self._live_before, count)
        spread[np.arange(len(self._base_high)) + offset[self._group_of]] = self._base_high
        return spread


def _base_actions(graph: CostGraph, base: Plan) -> tuple[np.ndarray, ...]:
    """The base plan's high and live bytes per action, each action's op (``_groups``) and the
    compute actions' indices. The Keep plan's come from ``BaseProfile`` (one compute action per
    op), so its lowering is shared with the other callers of the memory model, not redone."""
    if not base.decisions:
        keep = BaseProfile.of(graph)
        ops = np.arange(len(graph.ops), dtype=np.int64)
        return keep.high_bytes, keep.live_after, ops, ops
    schedule = lower(graph, base)
    profile = memory_profile(schedule)
    compute = [i for i, a in enumerate(schedule.actions) if a.kind == "compute"]
    return (np.asarray(profile.high_bytes, dtype=np.int64),
            np.asarray(profile.live_bytes, dtype=np.int64),
            _groups(graph, schedule.actions), np.asarray(compute, dtype=np.int64))


def _groups(graph: CostGraph, actions) -> np.ndarray:
    """The op each action belongs to: waits to the op they precede, copies to the op they
    follow, so each op's actions are contiguous (``lower`` emits them that way)."""
    index = graph.index
    return np.asarray([index[a.op] for a in actions], dtype=np.int64)


def _ranks(count: np.ndarray) -> np.ndarray:
    """0, 1, ..., c-1 for each count c, concatenated."""
    total = int(count.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(count) - count, count)
    return np.arange(total, dtype=np.int64) - starts


class _RerunWalk:
    """Buffer lifetimes that a plan changes, in the new program's action indices."""

    def __init__(self, profiler: RerunProfiler, compute_at: Sequence[int] | _Shifted) -> None:
        self.profiler = profiler
        self.compute_at = compute_at
        self.newest: dict[str, str] = {}
        # tensor -> (op index, instance): decided re-runs rebuild each tensor once
        self.replaced: dict[str, tuple[int, str]] = {}
        self.rerun_reads: dict[str, int] = {}  # buffer -> last re-run reading it
        self.allocated: dict[str, tuple[int, int]] = {}  # instance -> (action, bytes)

    def rerun(self, rerun: PlannedRerun, before_index: int, action: int) -> None:
        """Note re-run ``rerun`` at ``action``; re-runs come in program order, so each read
        is the latest so far."""
        graph = self.profiler.graph
        op = graph.op(rerun.op)
        newest, rerun_reads = self.newest, self.rerun_reads
        for tensor in op.inputs:
            rerun_reads[newest.get(tensor, tensor)] = action
        for tensor in op.outputs:
            instance = f"{tensor}#{action}"
            self.allocated[instance] = (action, graph.tensors[tensor].size_bytes)
            if tensor in rerun.replaces:
                newest[tensor] = instance
                self.replaced[tensor] = (before_index, instance)

    def changes(self) -> list[tuple[int, int, int]]:
        """(first action, last action, signed bytes) of every changed lifetime."""
        readers_of, produced_at = self.profiler._readers, self.profiler._produced_at
        freed_bytes = self.profiler._freed_bytes
        changed = {*self.replaced, *(b for b in self.rerun_reads if b in freed_bytes)}
        compute_at = self._positions(changed)
        last_read = dict(self.rerun_reads)
        bisect_left = bisect.bisect_left
        for tensor, (before_index, instance) in self.replaced.items():
            readers = readers_of[tensor]
            first = bisect_left(readers, before_index)  # readers from the re-run on read it
            if first < len(readers):
                last_read[instance] = max(compute_at[readers[-1]], last_read.get(instance, -1))
            if first:  # readers before the re-run read the original
                last_read[tensor] = max(compute_at[readers[first - 1]], last_read.get(tensor, -1))
        changes: list[tuple[int, int, int]] = []
        for tensor in changed:
            size_bytes = freed_bytes.get(tensor)
            if size_bytes is None:
                continue  # step outputs and resident tensors are never freed
            start = compute_at[produced_at[tensor]]
            readers = readers_of[tensor]
            old_end = max(start, compute_at[readers[-1]]) if readers else start
            if tensor in self.replaced:
                new_end = max(start, last_read.get(tensor, start))
            else:  # only re-runs read it again, later
                new_end = max(start, last_read[tensor], old_end)
            if new_end != old_end:
                changes.append((start, old_end, -size_bytes))
                changes.append((start, new_end, size_bytes))
        changes.extend((action, max(action, last_read.get(instance, action)), size_bytes)
                       for instance, (action, size_bytes) in self.allocated.items())
        return changes


    def _positions(self, changed: set[str]) -> Sequence[int] | dict[int, int]:
        """Where the ops ``changes`` looks up compute, in the new program: the per-op list
        when given one; else the positions of just those ops, mapped at once in numpy (a
        bisection per lookup cost more than the whole walk)."""
        if not isinstance(self.compute_at, _Shifted):
            return self.compute_at
        readers_of, produced_at = self.profiler._readers, self.profiler._produced_at
        wanted: list[int] = []
        for tensor in self.replaced:
            wanted.extend(readers_of[tensor])
        for tensor in changed:
            if tensor in produced_at:
                wanted.append(produced_at[tensor])
                wanted.extend(readers_of[tensor][-1:])
        return self.compute_at.many(wanted)


def _high_delta(changes: list[tuple[int, int, int]], length: int) -> np.ndarray:
    """Bytes to add to the Keep profile while each action of the new program runs."""
    difference = np.zeros(length + 1, dtype=np.int64)
    if changes:
        start, end, size = np.asarray(changes, dtype=np.int64).T
        np.add.at(difference, start, size)  # live while action a runs: start <= a <= end
        np.add.at(difference, end + 1, -size)
    return np.cumsum(difference[:-1])


def _live_delta(changes: list[tuple[int, int, int]], after: np.ndarray, length: int) -> np.ndarray:
    """Bytes to add to the base's live bytes right after each op's last action (``after``)."""
    difference = np.zeros(length + 1, dtype=np.int64)
    if changes:
        start, end, size = np.asarray(changes, dtype=np.int64).T
        np.add.at(difference, start, size)  # live after action a: start <= a < end
        np.add.at(difference, end, -size)
    return np.cumsum(difference[:-1])[after]


class _Shifts:
    """Where a plan's re-runs go: how far each op's actions move in the new program, found by
    bisection over the few ops that get re-runs (not an array over every op)."""

    def __init__(self, counted: list[tuple[int, int]]) -> None:
        self.ops = [op for op, _ in counted]  # ops with re-runs before them, in order
        self.counts = [count for _, count in counted]
        self.through = [0, *itertools.accumulate(self.counts)]  # re-runs before ops[t]: through[t]
        self.total = self.through[-1]

    def offset(self, op: int) -> int:
        """Re-runs placed before or in ``op``'s group."""
        return self.through[bisect.bisect_right(self.ops, op)]

    def count(self, op: int) -> int:
        """Re-runs placed right before ``op``."""
        at = bisect.bisect_left(self.ops, op)
        return self.counts[at] if at < len(self.ops) and self.ops[at] == op else 0


class _Shifted:
    """A per-op base position moved by the re-runs placed before or at the op:
    ``base[i] + offset(i)``, looked up one at a time or many at once."""

    def __init__(self, base: np.ndarray, shifts: _Shifts) -> None:
        self.base, self.shifts = base, shifts
        self._ops = np.asarray(shifts.ops, dtype=np.int64)
        self._through = np.asarray(shifts.through, dtype=np.int64)

    def __getitem__(self, op: int) -> int:
        return int(self.base[op]) + self.shifts.offset(op)

    def many(self, ops: list[int]) -> dict[int, int]:
        """Op -> its position, for every op of ``ops``."""
        at = np.asarray(ops, dtype=np.int64)
        moved = self.base[at] + self._through[np.searchsorted(self._ops, at, "right")]
        return dict(zip(ops, moved.tolist(), strict=True))


class _GroupStarts(_Shifted):
    """The first action of an op's group in the new program: its re-runs come first."""

    def __getitem__(self, op: int) -> int:
        return super().__getitem__(op) - self.shifts.count(op)


class RerunDelta:
    """``RerunProfiler.delta``: a plan's change to the base's per-op high bytes, read per op.

    The change while action ``k`` of the new program runs is a step function of ``k`` (each
    changed lifetime adds its bytes from its first to its last action), so it is kept as its
    breakpoints. An op's folded high bytes are its base high bytes plus that step where the
    step is flat over its actions and it gets no re-runs; the few other ops ("touched") are
    folded exactly, as ``RerunProfiler.profile`` folds them.
    """

    def __init__(self, profiler: RerunProfiler, shifts: _Shifts,
                 changes: list[tuple[int, int, int]], recompute_s: float) -> None:
        self.profiler = profiler
        self.recompute_s, self.reruns = recompute_s, shifts.total
        self._rerun_ops = np.asarray(shifts.ops, dtype=np.int64)
        self._rerun_counts = np.asarray(shifts.counts, dtype=np.int64)
        self._through = np.asarray(shifts.through, dtype=np.int64)
        # where each re-run op's group starts in the new program
        self._rerun_starts = profiler._group_start[self._rerun_ops] + self._through[:-1]
        self._step_at, size = _steps(changes, len(profiler._base_high) + shifts.total)
        self._step_total = np.concatenate(([0], np.cumsum(size)))

    def at(self, ops: np.ndarray) -> np.ndarray:
        """``profile.high_bytes[ops] - keep_high[ops]`` for the given op indices."""
        ops = np.asarray(ops, dtype=np.int64)
        first, last, count = self._group_bounds(ops)
        found = self._step(first)
        touched = np.nonzero((count > 0) | (self._steps_up_to(last) > self._steps_up_to(first)))[0]
        if touched.size:
            found[touched] = self._folded(ops[touched], first[touched], last[touched],
                                          count[touched]) - self.profiler.keep_high[ops[touched]]
        return found

    def most(self, counted: np.ndarray) -> int | None:
        """The largest change over the ops that ``counted`` counts (``counted[i]``: how many of
        ops ``0..i-1`` are in the set, length ops + 1); ``None`` for an empty set."""
        if counted[-1] == 0:
            return None
        holders = self._op_of_action(self._step_at)
        inside = self._step_at > self._group_bounds(holders)[0]  # past its group's first action
        piece_ops, piece_values = self._pieces(holders, inside)
        touched = np.unique(np.concatenate((self._rerun_ops, holders[inside])))
        bounds = np.concatenate(([0], piece_ops, [len(counted) - 1]))
        members = counted[bounds[1:]] - counted[bounds[:-1]]
        touched_members = np.zeros(len(members), dtype=np.int64)
        touched_in = touched[(counted[touched + 1] - counted[touched]) > 0]
        if touched_in.size:  # touched ops of the set take their exact change instead
            np.add.at(touched_members, np.searchsorted(bounds, touched_in, "right") - 1, 1)
        values = np.concatenate(([0], piece_values))[members > touched_members]
        exact = self.at(touched_in) if touched_in.size else np.zeros(0, dtype=np.int64)
        return int(np.concatenate((values, exact)).max())

    def _group_bounds(self, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each op's first and last action in the new program, and its re-run count."""
        profiler = self.profiler
        at = np.searchsorted(self._rerun_ops, ops, "right")
        offset = self._through[at]
        count = np.zeros(len(ops), dtype=np.int64)
        if self._rerun_ops.size:
            own = (at > 0) & (self._rerun_ops[np.maximum(at - 1, 0)] == ops)
            count[own] = self._rerun_counts[at[own] - 1]
        return (profiler._group_start[ops] + offset - count, profiler._group_end[ops] + offset,
                count)

    def _steps_up_to(self, actions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._step_at, actions, "right")

    def _step(self, actions: np.ndarray) -> np.ndarray:
        """The change while each of ``actions`` runs."""
        return self._step_total[self._steps_up_to(actions)]

    def _folded(self, ops: np.ndarray, first: np.ndarray, last: np.ndarray,
                count: np.ndarray) -> np.ndarray:
        """The ops' high bytes in the new program (their group's bounds and re-run counts
        given): the most over their re-run slots (the live bytes before the group, plus the
        change) and their own actions (the base's high bytes, plus the change)."""
        profiler = self.profiler
        base_first = profiler._group_start[ops]
        base, which = _spans(base_first, profiler._group_end[ops] - base_first + 1)
        high = profiler._base_high[base] + self._step(base + (last - profiler._group_end[ops])[which])
        slots, slot_of = _spans(first, count)
        values = np.concatenate((high, profiler._live_before[ops][slot_of] + self._step(slots)))
        folded = np.full(len(ops), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(folded, np.concatenate((which, slot_of)), values)
        return folded

    def _op_of_action(self, actions: np.ndarray) -> np.ndarray:
        """The op whose group holds each action of the new program."""
        profiler = self.profiler
        if not self._rerun_ops.size:
            return profiler._group_of[actions]
        at = np.searchsorted(self._rerun_starts, actions, "right") - 1
        valid = np.maximum(at, 0)
        in_slots = (at >= 0) & (actions < self._rerun_starts[valid] + self._rerun_counts[valid])
        shift = np.where(at >= 0, self._through[valid + 1], 0)
        base = np.clip(actions - shift, 0, len(profiler._group_of) - 1)
        return np.where(in_slots, self._rerun_ops[valid], profiler._group_of[base])

    def _pieces(self, holders: np.ndarray, inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ops where the change of untouched ops steps, and its value from each on, given the
        op holding each step and whether the step is inside its group: a step at the group's
        first action counts for that op; inside it, from the next op (the holder is touched)."""
        ops = holders + inside
        if not ops.size:
            return ops, ops
        last_of_op = np.append(ops[1:] != ops[:-1], True)
        return ops[last_of_op], self._step_total[1:][last_of_op]


def _spans(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The integers ``starts[i] .. starts[i] + lengths[i] - 1`` for every ``i``, concatenated,
    and the ``i`` of each."""
    which = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    return np.repeat(starts, lengths) + _ranks(lengths), which


def _steps(changes: list[tuple[int, int, int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """The step function of ``_high_delta`` as sorted breakpoints and the change at each
    (breakpoints at or past the program's end dropped)."""
    if not changes:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    start, end, size = np.asarray(changes, dtype=np.int64).T
    position = np.concatenate((start, end + 1))
    change = np.concatenate((size, -size))
    order = np.argsort(position, kind="stable")
    position, change = position[order], change[order]
    inside = position < length
    return position[inside], change[inside]
