"""One planning pipeline: a step's ``CostGraph`` planned under a whole-device budget, torch-free.

``plan_step`` is what ``memfit.backend`` (so ``fit`` and ``compile``), ``memfit.plan``,
``max_batch_size`` and the CLI call: it resolves the parsed ``Budget`` once into a
``DeviceBudget`` (the whole device's bytes and the bytes outside the graph), plans with the
strategy, explains the plan and simulates it. The strategies see graph bytes
(``DeviceBudget.graph_bytes``); everything a user reads is whole-device bytes. The callers above
pass the budget and the hardware profile on; none resolves either again.

Example:
    >>> planned = plan_step(graph, get_hardware("cpu"), Budget(fraction=0.5), "auto", {})
    >>> planned.budget.device_bytes, planned.predicted_peak_bytes
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, topology_hash
from memfit.data.timeline import Timeline
from memfit.data.units import Budget, format_bytes
from memfit.model.explain import explain
from memfit.model.plan_memo import plans_remembered
from memfit.model.simulate import simulate
from memfit.planning.plan_cache import (
    note_ignored,
    note_planned,
    note_stage,
    plan_key,
    recall,
    remember,
)
from memfit.planning.strategies import STRATEGY_STARTED, collector_paused, get_strategy
from memfit.planning.strategies._budget_checks import require_host


@dataclass(frozen=True)
class DeviceBudget:
    """A budget resolved once: the whole device's bytes and the bytes outside the graph.

    Args:
        device_bytes: the whole device's budget (``None``: no limit).
        outside_bytes: device bytes alive outside the graph while it runs (gradients kept from
            an earlier step, optimizer state, parameters of other regions).
    """

    device_bytes: int | None
    outside_bytes: int = 0

    @property
    def graph_bytes(self) -> int | None:
        """What the strategies plan for: the device budget less the bytes outside the graph."""
        if self.device_bytes is None:
            return None
        return max(self.device_bytes - self.outside_bytes, 1)


@dataclass(frozen=True)
class Planned:
    """A planned step: its graph, plan, the unplanned and planned timelines, and its budget.

    The timelines are the graph's own; ``*_peak_bytes`` add the bytes outside it. A step of
    several regions (graph breaks) keeps each region's in ``regions``, in the order they run
    (``memfit.fitting.traced.whole_step``); one region's step has none."""

    graph: CostGraph
    plan: Plan
    baseline: Timeline
    predicted: Timeline
    budget: DeviceBudget
    regions: tuple[Planned, ...] = ()

    @property
    def predicted_peak_bytes(self) -> int:
        """The whole device's predicted peak."""
        return self.predicted.peak_bytes + self.budget.outside_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.baseline.peak_bytes + self.budget.outside_bytes


def plan_step(graph: CostGraph, hardware: Hardware, budget: Budget | None, strategy: str,
              params: Mapping[str, Any], outside_bytes: int = 0, fixed: Plan | None = None,
              what_ifs: bool = False) -> Planned:
    """Plan ``graph`` under ``budget`` (whole device; ``outside_bytes`` come off it).

    A fraction is of the unplanned whole-device peak. The plan carries its ``Explanation``: rows
    per decision and, with ``what_ifs``, the plans at the budget x0.9 and x1.1 (two more plan
    calls: ``memfit.plan`` and ``memfit plan`` explain, so they ask; steps on their way to running
    do not). A ``fixed`` plan (``compile(plan=...)``) is checked and used as is. Each plan is
    lowered and simulated once for the whole call (``memfit.model.plan_memo``), however often
    the strategy, the what-ifs and the explanation ask; Python's cyclic collector stays paused
    for the whole call, not only inside each strategy (``collector_paused``: between the
    strategies, the simulations and the explanation it would run full collections over the
    objects the call remembers, which the call's end frees anyway).

    Raises:
        BudgetError: if the strategy cannot fit the budget (whole-device bytes in its message).
        PlanError: if ``fixed`` was made for another graph, input shape or hardware.
    """
    with plans_remembered(), collector_paused():
        return _plan_step(graph, hardware, budget, strategy, params, outside_bytes, fixed,
                          what_ifs)


def unplanned(graph: CostGraph, hardware: Hardware) -> Timeline:
    """``graph`` run unplanned (``keep``): the timeline a fraction budget is of."""
    return simulate(graph, get_strategy("keep")(graph, hardware), hardware)


def _plan_step(graph: CostGraph, hardware: Hardware, budget: Budget | None, strategy: str,
               params: Mapping[str, Any], outside_bytes: int, fixed: Plan | None,
               what_ifs: bool) -> Planned:
    started = time.perf_counter()
    note_stage(f"choosing a plan ({strategy})")
    baseline = unplanned(graph, hardware)
    if fixed is not None:
        fixed = fixed.for_graph(graph, hardware.name)
        made_for = fixed.explanation.budget_bytes if fixed.explanation else fixed.budget_bytes
        resolved = DeviceBudget(made_for, outside_bytes)
        return Planned(graph, fixed, baseline, simulate(graph, fixed, hardware), resolved)
    device_bytes = None if budget is None else budget.to_bytes(baseline.peak_bytes + outside_bytes)
    resolved = DeviceBudget(device_bytes, outside_bytes)
    key = plan_key(graph, hardware, budget, strategy, params, outside_bytes, what_ifs)
    recalled = _recalled(key, strategy, graph, hardware, resolved, started)
    if recalled is not None:
        return Planned(graph, recalled[0], baseline, recalled[1], resolved)
    shown = STRATEGY_STARTED.set(lambda name: note_stage(
        f"choosing a plan ({strategy})" if name == strategy else
        f"choosing a plan ({strategy}: trying {name})"))
    try:
        made = _chosen_plan(graph, hardware, baseline, resolved, strategy, params, what_ifs)
    except BudgetError as error:
        remember(key, refused=error)
        note_planned(time.perf_counter() - started, cached=False)
        raise
    finally:
        STRATEGY_STARTED.reset(shown)
    remember(key, made)
    note_planned(time.perf_counter() - started, cached=False)
    return Planned(graph, made, baseline, simulate(graph, made, hardware), resolved)


def _recalled(key: str | None, strategy: str, graph: CostGraph, hardware: Hardware,
              resolved: DeviceBudget, started: float) -> tuple[Plan, Timeline] | None:
    """The plan cached under ``key`` and its simulated timeline, where it is predicted within
    ``resolved``'s budget: a cached plan is trusted no more than a new one
    (``memfit.planning.plan_cache``).

    Raises:
        BudgetError: the refusal cached under ``key``.
    """
    try:
        recalled = recall(key, strategy)
    except BudgetError:
        note_planned(time.perf_counter() - started, cached=True)
        raise
    if recalled is None:
        return None
    predicted = simulate(graph, recalled, hardware)
    if (resolved.device_bytes is not None
            and predicted.peak_bytes + resolved.outside_bytes > resolved.device_bytes):
        note_ignored(f"{key[:16] if key else ''}: its plan is predicted over the budget")
        return None
    note_planned(time.perf_counter() - started, cached=True)
    return recalled, predicted


def _chosen_plan(graph: CostGraph, hardware: Hardware, baseline: Timeline,
                 resolved: DeviceBudget, strategy: str, params: Mapping[str, Any],
                 what_ifs: bool) -> Plan:
    """The strategy's plan for ``resolved`` with its explanation (``plan_step`` without the
    cache).

    Raises:
        BudgetError: if the strategy cannot fit the budget (whole-device bytes in its message).
    """
    device_bytes, outside_bytes = resolved.device_bytes, resolved.outside_bytes
    chosen = get_strategy(strategy)

    def replan(graph_budget_bytes: int | None) -> Plan:  # no strategy swaps past host_bytes
        return require_host(graph, chosen(graph, hardware, graph_budget_bytes, **params),
                            hardware.host_bytes, graph_budget_bytes)

    try:
        made = replan(resolved.graph_bytes)
    except BudgetError as error:
        if device_bytes is None:
            raise
        # reported for the whole device, the bytes outside the graph included
        raise BudgetError(device_bytes, error.minimum_bytes + outside_bytes, error.dominant,
                          error.strategy, error.note, host_bytes=error.host_bytes) from None
    explanation = explain(graph, made, hardware, baseline, device_bytes, outside_bytes,
                          replan if what_ifs else None)
    return replace(made, topology_hash=topology_hash(graph), explanation=explanation)


EAGER_NOTE_SHARE = 0.01  # eager code's bytes a refusal names, as a share of its smallest peak


def with_eager_note(error: BudgetError, eager_bytes: int,
                    graph_breaks: Sequence[str] = ()) -> BudgetError:
    """``error``, saying that ``eager_bytes`` of the peak are eager code's, where they matter:
    without them the step would fit, or they are at least ``EAGER_NOTE_SHARE`` of its smallest
    peak (not the previous iteration's scalar loss that every loop holds); with them, the
    ``graph_breaks`` Dynamo reported (the code there runs eagerly)."""
    shortfall = error.minimum_bytes - error.budget_bytes
    if eager_bytes <= 0 or (eager_bytes < shortfall
                            and eager_bytes < EAGER_NOTE_SHARE * error.minimum_bytes):
        return error
    note = (f"{format_bytes(eager_bytes)} of it is held by eager code outside the compiled "
            "regions while this one runs (the loss computed in the loop and its buffers, code at "
            "a graph break, tensors the loop keeps such as an EMA copy of the model; "
            "memfit.report shows where): compute the loss inside the model, keep such copies "
            "off the device (AveragedModel(model, device='cpu')), or raise the budget.")
    if graph_breaks:
        note += (" Dynamo broke the model's graph, and runs the code at each break eagerly: "
                 + "; ".join(graph_breaks) + ".")
    return BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant, error.strategy,
                       f"{error.note} {note}".strip(), host_bytes=error.host_bytes)


def short_even_alone(error: BudgetError, pending: int, eager: int,
                     graph_breaks: Sequence[str] = ()) -> BudgetError:
    """The error for a region that misses the budget even without the ``pending`` saves of the
    regions before its graph break: no joint plan can make it fit (so none is tried, and every
    rank stops here). Its minimum is the region's smallest peak beside those saves as the
    earlier regions' plans made them at this budget; at a larger budget they may save more,
    and joint planning caps them (``memfit.compiler.graph_breaks``)."""
    note = (f"It cannot fit even without the {format_bytes(pending)} of saved values the "
            "regions that ran before it hold (those before a graph break, the model's call "
            "earlier in the step with other arguments).")
    return with_eager_note(BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant,
                                       error.strategy, f"{error.note} {note}".strip(),
                                       host_bytes=error.host_bytes), eager, graph_breaks)


def rerun_whole(graph: CostGraph, hardware: Hardware, budget_bytes: int, outside_bytes: int
                ) -> Plan | None:
    """The plan that saves the fewest bytes: every forward value re-run from the region's
    inputs in its backward (per-block checkpointing's), or ``None`` where its peak and the
    ``outside_bytes`` beside it miss ``budget_bytes``."""
    from memfit.planning.strategies.recomputing.checkpoint import recompute_all_but

    made = recompute_all_but(graph, (), hardware, budget_bytes - outside_bytes, {})
    fits = simulate(graph, made, hardware).peak_bytes + outside_bytes <= budget_bytes
    return made if fits else None

