"""Re-runs in the incremental memory model: the lifetimes a set of re-runs changes, in
program-order keys (``memfit.model.keys``), and the per-op figures the recompute planners read.

Why: the segment planner (``memfit.planning.solvers.segments``) prices about a thousand candidate
segments of a captured step, each a plan that recomputes a few dozen tensors; the checkpoint and
optimal-recompute strategies price a few whole plans. Lowering the whole program for each would
dominate planning; this walks only the re-runs, what they read and what they replace, and reads the
change against the Keep plan's profile (``KeepProfile``) with numpy. It follows ``lower`` and
``memory_profile`` rule for rule (program order, the newest instance read, freed after the last
reader), and ``tests/model/test_rerun_delta.py`` holds every figure ``==`` to a lowering.

Keys do not move when re-runs are inserted (a re-run before op ``p`` is ``key(p, rank)``), so a
change is a plain list of lifetimes, and a base other than Keep (a swap plan) is one more set of
lifetimes (``BaseProfile.plan``). Figures are *folded* onto the graph's ops: an op's high bytes
are the most over its group (the re-runs placed before it, its waits, its compute, its copies),
its live bytes those after its group.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from memfit.data.plan import Plan, Recompute, Swap
from memfit.model.keep_profile import KeepProfile
from memfit.model.keys import (
    COMPUTE,
    STRIDE,
    SWAP_IN,
    SWAP_OUT,
    WAIT,
    StepFunction,
    covered_computes,
    first_compute_from,
    key,
)
from memfit.model.recompute import PlannedRerun, decided_reruns, planned_reruns, rerun_deadlines

Grouped = dict[str, list[PlannedRerun]]  # op -> the re-runs placed right before it, in order


@dataclass(frozen=True, eq=False)
class RerunDelta:
    """The change a plan's re-runs (and copies, for a swap plan) make to the Keep plan.

    Args:
        first_key, last_key, size_bytes: changed lifetimes (a negative size removes bytes).
        action_keys: sorted keys of the actions the plan adds between the ops' computes
            (re-runs, copies, waits): where an op's folded high bytes may come from.
        recompute_s: the run time of every re-run (summed in program order, as before).
        reruns: how many re-runs the plan makes.
    """

    first_key: np.ndarray
    last_key: np.ndarray
    size_bytes: np.ndarray
    action_keys: np.ndarray
    recompute_s: float
    reruns: int

    @cached_property
    def step(self) -> StepFunction:
        """The change as a function of the key (built on the first sparse query, then kept:
        the segment DP reads ``change_at`` and ``most_change`` of the same delta)."""
        return StepFunction(self.first_key, self.last_key, self.size_bytes)

    @cached_property
    def action_ops(self) -> np.ndarray:
        """The op of each added action (sorted, as the keys are)."""
        return self.action_keys // STRIDE

    @cached_property
    def touched_ops(self) -> np.ndarray:
        """The ops whose group gains actions (sorted, unique)."""
        ops = self.action_ops
        return ops[np.concatenate(([True], ops[1:] != ops[:-1]))] if ops.size else ops

    def __add__(self, other: RerunDelta) -> RerunDelta:
        """Both changes: valid for decisions on disjoint buffers (``BaseProfile.plan`` builds
        a plan's swaps and re-runs jointly and checks that)."""
        return RerunDelta(np.concatenate((self.first_key, other.first_key)),
                          np.concatenate((self.last_key, other.last_key)),
                          np.concatenate((self.size_bytes, other.size_bytes)),
                          np.sort(np.concatenate((self.action_keys, other.action_keys))),
                          self.recompute_s + other.recompute_s, self.reruns + other.reruns)


@dataclass(frozen=True, eq=False)
class FoldedProfile:
    """Device bytes of one plan per op of the graph (``BaseProfile.folded``).

    Args:
        high_bytes: for op ``i``, the most bytes live while any action of its group runs.
        live_bytes: bytes live right after op ``i``'s group (its dead buffers freed).
        recompute_s, reruns: the plan's re-runs' run time and count.
    """

    high_bytes: np.ndarray
    live_bytes: np.ndarray
    recompute_s: float
    reruns: int

    @property
    def peak_bytes(self) -> int:
        return int(self.high_bytes.max(initial=0))


def recomputes(base: KeepProfile, recomputed: Iterable[str]) -> RerunDelta:
    """The change of ``Recompute()`` for every tensor of ``recomputed`` (the planners' hot path:
    no plan object, the late readers found once per graph)."""
    grouped: Grouped = {}
    for rerun in decided_reruns(base.graph, set(recomputed), base.first_late_reader):
        grouped.setdefault(rerun.before, []).append(rerun)
    return _rerun_delta(base, grouped, _Lifetimes())


def plan_delta(base: KeepProfile, plan: Plan) -> RerunDelta:
    """The change of a whole plan: its swaps, ``Recompute`` decisions and ``Plan.reruns``.

    Raises:
        ValueError: for re-runs that read or rebuild a swapped tensor, and swap-ins that feed
            re-runs (not modelled: ``simulate`` prices those plans).
    """
    graph, index = base.graph, base.graph.index
    grouped = planned_reruns(graph, plan)
    swaps = [(name, d) for name, d in plan.decisions.items() if isinstance(d, Swap)]
    if swaps:
        recomputed = {name for name, d in plan.decisions.items() if isinstance(d, Recompute)}
        read = {t for reruns in grouped.values() for r in reruns for t in graph.op(r.op).inputs}
        clash = (recomputed | read) & {name for name, _ in swaps}
        if clash:
            raise ValueError(f"re-runs read or rebuild swapped tensors {sorted(clash)[:4]}")
    lifetimes = _Lifetimes()
    for name, swap in swaps:
        base.swap_lifetimes(name, swap, lifetimes.first, lifetimes.last, lifetimes.size)
        lifetimes.actions.append(key(base.produced_at[name], SWAP_OUT))
        for swap_in in swap.swap_ins:
            lifetimes.actions.append(key(index[swap_in.after], SWAP_IN))
            lifetimes.actions.append(key(min(index[c] for c in swap_in.consumers), WAIT))
    return _rerun_delta(base, grouped, lifetimes)


def rerun_time_s(base: KeepProfile, recomputed: Iterable[str]) -> float:
    """The run time of the re-runs recomputing ``recomputed`` implies: ``recomputes``'
    ``recompute_s`` (to rounding: summed in another order) without walking lifetimes, a fifth
    of its cost on a 48-layer GPT-2. For bounds that skip plans not worth pricing."""
    op = base.graph.op
    deadline = rerun_deadlines(base.graph, set(recomputed), base.first_late_reader)
    return sum(op(producer).time_s for producer in deadline)


class _Lifetimes:
    """Changed lifetimes and added action keys, as they are found."""

    def __init__(self) -> None:
        self.first: list[int] = []
        self.last: list[int] = []
        self.size: list[int] = []
        self.actions: list[int] = []


def _rerun_delta(base: KeepProfile, grouped: Grouped, lifetimes: _Lifetimes) -> RerunDelta:
    """``lifetimes`` plus those ``grouped``'s re-runs change, walked in program order."""
    index, op_named = base.graph.index, base.op_named
    walk = _RerunWalk(base)
    actions = lifetimes.actions
    for before in sorted(grouped, key=index.__getitem__):  # the hot loop of segment pricing
        position = index[before]
        for slot, rerun in enumerate(grouped[before]):
            action = position * STRIDE + slot
            walk.rerun(rerun, position, action)
            actions.append(action)
    walk.changes(lifetimes)
    first, last, size = (np.asarray(v, dtype=np.int64)
                         for v in (lifetimes.first, lifetimes.last, lifetimes.size))
    return RerunDelta(first, last, size, np.sort(np.asarray(lifetimes.actions, dtype=np.int64)),
                      sum(op_named[r.op].time_s for reruns in grouped.values() for r in reruns),
                      sum(len(reruns) for reruns in grouped.values()))


class _RerunWalk:
    """The buffer lifetimes re-runs change, in keys."""

    def __init__(self, base: KeepProfile) -> None:
        self.base = base
        self.newest: dict[str, str] = {}  # tensor -> the instance later readers read
        self.replaced: dict[str, tuple[int, str]] = {}  # tensor -> (op, instance): last rebuild
        self.earlier: dict[str, list[tuple[int, str]]] = {}  # the rebuilds before (``Plan.reruns``)
        self.rerun_reads: dict[str, int] = {}  # buffer -> key of the last re-run reading it
        self.allocated: dict[str, tuple[int, int]] = {}  # instance -> (key, bytes)

    def rerun(self, rerun: PlannedRerun, before_index: int, action: int) -> None:
        """Note re-run ``rerun`` at key ``action``; re-runs come in program order, so each read
        is the latest so far."""
        op = self.base.op_named[rerun.op]
        newest, rerun_reads, replaced = self.newest, self.rerun_reads, self.replaced
        size_bytes, allocated, replaces = self.base.size_bytes, self.allocated, rerun.replaces
        newest_of = newest.get
        for tensor in op.inputs:
            rerun_reads[newest_of(tensor, tensor)] = action
        for tensor in op.outputs:
            instance = f"{tensor}#{action}"
            allocated[instance] = (action, size_bytes[tensor])
            if tensor in replaces:
                newest[tensor] = instance
                if tensor in replaced:
                    self.earlier.setdefault(tensor, []).append(replaced[tensor])
                replaced[tensor] = (before_index, instance)

    def changes(self, lifetimes: _Lifetimes) -> None:
        """Add every changed lifetime to ``lifetimes``: the originals re-runs read later or
        replace (removed, re-added to their new last read) and the new instances."""
        base = self.base
        produced_at, keep_last, bytes_of = base.produced_at, base.last_key, base.size_bytes
        last_read = self._last_reads()
        read_last = last_read.get
        first, last, size = lifetimes.first, lifetimes.last, lifetimes.size
        replaced = self.replaced
        for tensor in {*replaced, *(b for b in self.rerun_reads if b in keep_last)}:
            old_end = keep_last.get(tensor)
            if old_end is None:
                continue  # step outputs and resident tensors are never freed
            start = produced_at[tensor] * STRIDE + COMPUTE
            if tensor in replaced:
                new_end = max(start, read_last(tensor, start))
            else:  # only re-runs read it again, later
                new_end = max(start, last_read[tensor], old_end)
            if new_end != old_end:
                size_bytes = bytes_of[tensor]
                first += (start, start)
                last += (old_end, new_end)
                size += (-size_bytes, size_bytes)
        for instance, (action, size_bytes) in self.allocated.items():  # the hot loop
            end = read_last(instance, action)
            first.append(action)
            last.append(end if end > action else action)
            size.append(size_bytes)

    def _last_reads(self) -> dict[str, int]:
        """Buffer -> key of its last read: re-runs' reads, and each op's read of the instance
        it finds (the original before the first rebuild, from each rebuild on its instance)."""
        readers_of, bisect_left, earlier = self.base.readers, bisect.bisect_left, self.earlier
        last_read = dict(self.rerun_reads)
        read_last = last_read.get
        for tensor, last_rebuild in self.replaced.items():
            readers = readers_of[tensor]
            rebuilds = [*earlier[tensor], last_rebuild] if tensor in earlier else [last_rebuild]
            cut = bisect_left(readers, rebuilds[0][0])
            if cut:  # readers before the first rebuild read the original
                read = readers[cut - 1] * STRIDE + COMPUTE
                before = read_last(tensor, -1)
                last_read[tensor] = read if read > before else before
            for number, (_, instance) in enumerate(rebuilds):  # one, for ``Recompute``
                end = (bisect_left(readers, rebuilds[number + 1][0], cut)
                       if number + 1 < len(rebuilds) else len(readers))
                if end > cut:
                    read = readers[end - 1] * STRIDE + COMPUTE
                    before = read_last(instance, -1)
                    last_read[instance] = read if read > before else before
                cut = end
        return last_read


def folded(base: KeepProfile, delta: RerunDelta) -> FoldedProfile:
    """Every op's folded high bytes and live bytes under ``delta`` (dense: O(ops + m))."""
    count = base.op_count
    high = base.high_bytes + covered_computes(delta.first_key, delta.last_key, delta.size_bytes,
                                              count)
    if delta.action_keys.size:
        keys = delta.action_keys
        np.maximum.at(high, keys // STRIDE, _between(base, keys) + delta.step(keys))
    after = np.zeros(count + 1, dtype=np.int64)  # a lifetime is live after ops first..last-1
    np.add.at(after, np.minimum(delta.first_key // STRIDE, count), delta.size_bytes)
    np.add.at(after, np.minimum(delta.last_key // STRIDE, count), -delta.size_bytes)
    live = base.live_after + np.cumsum(after[:-1])
    return FoldedProfile(high, live, delta.recompute_s, delta.reruns)


def change_at(base: KeepProfile, delta: RerunDelta, ops: np.ndarray) -> np.ndarray:
    """``folded(base, delta).high_bytes[ops] - base.high_bytes[ops]``, reading only those ops:
    the change at their compute, and the exact fold where the plan adds actions to their group."""
    ops = np.asarray(ops, dtype=np.int64)
    found = delta.step(ops * STRIDE + COMPUTE)
    touched = _members(ops, delta.touched_ops)
    if touched.any():
        found[touched] = _exact(base, delta, ops[touched]) - base.high_bytes[ops[touched]]
    return found


def most_change(base: KeepProfile, delta: RerunDelta, counted: np.ndarray) -> int | None:
    """The largest ``change_at`` over the ops that ``counted`` counts (``counted[i]``: how many
    of ops ``0..i-1`` are in the set, length ops + 1); ``None`` for an empty set.

    Between two breakpoints of the change, every op that gains no action changes alike: each
    such piece with a member counts its value; members that gain actions count exactly."""
    if counted[-1] == 0:
        return None
    step = delta.step
    bounds = np.concatenate(([0], first_compute_from(step.points, base.op_count),
                             [base.op_count]))  # piece j: ops bounds[j]..bounds[j+1]-1
    members = counted[bounds[1:]] - counted[bounds[:-1]]
    touched = delta.touched_ops
    touched_in = touched[(counted[touched + 1] - counted[touched]) > 0]
    touched_members = np.zeros(len(members), dtype=np.int64)
    np.add.at(touched_members, np.searchsorted(bounds, touched_in, "right") - 1, 1)
    values = step.values[members > touched_members]
    exact = change_at(base, delta, touched_in)
    return int(np.concatenate((values, exact)).max())


def _between(base: KeepProfile, keys: np.ndarray) -> np.ndarray:
    """The Keep plan's bytes live at keys between computes: a key before op ``p``'s compute
    (re-runs, waits) sees those live after op ``p - 1``; one after it (copies), after op ``p``."""
    ops = keys // STRIDE
    return np.where(keys % STRIDE < COMPUTE, base.live_before[ops], base.live_after[ops])


def _exact(base: KeepProfile, delta: RerunDelta, ops: np.ndarray) -> np.ndarray:
    """The folded high bytes of ``ops``: the most over their compute and added actions."""
    unique, inverse = np.unique(ops, return_inverse=True)
    high = base.high_bytes[unique] + delta.step(unique * STRIDE + COMPUTE)
    keys = delta.action_keys[_members(delta.action_ops, unique)]
    np.maximum.at(high, np.searchsorted(unique, keys // STRIDE),
                  _between(base, keys) + delta.step(keys))
    return high[inverse]


def _members(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each value is in ``sorted_set`` (``np.isin`` by bisection: cheaper on the few
    ops a segment's re-runs touch)."""
    if not sorted_set.size:
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[at] == values
