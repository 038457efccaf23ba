"""One memory model, incremental: the Keep plan's profile once per graph, and the change a set of
decisions makes to it, priced in numpy without lowering the whole program.

Why: ``lower`` + ``memory_profile`` (and ``simulate``) are the truth, but they build every action of
the step, and the planners price hundreds of plans: the TFLMS tuner, the segment DP, the
checkpoint count search and ``free_swaps`` ask this model instead, which gives the truth's answers
(``docs/memory-model.md``). It prices swap decisions (each copy serving ops that run after
its control op: the TFLMS tuner's questions) and re-runs (``memfit.model.rerun_delta``: the
recompute planners' questions), on the Keep plan or on a swap plan.

How: every action of ``lower(graph, plan)`` has an integer *key* that sorts in program order,
found without building the action list (``memfit.model.keys``). A buffer is live from the key
of the action that allocates it to the key of its last reader, both included (``memory_profile``
frees right after the last read). A set
of decisions is a list of changed lifetimes: ``(first key, last key, signed bytes)``. The bytes
live while an action runs are the Keep plan's there (``BaseProfile``: per op, while it runs and
after it) plus the changes covering its key. The peak is at an action that allocates; for swaps,
at an op's compute. ``peak_bytes`` adds the change to every op's high bytes (dense, O(ops + m)
for m changes), or maximises over each piece of the change's step function with a range-maximum
table of the Keep plan's high bytes (sparse, O(m log m), whatever the step's length). Re-runs
and copies add actions between the computes; ``folded`` reads those too, at the Keep plan's live
bytes between the ops plus the change.

Example:
    >>> from memfit.model import synthetic
    >>> from memfit.model.schedule import peak_bytes
    >>> graph = synthetic.chain(4)
    >>> base = BaseProfile.of(graph)
    >>> base.peak_bytes(base.swaps([])) == peak_bytes(graph, Plan("keep"))
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Swap
from memfit.model import keys, rerun_delta
from memfit.model.clock import ComputeClock, CopyLink
from memfit.model.keep_profile import KeepProfile
from memfit.model.plan_memo import remembered_result
from memfit.model.recompute import PlannedRerun
from memfit.model.rerun_delta import FoldedProfile, RerunDelta

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


class BaseProfile(KeepProfile):
    """The Keep plan's profile (``KeepProfile``), and queries of the change a set of decisions
    makes to it: swaps (``swaps``, ``peak_bytes``, ``step_time_s``) and re-runs on the Keep plan
    or a swap plan (``recomputes``, ``plan``, ``folded``, ``change_at``, ``most_change``).
    ``BaseProfile.of`` builds it once per graph.
    """

    @classmethod
    def of(cls, graph: CostGraph) -> BaseProfile:
        """The graph's base profile, built once (a graph is frozen, so it never goes stale)."""
        return graph.remembered("base profile", lambda: cls(graph))

    def recomputes(self, recomputed: Iterable[str]) -> RerunDelta:
        """The change of ``Recompute()`` for every tensor of ``recomputed``
        (``rerun_delta.recomputes``)."""
        return rerun_delta.recomputes(self, recomputed)

    def plan(self, plan: Plan) -> RerunDelta:
        """The change of a whole plan: swaps, ``Recompute`` decisions and ``Plan.reruns``
        (``rerun_delta.plan_delta``; a swap plan is the base other planners add re-runs to)."""
        return rerun_delta.plan_delta(self, plan)

    def folded(self, delta: RerunDelta) -> FoldedProfile:
        """Per op, the folded high bytes and the live bytes after it (``rerun_delta.folded``)."""
        return rerun_delta.folded(self, delta)

    def change_at(self, delta: RerunDelta, ops: np.ndarray) -> np.ndarray:
        """``folded(delta).high_bytes[ops] - high_bytes[ops]``, sparse."""
        return rerun_delta.change_at(self, delta, ops)

    def most_change(self, delta: RerunDelta, counted: np.ndarray) -> int | None:
        """The largest ``change_at`` over a set of ops given by its counts, sparse."""
        return rerun_delta.most_change(self, delta, counted)

    def rerun_time_s(self, recomputed: Iterable[str]) -> float:
        """The re-runs' time of recomputing ``recomputed``, without their lifetimes (once per
        set inside ``memfit.model.plan_memo.plans_remembered``: searches at several budgets ask
        for the same sets)."""
        recomputed = frozenset(recomputed)
        return remembered_result("rerun time", (self,), recomputed,
                                 lambda: rerun_delta.rerun_time_s(self, recomputed))

    def swaps(self, decisions: Sequence[tuple[str, Swap]]) -> SwapDelta:
        """The changed lifetimes of ``decisions``, in order.

        Raises:
            ValueError: for a swap-in that feeds re-runs (not modelled: ``simulate`` prices
                those plans).
        """
        first: list[int] = []
        last: list[int] = []
        size: list[int] = []
        ends = [0]
        for name, swap in decisions:
            self.swap_lifetimes(name, swap, first, last, size)
            ends.append(len(first))
        return SwapDelta(np.asarray(first, dtype=np.int64), np.asarray(last, dtype=np.int64),
                         np.asarray(size, dtype=np.int64), tuple(ends), tuple(decisions))

    def _copies(self, decisions: Sequence[tuple[str, Swap]]) -> list[Copy]:
        """The copies and waits of ``decisions`` in ``lower``'s order: by key, swap-outs in the
        order of their op's outputs, swap-ins issued after one op in the decisions' order."""
        graph, index, key = self.graph, self.graph.index, keys.key
        copies: list[Copy] = []
        for sequence, (name, swap) in enumerate(decisions):
            produced_at, size_bytes = self.produced_at[name], graph.tensors[name].size_bytes
            rank = graph.ops[produced_at].outputs.index(name)
            copies.append((key(produced_at, keys.SWAP_OUT), rank, "swap_out", name, -1, size_bytes))
            for copy, swap_in in enumerate(swap.swap_ins):
                tie = sequence * 1024 + copy
                copies.append((key(index[swap_in.after], keys.SWAP_IN), tie, "swap_in", name, copy,
                               size_bytes))
                first_reader = min(index[c] for c in swap_in.consumers)
                copies.append((key(first_reader, keys.WAIT), 0, "wait", name, copy, size_bytes))
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
        step = keys.StepFunction(first, last, size)
        # the ops whose compute lies in each piece (before the first point the change is 0)
        ops = keys.first_compute_from(step.points, self.op_count)
        low = np.concatenate(([0], ops))
        high = np.concatenate((ops, [self.op_count]))
        at_compute = self._range_max(low, high) + step.values
        return int(max(self.resident_bytes, at_compute.max()))

    def _sparse_pays(self, changes: int) -> bool:
        """The sparse path has a fixed cost per query and one that grows with the changes; the
        dense one a pass over every op. So sparse only on long steps with few changes (the
        thresholds from ``bench/profile_speed.py``; both paths give the same peak)."""
        return self.op_count > 8192 and 256 * changes < self.op_count

    def _dense_peak(self, first: np.ndarray, last: np.ndarray, size: np.ndarray) -> int:
        """The peak from the change at every op's compute: each changed lifetime covers the
        computes from the first at or after its first key to the last at or before its last."""
        change = keys.covered_computes(first, last, size, self.op_count)
        return int(max(self.resident_bytes, (self.high_bytes + change).max()))

    def step_time_s(self, delta: SwapDelta, hardware: Hardware, count: int | None = None) -> float:
        """``simulate(graph, plan, hardware).step_time_s`` of the first ``count`` decisions'
        plan (default: all), to the bit: the same additions in the same order (the Keep plan's
        clock until a copy stalls compute, then a running sum restarted at each stall; see
        ``ComputeClock``). Walks the copies, and the ops after the first stall.

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
        after = [c[0] // keys.STRIDE + 1 for c in moved]
        copy_s = [hardware.d2h_time_s(c[5]) if c[2] == "swap_out" else hardware.h2d_time_s(c[5])
                  for c in moved]
        durations = np.insert(self.op_time_s, after, copy_s) if moved else self.op_time_s
        return float(np.cumsum(np.concatenate(([0.0], durations)))[-1])

    def _async_time_s(self, copies: list[Copy], hardware: Hardware) -> float:
        """The simulator's four-stream clock over the copies in program order; the compute
        stream's ends come from ``ComputeClock``, the copy streams' from ``CopyLink``."""
        link = CopyLink(hardware)
        out_end: dict[str, float] = {}
        in_end: dict[tuple[str, int], float] = {}
        wait_ops = sorted({c[0] // keys.STRIDE for c in copies if c[2] == "wait"})
        clock = ComputeClock(self.op_times, self.keep_end_s, wait_ops)
        for at_key, _, kind, tensor, copy, size_bytes in copies:
            op = at_key // keys.STRIDE
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


