"""One memory model, incremental: the Keep plan's profile once per graph, and the change a set of
decisions makes to it, priced in numpy without lowering the whole program.

Why: ``lower`` + ``memory_profile`` (and ``simulate``) are the truth, but they build every action of
the step, so the planners that price hundreds of plans grew their own fast copies of the model
(``RerunProfiler``, ``_free_swaps``' queue replay, ``_separator_count_search``'s bounds, and
``_swap_tune``'s ``PeakModel`` and ``step_time_s``, which this module replaced). It is meant to
replace them all (the plan: ``docs/design/memory_model.md``). So far it prices *swap* decisions
(each copy serving ops that run after its control op): the questions the TFLMS tuner asks.
Re-runs come next.

How: every action of ``lower(graph, plan)`` has an integer *key* that sorts in program order,
found without building the action list: ``position * STRIDE + slot``, where an op's group of
actions holds, in order, the re-runs placed before it (``slot`` = their rank), the waits before
it (``WAIT``), its compute (``COMPUTE``), its swap-outs (``SWAP_OUT``) and the swap-ins issued
after it (``SWAP_IN``). A buffer is live from the key of the action that allocates it to the key
of its last reader, both included (``memory_profile`` frees right after the last read). A set
of decisions is a list of changed lifetimes: ``(first key, last key, signed bytes)``. The bytes
live while an action runs are the Keep plan's there (``BaseProfile``: per op, while it runs and
after it) plus the changes covering its key. The peak is at an action that allocates; for swaps,
at an op's compute. ``peak_bytes`` adds the change to every op's high bytes (dense, O(ops + m)
for m changes), or maximises over each piece of the change's step function with a range-maximum
table of the Keep plan's high bytes (sparse, O(m log m), whatever the step's length). (Re-runs
allocate between ops: their changes will add the first action of each changed lifetime as a
candidate, at the Keep plan's live bytes before the op plus the change.)

Example:
    >>> from memfit.model import synthetic
    >>> from memfit.model.schedule import peak_bytes
    >>> graph = synthetic.chain(4)
    >>> base = BaseProfile.of(graph)
    >>> base.peak_bytes(base.swaps([])) == peak_bytes(graph, Plan("keep"))
    True
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Swap
from memfit.model.recompute import PlannedRerun
from memfit.model.schedule import lower, memory_profile
from memfit.model.sharding import COLLECTIVE_KINDS
from memfit.model.sharding import WAIT as COMM_WAIT

STRIDE = 1 << 22  # keys per op: room for a million re-runs before one op
WAIT = (1 << 20) - 1  # waits come after the re-runs (slots 0..) and before the compute
COMPUTE = 1 << 20
SWAP_OUT = COMPUTE + 1
SWAP_IN = COMPUTE + 2
MISSING = np.iinfo(np.int64).min // 2  # the maximum of no values


Copy = tuple[int, int, str, str, int, int]  # (key, tie, kind, tensor, copy number, bytes)


@dataclass(frozen=True)
class SwapDelta:
    """The change a list of swap decisions makes to the Keep plan, per decision in order.

    Args:
        first_key, last_key, size_bytes: changed lifetimes (a negative size removes bytes);
            those of decision ``i`` are ``[ends[i], ends[i + 1])``.
        ends: ``ends[k]``: how many changed lifetimes the first ``k`` decisions make.
        decisions: the decisions (their copies are found when a step time is asked for: the
            tuner asks for every prefix's peak but only a few plans' times).
    """

    first_key: np.ndarray
    last_key: np.ndarray
    size_bytes: np.ndarray
    ends: tuple[int, ...]
    decisions: tuple[tuple[str, Swap], ...]

    def __len__(self) -> int:
        return len(self.ends) - 1


class BaseProfile:
    """The Keep plan's memory profile and compute clock of one graph, and queries of the change
    a set of decisions makes to them.

    Built from ``memory_profile(lower(graph, Plan("keep")))`` itself (one compute action per op),
    so the base cannot drift from the truth; ``BaseProfile.of`` builds it once per graph.
    """

    def __init__(self, graph: CostGraph) -> None:
        profile = memory_profile(lower(graph, Plan("keep")))
        self.graph, self.op_count = graph, len(graph.ops)
        self.resident_bytes, self.keep_peak_bytes = graph.resident_bytes, profile.peak_bytes
        self.high_bytes = np.asarray(profile.high_bytes, dtype=np.int64)  # while op k runs
        self.live_after = np.asarray(profile.live_bytes, dtype=np.int64)  # after op k
        self._range_max = _RangeMax(self.high_bytes)
        index = graph.index
        self.produced_at = {name: index[t.producer] for name, t in graph.tensors.items()
                            if t.producer is not None}
        self.last_key = {  # the Keep plan's lifetimes of the buffers it frees
            name: max([at, *(index[c] for c in graph.tensors[name].consumers)]) * STRIDE + COMPUTE
            for name, at in self.produced_at.items() if not graph.tensors[name].is_output
        }
        self.op_time_s = np.asarray([op.time_s for op in graph.ops], dtype=float)
        self.keep_end_s = np.cumsum(self.op_time_s)  # the Keep plan's compute clock
        self.op_times = self.op_time_s.tolist()  # for additions one at a time
        self.has_collectives = any(op.kind in COLLECTIVE_KINDS or op.kind == COMM_WAIT
                                   for op in graph.ops)

    @classmethod
    def of(cls, graph: CostGraph) -> BaseProfile:
        """The graph's base profile, built once (a graph is frozen, so it never goes stale)."""
        return graph.remembered("base profile", lambda: cls(graph))

    def live_across(self, tensors: Iterable[str], op: int) -> set[str]:
        """The tensors of ``tensors`` the Keep plan holds across op ``op``'s end: allocated at or
        before its compute and read after it (so counted in ``live_after[op]``). For bounds that
        take some of them out of that figure (``CountBounds``' boundary)."""
        return {t for t in tensors
                if t in self.last_key and self.produced_at[t] <= op < self.last_key[t] // STRIDE}

    def swaps(self, decisions: Sequence[tuple[str, Swap]]) -> SwapDelta:
        """The changed lifetimes of ``decisions``, in order.

        Raises:
            ValueError: for a swap-in that feeds re-runs (not modelled yet: the plan of
                ``docs/design/memory_model.md``, step 3).
        """
        first: list[int] = []
        last: list[int] = []
        size: list[int] = []
        ends = [0]
        for name, swap in decisions:
            self._swap(name, swap, first, last, size)
            ends.append(len(first))
        return SwapDelta(np.asarray(first, dtype=np.int64), np.asarray(last, dtype=np.int64),
                         np.asarray(size, dtype=np.int64), tuple(ends), tuple(decisions))

    def _swap(self, name: str, swap: Swap, first: list[int], last: list[int],
              size: list[int]) -> None:
        """One swapped tensor's changed lifetimes: the original now lives to its swap-out or its
        last unserved reader; each copy from its swap-in to its last reader. (The tuner's
        hot loop: keys are computed inline.)"""
        index = self.graph.index
        tensor = self.graph.tensors[name]
        produced_at, size_bytes = self.produced_at[name], tensor.size_bytes
        served = {c for swap_in in swap.swap_ins for c in swap_in.consumers}
        unserved = max((index[c] for c in tensor.consumers if c not in served), default=-1)
        start = produced_at * STRIDE + COMPUTE
        first += (start, start)
        last += (self.last_key[name],
                 unserved * STRIDE + COMPUTE if unserved >= 0 else produced_at * STRIDE + SWAP_OUT)
        size += (-size_bytes, size_bytes)
        for swap_in in swap.swap_ins:
            issued_at = index[swap_in.after]
            readers = [index[c] for c in swap_in.consumers]
            if min(readers) <= issued_at:
                raise ValueError(f"the swap-in of {name!r} after {swap_in.after!r} feeds re-runs, "
                                 "which the incremental profile does not model yet")
            first.append(issued_at * STRIDE + SWAP_IN)
            last.append(max(readers) * STRIDE + COMPUTE)
            size.append(size_bytes)

    def _copies(self, decisions: Sequence[tuple[str, Swap]]) -> list[Copy]:
        """The copies and waits of ``decisions`` in ``lower``'s order: by key, swap-outs in the
        order of their op's outputs, swap-ins issued after one op in the decisions' order."""
        graph, index = self.graph, self.graph.index
        copies: list[Copy] = []
        for sequence, (name, swap) in enumerate(decisions):
            produced_at, size_bytes = self.produced_at[name], graph.tensors[name].size_bytes
            rank = graph.ops[produced_at].outputs.index(name)
            copies.append((_key(produced_at, SWAP_OUT), rank, "swap_out", name, -1, size_bytes))
            for copy, swap_in in enumerate(swap.swap_ins):
                tie = sequence * 1024 + copy
                copies.append((_key(index[swap_in.after], SWAP_IN), tie, "swap_in", name, copy,
                               size_bytes))
                first_reader = min(index[c] for c in swap_in.consumers)
                copies.append((_key(first_reader, WAIT), 0, "wait", name, copy, size_bytes))
        return sorted(copies)

    def peak_bytes(self, delta: SwapDelta, count: int | None = None, method: str = "auto") -> int:
        """``memory_profile(lower(graph, plan)).peak_bytes`` of the plan of the first ``count``
        decisions of ``delta`` (default: all).

        Args:
            method: ``"dense"`` adds the change to every op's high bytes (O(ops + m), the
                fastest while the change is not much smaller than the graph); ``"sparse"``
                maximises over the pieces of the change's step function (O(m log m), for a few
                decisions on a long step); ``"auto"`` (default) picks by size. Same answer.
        """
        end = delta.ends[len(delta) if count is None else count]
        if not end:
            return self.keep_peak_bytes
        first, last, size = delta.first_key[:end], delta.last_key[:end], delta.size_bytes[:end]
        # for swaps the peak is at some op's compute: a copy swapped in after op c is live
        # while op c + 1 runs, whose high bytes start from the bytes live after op c
        if method == "dense" or (method == "auto" and not self._sparse_pays(end)):
            return self._dense_peak(first, last, size)
        points = np.concatenate((first, last + 1))
        order = np.argsort(points, kind="stable")
        points = points[order]
        level = np.cumsum(np.concatenate((size, -size))[order])  # the change on [p_i, p_i+1)
        # the ops whose compute lies in each piece (before the first point the change is 0)
        ops = np.clip(-(-(points - COMPUTE) // STRIDE), 0, self.op_count)
        low = np.concatenate(([0], ops))
        high = np.concatenate((ops, [self.op_count]))
        at_compute = self._range_max(low, high) + np.concatenate(([0], level))
        return int(max(self.resident_bytes, at_compute.max()))

    def _sparse_pays(self, changes: int) -> bool:
        """Measured (``bench/profile_speed.py``): the sparse path's fixed cost (~40 us) loses to
        the dense one's pass below ~10,000 ops; on 24,450 ops it won up to ~40 changes (10
        swaps: 51 vs 90 us) and lost at ~400 (100 swaps: 168 vs 97 us)."""
        return self.op_count > 8192 and 256 * changes < self.op_count

    def _dense_peak(self, first: np.ndarray, last: np.ndarray, size: np.ndarray) -> int:
        """The peak from the change at every op's compute: each changed lifetime covers the
        computes from the first at or after its first key to the last at or before its last."""
        covered_from = -(-(first - COMPUTE) // STRIDE)
        covered_to = (last - COMPUTE) // STRIDE + 1
        change = np.zeros(self.op_count + 1, dtype=np.int64)
        np.add.at(change, covered_from, size)
        np.add.at(change, covered_to, -size)
        return int(max(self.resident_bytes, (self.high_bytes + np.cumsum(change[:-1])).max()))

    def step_time_s(self, delta: SwapDelta, hardware: Hardware, count: int | None = None) -> float:
        """``simulate(graph, plan, hardware).step_time_s`` of the first ``count`` decisions'
        plan (default: all), to the bit: the same additions in the same order (the Keep plan's
        clock until a copy stalls compute, then a running sum restarted at each stall; see
        ``_ComputeClock``). Walks the copies, and the ops after the first stall.

        Raises:
            ValueError: for a graph with collectives (their stream is not modelled yet).
        """
        if self.has_collectives:
            raise ValueError("the incremental clock does not model collectives yet: simulate")
        copies = self._copies(delta.decisions[:len(delta) if count is None else count])
        if not hardware.async_copies:
            return self._sync_time_s(copies, hardware)
        return self._async_time_s(copies, hardware)

    def _sync_time_s(self, copies: list[Copy], hardware: Hardware) -> float:
        """Every copy runs on the compute thread: one running sum over the actions' durations
        in program order (a copy right after the op it follows)."""
        moved = [c for c in copies if c[2] != "wait"]
        after = [c[0] // STRIDE + 1 for c in moved]
        copy_s = [hardware.d2h_time_s(c[5]) if c[2] == "swap_out" else hardware.h2d_time_s(c[5])
                  for c in moved]
        durations = np.insert(self.op_time_s, after, copy_s) if moved else self.op_time_s
        return float(np.cumsum(np.concatenate(([0.0], durations)))[-1])

    def _async_time_s(self, copies: list[Copy], hardware: Hardware) -> float:
        """The simulator's four-stream clock over the copies in program order; the compute
        stream's ends come from ``_ComputeClock``, the copy streams' from ``CopyLink``."""
        link = CopyLink(hardware)
        out_end: dict[str, float] = {}
        in_end: dict[tuple[str, int], float] = {}
        wait_ops = sorted({c[0] // STRIDE for c in copies if c[2] == "wait"})
        clock = _ComputeClock(self.op_times, self.keep_end_s, wait_ops)
        for key, _, kind, tensor, copy, size_bytes in copies:
            op = key // STRIDE
            if kind == "wait":
                clock.wait(op, in_end[(tensor, copy)])
            elif kind == "swap_out":
                out_end[tensor] = link.copy_out(clock.end_s(op), size_bytes)
            else:
                in_end[(tensor, copy)] = link.copy_in(max(clock.end_s(op), out_end[tensor]),
                                                      size_bytes)
        return max(clock.end_s(self.op_count - 1) if self.op_count else 0.0, link.out_free_s,
                   link.in_free_s)

    def compute_clock(self, reruns: Mapping[str, Sequence[PlannedRerun]] | None = None
                      ) -> tuple[list[float], list[float]]:
        """Each op's slot on the compute stream with ``reruns`` (op -> the re-runs placed
        before it) and no stall: from the start of its re-runs to its own end. The simulator's
        additions in its order (``np.cumsum`` adds left to right), so a time a copy is planned
        against is the one ``simulate`` gives when nothing stalls. For ``free_swaps``."""
        if not reruns:
            ends = self.keep_end_s
        else:
            graph = self.graph
            count = np.zeros(self.op_count, dtype=np.int64)
            rerun_s: list[float] = []
            for op in sorted(reruns, key=graph.index.__getitem__):
                count[graph.index[op]] = len(reruns[op])
                rerun_s += [graph.op(r.op).time_s for r in reruns[op]]
            at = np.arange(self.op_count) + np.cumsum(count)  # each op after its re-runs
            durations = np.zeros(self.op_count + len(rerun_s))
            durations[at] = self.op_time_s
            durations[np.setdiff1d(np.arange(len(durations)), at)] = rerun_s
            ends = np.cumsum(durations)[at]
        end_s = ends.tolist()
        return [0.0, *end_s[:-1]] if end_s else [], end_s


class CopyLink:
    """The two copy streams of one link, each a FIFO, as ``simulate`` runs them: a copy starts
    when it is ready and its stream is free; on a half-duplex link (``hardware.duplex`` false)
    both directions share one stream. The one queue model of copies: ``step_time_s`` replays a
    plan's copies on it, and ``free_swaps`` plans copies that fit on it."""

    def __init__(self, hardware: Hardware) -> None:
        self.hardware = hardware
        self.out_free_s = 0.0  # when the device-to-host stream is next free
        self.in_free_s = 0.0  # when the host-to-device stream is next free

    def out_landing_s(self, ready_s: float, size_bytes: int) -> float:
        """When a copy out ready at ``ready_s`` would land, were it queued now."""
        return max(ready_s, self.out_free_s) + self.hardware.d2h_time_s(size_bytes)

    def copy_out(self, ready_s: float, size_bytes: int) -> float:
        """Queue a copy out; returns when it lands."""
        self.out_free_s = self.out_landing_s(ready_s, size_bytes)
        if not self.hardware.duplex:
            self.in_free_s = self.out_free_s
        return self.out_free_s

    def copy_in(self, ready_s: float, size_bytes: int) -> float:
        """Queue a copy back (``ready_s``: its issue and its copy out both done); returns when
        it lands."""
        self.in_free_s = max(ready_s, self.in_free_s) + self.hardware.h2d_time_s(size_bytes)
        if not self.hardware.duplex:
            self.out_free_s = self.in_free_s
        return self.in_free_s


class _ComputeClock:
    """The compute stream's clock, as the copies ask for it in program order.

    Until the first stall it is the Keep plan's (``np.cumsum`` adds left to right, as the
    simulator does). From a stall on it is a running sum restarted at the landing time, added
    up in Python as far as the next op a copy may stall (the next wait) when an end is asked
    for: each op's time once, as the simulator adds it. (Chunks average a few ops when many
    copies stall, so a numpy call per chunk cost more than the additions: 7.4 vs 3.3 ms for 527
    swaps on 2,007 ops.)
    """

    def __init__(self, op_time_s: list[float], keep_end_s: np.ndarray, wait_ops: list[int]) -> None:
        self.op_time_s, self.keep_end_s, self.wait_ops = op_time_s, keep_end_s, wait_ops
        self.stalled = False
        self.ends: list[float] = []  # after the first stall: the ends of ops known - len .. known - 1
        self.known = 0  # after the first stall: ops 0..known-1 have their end
        self.free_s = 0.0  # after the first stall: when the stream is free after op known - 1
        self.first = 0  # the op whose end is ``ends[0]``

    def end_s(self, op: int) -> float:
        """When op ``op``'s compute ends."""
        if not self.stalled:
            return float(self.keep_end_s[op])
        self._advance(op + 1)
        return self.ends[op - self.first]

    def wait(self, op: int, landed_s: float) -> None:
        """The stream waits, before op ``op``, for a copy landing at ``landed_s``."""
        if not self.stalled:
            free_s = float(self.keep_end_s[op - 1]) if op else 0.0
            if landed_s > free_s:
                self.stalled, self.known, self.first, self.free_s = True, op, op, landed_s
            return
        self._advance(op)
        self.free_s = max(self.free_s, landed_s)

    def _advance(self, through: int) -> None:
        if through <= self.known:
            return
        next_wait = bisect.bisect_left(self.wait_ops, through)
        stop = self.wait_ops[next_wait] if next_wait < len(self.wait_ops) else len(self.op_time_s)
        free_s, ends, times = self.free_s, self.ends, self.op_time_s
        for op in range(self.known, max(stop, through)):
            free_s += times[op]
            ends.append(free_s)
        self.known, self.free_s = max(stop, through), free_s


def _key(position: int, slot: int) -> int:
    return position * STRIDE + slot


class _RangeMax:
    """Maximum of ``values[low:high]`` for many ranges at once (a sparse table: log n arrays of
    the maxima of power-of-two windows, built once)."""

    def __init__(self, values: np.ndarray) -> None:
        levels = [values if len(values) else np.full(1, MISSING, dtype=np.int64)]
        width = 1
        while 2 * width <= len(levels[0]):
            levels.append(np.maximum(levels[-1][:-width], levels[-1][width:]))
            width *= 2
        self.table = np.full((len(levels), len(levels[0])), MISSING, dtype=np.int64)
        for level, maxima in enumerate(levels):
            self.table[level, : len(maxima)] = maxima

    def __call__(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """Per range, its maximum; ``MISSING`` for an empty range."""
        length = high - low
        empty = length <= 0
        level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
        low = np.where(empty, 0, low)
        right = np.where(empty, 0, high - (1 << level))
        return np.where(empty, MISSING, np.maximum(self.table[level, low], self.table[level, right]))
