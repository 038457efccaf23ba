"""Explanation: why a plan decided what it did and what each decision costs. Torch-free data.

``explain`` is called once, where the plan is made (``memfit.planning.plan_step``), and the result
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
from dataclasses import asdict, dataclass
from typing import Any, Literal

from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.hardware import Hardware
from memfit.core.plan import Plan, Recompute, Swap
from memfit.core.schedule import lower
from memfit.core.simulate import simulate
from memfit.core.timeline import Timeline

DecisionKind = Literal["keep", "swap", "recompute"]
WHAT_IF_FACTORS = (0.9, 1.1)


@dataclass(frozen=True)
class TensorRow:
    """One decided tensor.

    Args:
        tensor: its name (the fx node that allocates it).
        scope: module path of its producer (``"transformer.h.3.attn"``), ``""`` at top level.
        module_type: class name of that module.
        size_bytes: bytes of its storage.
        decision: ``"keep"``, ``"swap"`` or ``"recompute"``.
        reason: what the strategy said when it decided.
        prefetch_after: for a swap, the control op after which each swap-in is issued.
        prefetch_scopes: the module path of each of those control ops.
        exposed_s: compute time lost waiting for this tensor's copies.
        reruns: how many times its producer runs again.
        recompute_s: compute time of those re-runs (its share).
    """

    tensor: str
    scope: str
    module_type: str
    size_bytes: int
    decision: DecisionKind
    reason: str = ""
    prefetch_after: tuple[str, ...] = ()
    prefetch_scopes: tuple[str, ...] = ()
    exposed_s: float = 0.0
    reruns: int = 0
    recompute_s: float = 0.0
    saved: bool = True  # read by the backward: one of ``Tally.saved`` (rebuilt on the way: not)

    @property
    def time_paid_s(self) -> float:
        return self.exposed_s + self.recompute_s


@dataclass(frozen=True)
class Tally:
    """What a plan does to the step's saved tensors, and what its re-runs cost.

    The counts are of one population, the saved tensors (forward values a backward op reads,
    ``CostGraph.saved_tensors``), so ``swapped + recomputed + kept == saved``. Values a re-run
    rebuilds on its way to a saved one are not saved tensors: they show in the re-run figures.

    Args:
        saved: saved tensors.
        swapped: saved tensors the plan swaps.
        recomputed: saved tensors the plan rebuilds (``Recompute`` or an explicit re-run).
        swapped_bytes: bytes of the ``swapped`` ones.
        swap_ins: copies back to the device (a tensor may come back more than once).
        rerun_count: forward ops run again (an op re-run twice counts twice).
        rerun_ops: distinct forward ops among them.
        rerun_bytes: device bytes those re-runs allocate (the values they rebuild).
        exposed_transfer_s: compute time lost waiting for copies, on the timeline given.
        recompute_s: compute time of the re-runs, on the timeline given.
        swapped_unsaved: swapped values that are not saved tensors (a forward value read
            again later in the forward pass only), counted apart from ``swapped``.
        swapped_unsaved_bytes: their bytes.
    """

    saved: int
    swapped: int
    recomputed: int
    swapped_bytes: int = 0
    swap_ins: int = 0
    rerun_count: int = 0
    rerun_ops: int = 0
    rerun_bytes: int = 0
    exposed_transfer_s: float = 0.0
    recompute_s: float = 0.0
    swapped_unsaved: int = 0
    swapped_unsaved_bytes: int = 0

    @property
    def kept(self) -> int:
        return self.saved - self.swapped - self.recomputed


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


@dataclass(frozen=True)
class WhatIf:
    """The same strategy and parameters at another budget (whole-device bytes).

    ``minimum_bytes`` is set, and the figures are ``None``, when the plan does not fit.
    """

    factor: float
    budget_bytes: int
    peak_bytes: int | None = None
    step_time_s: float | None = None
    exposed_transfer_s: float | None = None
    recompute_s: float | None = None
    minimum_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.minimum_bytes is None


@dataclass(frozen=True)
class BudgetRow:
    """One row of the what-if table: the fastest plan found at or under one budget.

    Args:
        factor: the budget as a multiple of the plan's.
        budget_bytes: that budget, whole device.
        best: the fastest plan made for this budget or a tighter one (it fits this one too);
            ``None`` when none of them fits.
        made_for: the factor of the budget ``best`` was made for (``factor``: its own).
        minimum_bytes: when nothing fits, the smallest peak the strategy reached here.
    """

    factor: float
    budget_bytes: int
    best: WhatIf | None
    made_for: float | None = None
    minimum_bytes: int | None = None

    @property
    def borrowed(self) -> bool:
        """Whether the planner's own plan for this budget was slower than a tighter one's."""
        return self.best is not None and self.made_for != self.factor


@dataclass(frozen=True)
class ModuleTotal:
    """Decided tensors of one module path (cut to a depth), and what they cost. The counts and
    bytes are of saved tensors (``Tally``'s population); the times include the re-runs of values
    rebuilt on the way to them."""

    scope: str
    swapped: int = 0
    swapped_bytes: int = 0
    recomputed: int = 0
    recomputed_bytes: int = 0
    kept: int = 0
    exposed_s: float = 0.0
    recompute_s: float = 0.0


@dataclass(frozen=True)
class Explanation:
    """Everything ``Plan.explain()`` prints. Device figures (peaks, budgets) include
    ``outside_bytes``, the bytes outside the graph (existing ``.grad``) at planning time."""

    graph: str
    hardware: str
    budget_bytes: int | None
    outside_bytes: int
    saved_tensors: int
    baseline_peak_bytes: int
    baseline_step_time_s: float
    peak_bytes: int
    step_time_s: float
    exposed_transfer_s: float
    recompute_s: float
    rows: tuple[TensorRow, ...] = ()
    what_if: tuple[WhatIf, ...] = ()
    tally: Tally | None = None  # None in a plan saved before tallies were recorded

    def what_if_table(self) -> list[BudgetRow]:
        """The what-if budgets and this plan's, tightest first, each with the fastest plan found
        at or under it, so a looser budget never shows a slower step.

        Note:
            The strategies are heuristics: re-planned for a looser budget, one may find a
            slower plan than for a tighter one (``auto`` on a 4-layer GPT-2 at 30% of its peak
            on h100-pcie: its 90% plan was 0.21% faster than its 100% plan). That tighter plan
            fits the looser budget too, so its row shows it and says whose it is.
        """
        if self.budget_bytes is None:
            return []
        this = WhatIf(1.0, self.budget_bytes, self.peak_bytes, self.step_time_s,
                      self.exposed_transfer_s, self.recompute_s)
        table: list[BudgetRow] = []
        fitted: list[WhatIf] = []  # the plans of the tighter budgets
        for case in sorted((*self.what_if, this), key=lambda c: c.factor):
            tighter = [c for c in fitted if (c.peak_bytes or 0) <= case.budget_bytes]
            own = [case] if case.fits else []
            best = min(own + tighter, key=lambda c: c.step_time_s or 0.0, default=None)
            table.append(BudgetRow(case.factor, case.budget_bytes, best,
                                   best.factor if best else None,
                                   None if best else case.minimum_bytes))
            fitted += own
        return table

    def by_module(self, depth: int = 3) -> list[ModuleTotal]:
        """Totals per module path cut to its first ``depth`` parts, in first-seen row order."""
        totals: dict[str, dict[str, Any]] = {}
        for row in self.rows:
            scope = ".".join(row.scope.split(".")[:depth]) if row.scope else ""
            total = totals.setdefault(scope or "(top level)", {})
            if row.decision == "swap" and row.saved:
                _add(total, swapped=1, swapped_bytes=row.size_bytes)
            elif row.decision == "recompute" and row.saved:
                _add(total, recomputed=1, recomputed_bytes=row.size_bytes)
            elif row.decision == "keep":
                _add(total, kept=1)
            _add(total, exposed_s=row.exposed_s, recompute_s=row.recompute_s)
        return [ModuleTotal(scope, **fields) for scope, fields in totals.items()]

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping) -> Explanation:
        rows = tuple(
            TensorRow(**{**row, "prefetch_after": tuple(row.get("prefetch_after", ())),
                         "prefetch_scopes": tuple(row.get("prefetch_scopes", ()))})
            for row in data.get("rows", ())
        )
        what_if = tuple(WhatIf(**row) for row in data.get("what_if", ()))
        counted = data.get("tally")
        fields = {k: v for k, v in data.items() if k not in ("rows", "what_if", "tally")}
        return Explanation(**fields, rows=rows, what_if=what_if,
                           tally=Tally(**counted) if counted is not None else None)


def _add(total: dict[str, Any], **amounts: float) -> None:
    for key, amount in amounts.items():
        total[key] = total.get(key, 0) + amount


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
