"""Tune TFLMS to a budget: the search of the paper's section 5.2, done by simulation.

TFLMS's authors tune two knobs by hand: ``n_tensors`` (more tensors swapped, lower peak) and ``lb``
(a larger lb prefetches earlier: less stall, higher peak), and turn on ``swap_branches`` for
U-Net-like models. Here, for each ``lb`` of a Fibonacci ladder (1, 2, 3, 5, 8, ...), a binary
search finds the smallest ``n_tensors`` whose peak fits (the peak is near-monotone non-increasing
in ``n_tensors``); the fastest of those plans by simulated step time wins. Parameters the user gave
stay fixed. If the unplanned step already fits, nothing is swapped (``n_tensors=0``).
``swap_branches`` is turned on (with ``branch_threshold = threshold`` unless given, so that only
edges the rewriting threshold calls long are swapped) only if nothing fits without it.

The ladder stops after two rungs in a row where even swapping every candidate does not fit (the
peak grows with lb), after two rungs in a row that are not faster, or at a plan whose step time is
the bare compute time (no plan can beat it). With no fitting plan, ``BudgetError`` reports the
lowest peak any rung reached with all its candidates swapped, and what is live at that peak.

``hardware.host_bytes`` bounds ``n_tensors``: a rung swaps at most the longest prefix of its
candidates that the host holds at once (the host peak only grows with ``n_tensors``); a rung
whose given ``n_tensors`` swaps more does not fit, and the error then names ``host_bytes``.

Note:
    The binary searches need hundreds of peak evaluations on a 10,000-op graph; ``PeakModel``
    computes the program-order peak of ``memory_profile(lower(graph, plan))`` from per-op arrays
    in numpy instead of building the action list (tests check that the two agree to the byte).
    Likewise ``step_time_s`` is the simulator's clock walked over ops (also checked against
    ``memfit.model.simulate``). The plan returned is the fastest whose peak, simulated by
    ``memfit.model.simulate`` itself, fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Swap
from memfit.model.host_memory import host_prefix
from memfit.model.schedule import live_buffers, lower, memory_profile
from memfit.model.simulate import simulate
from memfit.planning.strategies._budget_checks import fits

if TYPE_CHECKING:
    from memfit.planning.strategies.swapping._swap_config import SwapConfig

Decisions = Sequence[tuple[str, Swap]]
Decide = Callable[["SwapConfig"], list[tuple[str, Swap]]]
MakePlan = Callable[["SwapConfig", Iterable[tuple[str, Swap]]], Plan]


def tune(graph: CostGraph, hardware: Hardware, budget_bytes: int, config: SwapConfig,
         given: frozenset[str], decide: Decide, make_plan: MakePlan) -> Plan:
    """The fastest plan whose simulated peak fits ``budget_bytes``, tuning what is not ``given``.

    Raises:
        BudgetError: if nothing fits, with the smallest peak reached and what is live there.
    """
    search = _TunerSearch(graph, hardware, budget_bytes, PeakModel(graph), decide, make_plan)
    tune_n = "n_tensors" not in given
    if tune_n and search.model.peak(search.model.events([]), 0) <= budget_bytes:
        unplanned = make_plan(replace(config, n_tensors=0), [])  # nothing needs swapping
        if simulate(graph, unplanned, hardware, record_intervals=False).peak_bytes <= budget_bytes:
            return unplanned
    for branches in [config.swap_branches] if "swap_branches" in given else [False, True]:
        setting = replace(config, swap_branches=branches)
        if branches and not {"swap_branches", "branch_threshold"} & given:
            setting = replace(setting, branch_threshold=config.threshold)
        search.ladder(setting, _lb_ladder(config, given, len(graph.ops)), tune_n)
        if search.fitting:
            break
    for _, _, plan in sorted(search.fitting, key=lambda item: item[:2]):
        if fits(simulate(graph, plan, hardware, record_intervals=False), budget_bytes,
                hardware.host_bytes):
            return plan  # the simulator has the last word on memory
    raise search.budget_error()


def _lb_ladder(config: SwapConfig, given: frozenset[str], op_count: int) -> list[int]:
    """``[lb]`` if given, else 1, 2, 3, 5, 8, ... up to ``ub`` (and the graph's length)."""
    if "lb" in given:
        return [config.lb]
    top = min(config.ub, max(op_count, 1))
    ladder, a, b = [], 1, 2
    while a <= top:
        ladder.append(a)
        a, b = b, a + b
    return ladder or [config.ub]


@dataclass
class _TunerSearch:
    """The state of one tuning run: the plans that fit (each with its simulated time and peak)
    and the plan with the lowest peak seen."""

    graph: CostGraph
    hardware: Hardware
    budget_bytes: int
    model: PeakModel
    decide: Decide
    make_plan: MakePlan
    fitting: list[tuple[float, int, Plan]] = field(default_factory=list)
    smallest: tuple[int, Plan] | None = None
    host_limited: bool = False  # some rung swapped fewer tensors for hardware.host_bytes

    def ladder(self, config: SwapConfig, lbs: list[int], tune_n: bool) -> None:
        """Try each lb; stop after two rungs in a row that do not fit or do not get faster, or
        at a plan that hides every copy (no plan is faster than the compute alone)."""
        best_s, misses, stale = float("inf"), 0, 0
        for lb in lbs:
            time_s = self.rung(replace(config, lb=lb), tune_n)
            if time_s is not None and time_s <= self.graph.step_time_s * (1 + 1e-9):
                return
            if time_s is None:
                misses += 1
            elif time_s < best_s * (1 - 1e-9):
                best_s, misses, stale = time_s, 0, 0
            else:
                misses, stale = 0, stale + 1
            if misses >= 2 or stale >= 2:
                return

    def rung(self, config: SwapConfig, tune_n: bool) -> float | None:
        """The fitting plan with the fewest swapped tensors at this lb, and its time (or None)."""
        decisions = self.decide(replace(config, n_tensors=-1) if tune_n else config)
        held = host_prefix(self.graph, decisions, self.hardware.host_bytes)
        if held < len(decisions):  # the first ``held`` swaps are all the host holds
            self.host_limited, decisions = True, decisions[:held]
            if not tune_n:
                return None
        events = self.model.events(decisions)
        full_peak = self.model.peak(events, len(decisions))
        if self.smallest is None or full_peak < self.smallest[0]:
            count = len(decisions) if tune_n else config.n_tensors
            self.smallest = (full_peak, self.make_plan(replace(config, n_tensors=count), decisions))
        if full_peak > self.budget_bytes:
            return None
        count = len(decisions)
        if tune_n:  # the smallest count that fits; count 0 (nothing swapped) is known not to
            low = 0
            while count - low > 1:
                middle = (low + count) // 2
                if self.model.peak(events, middle) <= self.budget_bytes:
                    count = middle
                else:
                    low = middle
        used = replace(config, n_tensors=count) if tune_n else config
        plan = self.make_plan(used, decisions[:count])
        time_s = step_time_s(self.graph, plan, self.hardware)
        self.fitting.append((time_s, self.model.peak(events, count), plan))
        return time_s

    def budget_error(self) -> BudgetError:
        if self.smallest is None:  # unreachable: every search evaluates at least one rung
            return BudgetError(self.budget_bytes, self.graph.resident_bytes, strategy="swap")
        schedule = lower(self.graph, self.smallest[1])
        profile = memory_profile(schedule)
        return BudgetError(self.budget_bytes, profile.peak_bytes,
                           live_buffers(schedule, profile.peak_index), strategy="swap",
                           host_bytes=self.hardware.host_bytes if self.host_limited else None)


@dataclass(frozen=True)
class _Events:
    """Changes to the per-op free / swap-in arrays made by each decision, in decision order."""

    positions: np.ndarray
    deltas: np.ndarray
    ends: list[int]  # ends[k]: number of events of the first k decisions


class PeakModel:
    """The program-order peak of ``lower(graph, plan)``, from per-op arrays.

    Per op ``k`` the rewritten program allocates the op's outputs (a possible peak), frees the
    buffers last read by it or by the swap-outs after it, then allocates the copies swapped in
    after it (another possible peak). A swap moves the original's free to its last unserved
    reader (or its producer) and adds each copy: allocated after the control op, freed after its
    last consumer.
    """

    def __init__(self, graph: CostGraph):
        self.graph, self.index, self.size = graph, graph.index, len(graph.ops)
        self.resident = graph.resident_bytes
        self.alloc = np.zeros(self.size, np.int64)
        self.free = np.zeros(self.size, np.int64)
        self.last_read: dict[str, int] = {}
        for position, op in enumerate(graph.ops):
            self.alloc[position] = sum(graph.tensors[t].size_bytes for t in op.outputs)
        for tensor in graph.tensors.values():
            if tensor.producer is not None and not tensor.is_output:
                last = max([self.index[tensor.producer], *map(self.index.__getitem__, tensor.consumers)])
                self.free[last] += tensor.size_bytes
                self.last_read[tensor.name] = last

    def events(self, decisions: Decisions) -> _Events:
        positions: list[int] = []
        deltas: list[int] = []
        ends = [0]
        for name, swap in decisions:
            tensor = self.graph.tensors[name]
            served = {c for swap_in in swap.swap_ins for c in swap_in.consumers}
            unserved = [self.index[c] for c in tensor.consumers if c not in served]
            produced_at = self.index[str(tensor.producer)]  # swapped tensors have a producer
            positions += [self.last_read[name], max(unserved, default=produced_at)]
            deltas += [-tensor.size_bytes, tensor.size_bytes]
            for swap_in in swap.swap_ins:
                positions += [self.size + self.index[swap_in.after],
                              max(self.index[c] for c in swap_in.consumers)]
                deltas += [tensor.size_bytes, tensor.size_bytes]
            ends.append(len(positions))
        return _Events(np.array(positions, np.int64), np.array(deltas, np.int64), ends)

    def peak(self, events: _Events, count: int) -> int:
        """The peak with the first ``count`` decisions applied."""
        change = np.zeros(2 * self.size, np.int64)
        end = events.ends[count]
        np.add.at(change, events.positions[:end], events.deltas[:end])
        net = self.alloc - (self.free + change[: self.size]) + change[self.size:]
        after = self.resident + np.cumsum(net)
        during = after - net + self.alloc
        return int(max(self.resident, during.max(initial=0), after.max(initial=0)))


def step_time_s(graph: CostGraph, plan: Plan, hardware: Hardware) -> float:
    """``simulate(graph, plan, hardware).step_time_s``, without building the action list.

    The same clock as ``memfit.model.simulate`` walked over ops: compute back to back; a swap-out
    on the D2H stream after its producer; a swap-in on the H2D stream (one shared FIFO without
    ``duplex``) after its control op and its swap-out, in ``lower``'s order; the first consumer
    waits for its copy; without ``async_copies`` every copy runs on the compute thread. The
    tests check that it equals the simulator's figure.
    """
    index = graph.index
    swapped: dict[str, int] = {}
    ins: dict[int, list[tuple[str, int, int]]] = {}
    waits: dict[int, list[tuple[str, int]]] = {}
    for name, decision in plan.decisions.items():
        if isinstance(decision, Swap):
            swapped[name] = size = graph.tensors[name].size_bytes
            for copy, swap_in in enumerate(decision.swap_ins):
                ins.setdefault(index[swap_in.after], []).append((name, copy, size))
                waits.setdefault(min(index[c] for c in swap_in.consumers), []).append((name, copy))
    sync, duplex = not hardware.async_copies, hardware.duplex
    compute = d2h = h2d = 0.0
    out_end: dict[str, float] = {}
    in_end: dict[tuple[str, int], float] = {}
    for position, op in enumerate(graph.ops):
        for key in waits.get(position, ()) if not sync else ():
            compute = max(compute, in_end[key])
        compute += op.time_s
        for tensor in op.outputs if swapped else ():
            if tensor in swapped and sync:
                compute += hardware.d2h_time_s(swapped[tensor])
            elif tensor in swapped:
                d2h = out_end[tensor] = max(compute, d2h) + hardware.d2h_time_s(swapped[tensor])
                h2d = h2d if duplex else d2h
        for name, copy, size in ins.get(position, ()):
            if sync:
                compute += hardware.h2d_time_s(size)
            else:
                h2d = in_end[(name, copy)] = max(compute, out_end[name], h2d) + hardware.h2d_time_s(size)
                d2h = d2h if duplex else h2d
    return compute if sync else max(compute, d2h, h2d)
