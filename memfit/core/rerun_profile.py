"""The memory profile of a recomputation plan, fast: ``memory_profile(lower(graph, plan))`` as a
change to the Keep plan's profile that touches only the buffers the plan changes.

Why: the segment planner (``memfit.solvers.segments``) prices hundreds of candidate segments,
each a plan that recomputes a few dozen tensors of a thousand-op step. Lowering the whole program
for each costs about 10 ms in Python; this walks only the recomputed tensors, their re-runs and
their readers, and adds the result to the Keep profile with numpy. It follows ``lower`` and
``memory_profile`` rule for rule (program order, newest instance read, freed after the last
reader), and a test holds the two equal on synthetic and captured graphs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from memfit.core.costgraph import CostGraph
from memfit.core.plan import Plan
from memfit.core.recompute import PlannedRerun, decided_reruns, first_late_readers
from memfit.core.schedule import lower, memory_profile


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
        schedule = lower(graph, base)
        profile = memory_profile(schedule)
        self.resident_bytes = graph.resident_bytes
        self._base_high = np.asarray(profile.high_bytes, dtype=np.int64)
        self._base_live = np.asarray(profile.live_bytes, dtype=np.int64)
        self._group_of = _groups(graph, schedule.actions)
        self._group_start = np.searchsorted(self._group_of, np.arange(len(graph.ops)))
        self._group_end = np.append(self._group_start[1:], len(schedule.actions)) - 1
        self._compute = np.asarray(
            [i for i, a in enumerate(schedule.actions) if a.kind == "compute"], dtype=np.int64)
        self.keep_high = np.maximum.reduceat(self._base_high, self._group_start)
        self.keep_live = self._base_live[self._group_end]
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
        compute_at = self._compute + offset
        group_start = self._group_start + offset - count  # its re-runs come first
        walk = _RerunWalk(self, compute_at)
        for before in sorted(grouped, key=graph.index.__getitem__):
            first = int(group_start[graph.index[before]])
            for slot, rerun in enumerate(grouped[before]):
                walk.rerun(rerun, graph.index[before], first + slot)
        changes = walk.changes()
        length = len(self._base_high) + int(offset[-1])
        high = self._spread(count, offset, length) + _high_delta(changes, length)
        folded = np.maximum.reduceat(high, group_start)
        live = self.keep_live + _live_delta(changes, self._group_end + offset, length)
        return RerunProfile(folded, live, self._time_s(grouped), int(count.sum()))

    def readers(self, tensor: str) -> list[int]:
        """Positions of ``tensor``'s readers in the graph, in order."""
        return self._readers[tensor]

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
        live_before = np.concatenate(([self.resident_bytes], self._base_live))[self._group_start]
        slots = np.repeat(self._group_start + offset - count, count) + _ranks(count)
        spread[slots] = np.repeat(live_before, count)
        spread[np.arange(len(self._base_high)) + offset[self._group_of]] = self._base_high
        return spread


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

    def __init__(self, profiler: RerunProfiler, compute_at: np.ndarray) -> None:
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
        compute_at = self.compute_at.tolist()  # plain ints: fast lookups
        readers_of, produced_at = self.profiler._readers, self.profiler._produced_at
        freed_bytes = self.profiler._freed_bytes
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
        changed = {*self.replaced, *(b for b in self.rerun_reads if b in freed_bytes)}
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
