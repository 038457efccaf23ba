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
    The binary searches need hundreds of peak evaluations on a 10,000-op graph, so they ask the
    incremental profile (``memfit.model.profile.BaseProfile``: the Keep plan's profile plus each
    swap's changed lifetimes, the peak of every prefix of the decisions to the byte) and rank
    rungs by its step time (the simulator's clock, to the bit, walked over the copies with the
    ops' times summed in numpy; ``simulate`` itself on a graph with collectives). The plan returned is the fastest whose peak, simulated
    by ``memfit.model.simulate`` itself, fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Swap
from memfit.model.host_memory import host_prefix
from memfit.model.profile import BaseProfile, SwapDelta
from memfit.model.schedule import live_buffers, lower, memory_profile
from memfit.model.simulate import simulate
from memfit.planning.strategies._budget_checks import fits

if TYPE_CHECKING:
    from memfit.planning.strategies.swapping._swap_config import SwapConfig

Decide = Callable[["SwapConfig"], list[tuple[str, Swap]]]
MakePlan = Callable[["SwapConfig", Iterable[tuple[str, Swap]]], Plan]


def tune(graph: CostGraph, hardware: Hardware, budget_bytes: int, config: SwapConfig,
         given: frozenset[str], decide: Decide, make_plan: MakePlan) -> Plan:
    """The fastest plan whose simulated peak fits ``budget_bytes``, tuning what is not ``given``.

    Raises:
        BudgetError: if nothing fits, with the smallest peak reached and what is live there.
    """
    search = _TunerSearch(graph, hardware, budget_bytes, BaseProfile.of(graph), decide, make_plan)
    tune_n = "n_tensors" not in given
    if tune_n and search.model.keep_peak_bytes <= budget_bytes:
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
    model: BaseProfile
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
        events = self.model.swaps(decisions)
        full_peak = self.model.peak_bytes(events, len(decisions))
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
                if self.model.peak_bytes(events, middle) <= self.budget_bytes:
                    count = middle
                else:
                    low = middle
        used = replace(config, n_tensors=count) if tune_n else config
        plan = self.make_plan(used, decisions[:count])
        time_s = self.step_time_s(events, count, plan)
        self.fitting.append((time_s, self.model.peak_bytes(events, count), plan))
        return time_s

    def step_time_s(self, events: SwapDelta, count: int, plan: Plan) -> float:
        """The step time of ``plan``, the first ``count`` decisions of ``events``: from the
        profile's clock, or the simulator's on a graph with collectives (not in that clock)."""
        if self.model.has_collectives:
            return simulate(self.graph, plan, self.hardware, record_intervals=False).step_time_s
        return self.model.step_time_s(events, self.hardware, count)

    def budget_error(self) -> BudgetError:
        if self.smallest is None:  # unreachable: every search evaluates at least one rung
            return BudgetError(self.budget_bytes, self.graph.resident_bytes, strategy="swap")
        schedule = lower(self.graph, self.smallest[1])
        profile = memory_profile(schedule)
        return BudgetError(self.budget_bytes, profile.peak_bytes,
                           live_buffers(schedule, profile.peak_index), strategy="swap",
                           host_bytes=self.hardware.host_bytes if self.host_limited else None)
