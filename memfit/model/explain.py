"""Explanation: why a plan decided what it did and what each decision costs. Torch-free data.

The data types it fills in live in ``memfit.data.explanation``, below ``Plan`` (which holds one).

``explain`` is called once, where the plan is made (``memfit.planning.step.plan_step``), and the result
travels inside the ``Plan`` (``Plan.explanation``), so a plan loaded from JSON explains itself
without its graph. It holds one row per decided tensor (its module, bytes, decision, the strategy's
reason, where a swap is prefetched, what the decision costs in step time), the predicted figures,
what-if rows (the same strategy and parameters re-planned at the budget x0.9 and x1.1), and a
``Tally``: how many of the saved tensors are swapped and recomputed, and what the re-runs do.

Note:
    The time a decision costs is read off the simulated timeline, so the rows add up to it: a swap
    costs the compute stream's stalls waiting for its copies (on a machine without asynchronous
    copies, the copies themselves), a recompute costs its producer's re-runs (split evenly when a
    re-run rebuilds several decided tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.explanation import (
    BudgetRow,
    DecisionKind,
    Explanation,
    ModuleTotal,
    Tally,
    TensorRow,
    WhatIf,
)
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Recompute, Swap
from memfit.data.timeline import Timeline
from memfit.model.schedule import lower
from memfit.model.simulate import simulate

WHAT_IF_FACTORS = (0.9, 1.1)
__all__ = ["BudgetRow", "DecisionKind", "Explanation", "ModuleTotal", "Tally", "TensorRow",
           "WhatIf", "WHAT_IF_FACTORS", "explain", "saved_decisions", "tally"]


def tally(graph: CostGraph, plan: Plan, timeline: Timeline) -> Tally:
    """The ``Tally`` of ``plan`` on ``graph``; times read off ``timeline`` (its simulation)."""
    saved = {t.name for t in graph.saved_tensors()}
    kinds = saved_decisions(graph, plan, saved)
    swapped = [name for name, kind in kinds.items() if kind == "swap"]
    unsaved = [name for name in plan.swapped if name not in saved]
    schedule = lower(graph, plan)
    reruns = [action for action in schedule.actions if action.kind == "recompute"]
    return Tally(
        saved=len(saved), swapped=len(swapped),
        recomputed=sum(kind == "recompute" for kind in kinds.values()),
        swapped_bytes=sum(graph.tensors[name].size_bytes for name in swapped),
        swap_ins=plan.swap_in_count, rerun_count=len(reruns),
        rerun_ops=len({action.op for action in reruns}),
        rerun_bytes=sum(schedule.buffer_bytes[b] for action in reruns for b in action.allocates),
        exposed_transfer_s=timeline.exposed_transfer_s, recompute_s=timeline.recompute_s,
        swapped_unsaved=len(unsaved),
        swapped_unsaved_bytes=sum(graph.tensors[name].size_bytes for name in unsaved))


def saved_decisions(graph: CostGraph, plan: Plan,
                    saved: set[str] | None = None) -> dict[str, DecisionKind]:
    """Each saved tensor's decision: a ``Recompute`` or an explicit re-run's output is
    ``"recompute"``, a ``Swap`` is ``"swap"``, anything else ``"keep"``."""
    saved = {t.name for t in graph.saved_tensors()} if saved is None else saved
    rebuilt = {output for rerun in plan.reruns for output in graph.op(rerun.op).outputs}
    kinds: dict[str, DecisionKind] = {}
    for name in saved:
        decision = plan.decisions.get(name)
        if isinstance(decision, Swap):
            kinds[name] = "swap"
        elif isinstance(decision, Recompute) or (decision is None and name in rebuilt):
            kinds[name] = "recompute"
        else:
            kinds[name] = "keep"
    return kinds


def explain(graph: CostGraph, plan: Plan, hardware: Hardware, baseline: Timeline,
            budget_bytes: int | None = None, outside_bytes: int = 0,
            replan: Callable[[int], Plan] | None = None,
            factors: tuple[float, ...] = WHAT_IF_FACTORS) -> Explanation:
    """Explain ``plan`` on ``graph``: rows per decided tensor, predicted figures, what-ifs.

    Args:
        baseline: the unplanned step's simulated timeline.
        budget_bytes: the whole-device budget the plan was made for (``None``: no what-ifs).
        outside_bytes: device bytes outside the graph, added to every peak and budget shown.
        replan: plans the graph again for a graph budget in bytes (the same strategy and
            parameters); called once per factor. ``None``: no what-ifs.
        factors: the budgets to try, as multiples of ``budget_bytes``.

    Raises:
        PlanError: if the plan does not fit the graph.
    """
    predicted = simulate(graph, plan, hardware)
    exposed, rebuilt = _costs(graph, plan, hardware, predicted)
    what_if: tuple[WhatIf, ...] = ()
    if budget_bytes is not None and replan is not None:
        what_if = tuple(_what_if(graph, hardware, replan, budget_bytes, outside_bytes, factor)
                        for factor in factors)
    return Explanation(
        graph=graph.name, hardware=hardware.name, budget_bytes=budget_bytes,
        outside_bytes=outside_bytes, saved_tensors=len(graph.saved_tensors()),
        baseline_peak_bytes=baseline.peak_bytes + outside_bytes,
        baseline_step_time_s=baseline.step_time_s,
        peak_bytes=predicted.peak_bytes + outside_bytes, step_time_s=predicted.step_time_s,
        exposed_transfer_s=predicted.exposed_transfer_s, recompute_s=predicted.recompute_s,
        rows=_rows(graph, plan, exposed, rebuilt), what_if=what_if,
        tally=tally(graph, plan, predicted),
    )


def _costs(graph: CostGraph, plan: Plan, hardware: Hardware,
           predicted: Timeline) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Exposed seconds per swapped tensor; re-run durations per re-run op."""
    by_label = {action.label: action for action in lower(graph, plan).actions}
    exposed_kinds = {"wait"} if hardware.async_copies else {"swap_out", "swap_in"}
    exposed: dict[str, float] = {}
    rebuilt: dict[str, list[float]] = {}
    for interval in predicted.intervals:
        action = by_label[interval.label]
        duration = interval.end_s - interval.start_s
        if interval.kind in exposed_kinds:
            exposed[action.tensor] = exposed.get(action.tensor, 0.0) + duration
        elif interval.kind == "recompute":
            rebuilt.setdefault(action.op, []).append(duration)
    return exposed, rebuilt


def _rows(graph: CostGraph, plan: Plan, exposed: Mapping[str, float],
          rebuilt: Mapping[str, list[float]]) -> tuple[TensorRow, ...]:
    """One row per tensor the plan decides or its explicit re-runs rebuild, in program order."""
    explicit = {r.op for r in plan.reruns}
    decided = dict(plan.decisions)
    for op in explicit:
        for output in graph.op(op).outputs:
            if output not in decided and not graph.tensors[output].is_output:
                decided[output] = Recompute(reason="rebuilt by the plan's re-run schedule")
    sharers: dict[str, int] = {}  # re-run op -> decided recomputed tensors it rebuilds
    for name, decision in decided.items():
        maker = graph.tensors[name].producer
        if isinstance(decision, Recompute) and maker is not None:
            sharers[maker] = sharers.get(maker, 0) + 1
    saved = {t.name for t in graph.saved_tensors()}
    rows = []
    for name, decision in decided.items():
        tensor = graph.tensors[name]
        producer = graph.op(tensor.producer) if tensor.producer is not None else None
        row = TensorRow(name, producer.scope if producer else "",
                        producer.module_type if producer else "", tensor.size_bytes, "keep",
                        decision.reason, saved=name in saved)
        if isinstance(decision, Swap):
            afters = tuple(s.after for s in decision.swap_ins)
            row = TensorRow(**{**asdict(row), "decision": "swap", "prefetch_after": afters,
                               "prefetch_scopes": tuple(graph.op(a).scope for a in afters),
                               "exposed_s": exposed.get(name, 0.0)})
        elif isinstance(decision, Recompute) and producer is not None:
            runs = rebuilt.get(producer.name, [])
            if not runs and not _read_by_backward(graph, name):
                continue  # freed after the forward pass as any unsaved value is: nothing to say
            row = TensorRow(**{**asdict(row), "decision": "recompute", "reruns": len(runs),
                               "recompute_s": sum(runs) / sharers[producer.name]})
        rows.append(row)
    position = {t: graph.index[graph.tensors[t].producer or graph.ops[0].name] for t in decided}
    return tuple(sorted(rows, key=lambda r: position[r.tensor]))


def _read_by_backward(graph: CostGraph, tensor: str) -> bool:
    """Whether a backward op reads ``tensor``: a segment's recomputation marks every value
    inside it, also those only its re-runs would need, and those no step reads again."""
    return any(graph.op(c).phase != "forward" for c in graph.tensors[tensor].consumers)


def _what_if(graph: CostGraph, hardware: Hardware, replan: Callable[[int], Plan],
             budget_bytes: int, outside_bytes: int, factor: float) -> WhatIf:
    budget = int(budget_bytes * factor)
    try:
        made = replan(max(budget - outside_bytes, 1))
    except BudgetError as error:
        return WhatIf(factor, budget, minimum_bytes=error.minimum_bytes + outside_bytes)
    timeline = simulate(graph, made, hardware, record_intervals=False)
    return WhatIf(factor, budget, timeline.peak_bytes + outside_bytes, timeline.step_time_s,
                  timeline.exposed_transfer_s, timeline.recompute_s)
