"""Schedules, memory profiles and simulations remembered for the span of one planning call.

Why: a plan search lowers and simulates the same plan more than once (a strategy checks its plan
against the budget, then ``auto`` simulates it; the plans at the what-if budgets repeat the
candidates that do not depend on the budget; the chosen plan is simulated for its explanation and
again for the result). Inside ``plans_remembered`` each of ``lower``, ``memory_profile`` and
``simulate`` computes once per graph and plan content; outside it nothing is kept.

The invariant: a remembered result is the one the call would compute, since each is a pure
function of its key: the graph object (kept alive while remembered, so its ``id`` is not reused),
the plan's content that lowering reads (graph hash, decisions, re-runs) and, for a simulation,
the plan's strategy name (in the timeline's ``meta``), the hardware object and
``record_intervals``. A plan of several regions is never remembered. ``remembered_result``
keeps other pure results the same way (the separator-block DP's choice per budget).
"""

from __future__ import annotations

import contextvars
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from memfit.data.costgraph import CostGraph
from memfit.data.plan import Plan

SCHEDULES_KEPT = 8  # schedules are large (one action per op): only the latest few are kept
Found = TypeVar("Found")


class _Memo:
    """What one ``plans_remembered`` span has computed."""

    def __init__(self) -> None:
        self.kept: dict[int, Any] = {}  # id -> object, so that no id in a key is reused
        self.schedules: OrderedDict[Hashable, Any] = OrderedDict()
        self.profiles: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # id(schedule) ->
        self.timelines: dict[Hashable, Any] = {}
        self.results: dict[Hashable, Any] = {}  # remembered_result's

    def identity(self, thing: Any) -> int:
        self.kept[id(thing)] = thing
        return id(thing)


_SCOPE: contextvars.ContextVar[_Memo | None] = contextvars.ContextVar("memfit_plan_memo",
                                                                      default=None)


@contextmanager
def plans_remembered() -> Iterator[None]:
    """Remember schedules, memory profiles and simulations until the block ends (nested: the
    outermost span's memory is used)."""
    if _SCOPE.get() is not None:
        yield
        return
    token = _SCOPE.set(_Memo())
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _plan_key(memo: _Memo, graph: CostGraph, plan: Plan) -> Hashable | None:
    if plan.regions:
        return None
    return (memo.identity(graph), plan.graph_hash, plan.reruns,
            frozenset(plan.decisions.items()))


def remembered_schedule(graph: CostGraph, plan: Plan, make: Callable[[], Found]) -> Found:
    """``make()`` (``lower(graph, plan)``), once per graph and plan content inside a span."""
    memo = _SCOPE.get()
    key = None if memo is None else _plan_key(memo, graph, plan)
    if memo is None or key is None:
        return make()
    if key in memo.schedules:
        memo.schedules.move_to_end(key)
        return memo.schedules[key]
    found = make()
    memo.schedules[key] = found
    if len(memo.schedules) > SCHEDULES_KEPT:
        memo.schedules.popitem(last=False)
    return found


def remembered_profile(schedule: Any, make: Callable[[], Found]) -> Found:
    """``make()`` (``memory_profile(schedule)``), once per schedule object inside a span."""
    memo = _SCOPE.get()
    if memo is None:
        return make()
    entry = memo.profiles.get(id(schedule))
    if entry is not None and entry[0] is schedule:
        memo.profiles.move_to_end(id(schedule))
        return entry[1]
    found = make()
    memo.profiles[id(schedule)] = (schedule, found)  # holds the schedule: its id stays its own
    if len(memo.profiles) > SCHEDULES_KEPT:
        memo.profiles.popitem(last=False)
    return found


def remembered_timeline(graph: CostGraph, plan: Plan, hardware: Any, record_intervals: bool,
                        make: Callable[[], Found]) -> Found:
    """``make()`` (``simulate(graph, plan, hardware, record_intervals)``), once per graph, plan
    content, strategy name, hardware and ``record_intervals`` inside a span."""
    memo = _SCOPE.get()
    key = None if memo is None else _plan_key(memo, graph, plan)
    if memo is None or key is None:
        return make()
    key = (key, plan.strategy, memo.identity(hardware), record_intervals)
    if key not in memo.timelines:
        memo.timelines[key] = make()
    return memo.timelines[key]


def remembered_result(name: str, kept: tuple[Any, ...], key: Hashable,
                      make: Callable[[], Found]) -> Found:
    """``make()``, once per ``name``, objects ``kept`` (by identity: held while remembered) and
    ``key`` inside a span; every time outside one. ``make`` must be a pure function of them, and
    what it returns is shared: its readers must not change it."""
    memo = _SCOPE.get()
    if memo is None:
        return make()
    full = (name, tuple(memo.identity(thing) for thing in kept), key)
    if full not in memo.results:
        memo.results[full] = make()
    return memo.results[full]
