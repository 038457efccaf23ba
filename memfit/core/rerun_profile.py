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
    """Prices recomputation plans on one graph against its Keep profile (computed once)."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        keep = memory_profile(lower(graph, Plan("keep")))
        self.resident_bytes = graph.resident_bytes
        self.keep_high = np.asarray(keep.high_bytes, dtype=np.int64)
        self.keep_live = np.asarray(keep.live_bytes, dtype=np.int64)
        index = graph.index
        self._readers = {
            name: sorted(index[c] for c in t.consumers) for name, t in graph.tensors.items()
        }
        self._produced_at = {
            name: index[t.producer] for name, t in graph.tensors.items() if t.producer is not None
        }
        self._first_late_reader = first_late_readers(graph)

    def profile(self, recomputed: Iterable[str]) -> RerunProfile:
        """The profile of ``Plan(decisions={t: Recompute() for t in recomputed})``."""
        graph = self.graph
        grouped: dict[str, list[PlannedRerun]] = {}
        for rerun in decided_reruns(graph, set(recomputed), self._first_late_reader):
            grouped.setdefault(rerun.before, []).append(rerun)
        count = np.zeros(len(graph.ops), dtype=np.int64)
        for before, reruns in grouped.items():
            count[graph.index[before]] = len(reruns)
        offset = np.cumsum(count)  # re-runs placed before or at each op
        compute_at = np.arange(len(graph.ops), dtype=np.int64) + offset
        walk = _RerunWalk(self, compute_at)
        for before in sorted(grouped, key=graph.index.__getitem__):
            first = int(compute_at[graph.index[before]]) - len(grouped[before])
            for slot, rerun in enumerate(grouped[before]):
                walk.rerun(rerun, graph.index[before], first + slot)
        changes = walk.changes()
        high = self._base_high(count, compute_at) + _high_delta(changes, int(compute_at[-1]) + 1)
        folded = np.maximum.reduceat(high, compute_at - count)
        live = self.keep_live + _live_delta(changes, compute_at)
        time_s = sum(graph.op(r.op).time_s for reruns in grouped.values() for r in reruns)
        return RerunProfile(folded, live, time_s, int(count.sum()))

    def _base_high(self, count: np.ndarray, compute_at: np.ndarray) -> np.ndarray:
        """The Keep profile spread over the new program: re-run slots hold the live bytes after
        the op before them."""
        base = np.empty(int(compute_at[-1]) + 1, dtype=np.int64)
        before = np.concatenate(([self.resident_bytes], self.keep_live[:-1]))
        base[:] = np.repeat(before, count + 1)
        base[compute_at] = self.keep_high
        return base


class _RerunWalk:
    """Buffer lifetimes that a plan changes, in the new program's action indices."""

    def __init__(self, profiler: RerunProfiler, compute_at: np.ndarray) -> None:
        self.profiler = profiler
        self.compute_at = compute_at
        self.newest: dict[str, str] = {}
        self.replaced: dict[str, list[tuple[int, str]]] = {}  # tensor -> (op index, instance)
        self.rerun_reads: dict[str, int] = {}  # buffer -> last re-run reading it
        self.allocated: dict[str, tuple[int, int]] = {}  # instance -> (action, bytes)

    def rerun(self, rerun: PlannedRerun, before_index: int, action: int) -> None:
        graph = self.profiler.graph
        op = graph.op(rerun.op)
        for tensor in op.inputs:
            buffer = self.newest.get(tensor, tensor)
            self.rerun_reads[buffer] = max(action, self.rerun_reads.get(buffer, -1))
        for tensor in op.outputs:
            instance = f"{tensor}#{action}"
            self.allocated[instance] = (action, graph.tensors[tensor].size_bytes)
            if tensor in rerun.replaces:
                self.newest[tensor] = instance
                self.replaced.setdefault(tensor, []).append((before_index, instance))

    def changes(self) -> list[tuple[int, int, int]]:
        """(first action, last action, signed bytes) of every changed lifetime."""
        profiler, compute_at = self.profiler, self.compute_at.tolist()  # plain ints: fast lookups
        graph = profiler.graph
        last_read = dict(self.rerun_reads)
        for tensor, replacements in self.replaced.items():
            readers = profiler._readers[tensor]
            for number, (before_index, instance) in enumerate(replacements):
                until = replacements[number + 1][0] if number + 1 < len(replacements) else None
                first = bisect.bisect_left(readers, before_index)
                end = len(readers) if until is None else bisect.bisect_left(readers, until)
                if end > first:  # readers in [before, next re-run) read this instance
                    last_read[instance] = max(compute_at[readers[end - 1]],
                                              last_read.get(instance, -1))
            first = bisect.bisect_left(readers, replacements[0][0])
            if first:  # readers before the first re-run read the original
                last_read[tensor] = max(compute_at[readers[first - 1]],
                                        last_read.get(tensor, -1))
        changes: list[tuple[int, int, int]] = []
        for tensor in {*self.replaced, *(b for b in self.rerun_reads if b in graph.tensors)}:
            info = graph.tensors[tensor]
            if info.is_output or tensor not in profiler._produced_at:
                continue  # step outputs and resident tensors are never freed
            start = compute_at[profiler._produced_at[tensor]]
            readers = profiler._readers[tensor]
            old_end = max(start, compute_at[readers[-1]]) if readers else start
            if tensor not in self.replaced:
                last_read[tensor] = max(last_read[tensor], old_end)
            new_end = max(start, last_read.get(tensor, start))
            if new_end != old_end:
                changes.append((start, old_end, -info.size_bytes))
                changes.append((start, new_end, info.size_bytes))
        for instance, (action, size_bytes) in self.allocated.items():
            changes.append((action, max(action, last_read.get(instance, action)), size_bytes))
        return changes


def _high_delta(changes: list[tuple[int, int, int]], length: int) -> np.ndarray:
    """Bytes to add to the Keep profile while each action of the new program runs."""
    difference = np.zeros(length + 1, dtype=np.int64)
    if changes:
        start, end, size = np.asarray(changes, dtype=np.int64).T
        np.add.at(difference, start, size)  # live while action a runs: start <= a <= end
        np.add.at(difference, end + 1, -size)
    return np.cumsum(difference[:-1])


def _live_delta(changes: list[tuple[int, int, int]], compute_at: np.ndarray) -> np.ndarray:
    """Bytes to add to the Keep live bytes right after each original op."""
    difference = np.zeros(int(compute_at[-1]) + 2, dtype=np.int64)
    if changes:
        start, end, size = np.asarray(changes, dtype=np.int64).T
        np.add.at(difference, start, size)  # live after action a: start <= a < end
        np.add.at(difference, end, -size)
    return np.cumsum(difference[:-1])[compute_at]
