"""``Plan.explain()`` as text: predicted figures, totals by module, decisions, what-if budgets.

Reads only the plan and the ``Explanation`` it carries (``memfit.model.explain``), so a plan loaded
from JSON renders the same as the one just made. ``Plan`` (``memfit.data.plan``) calls it from its
``explain`` method and so imports this module: the plan is read here through ``PlanFields``, the
fields it has, never by naming ``Plan`` (no import loop, not even for type checkers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from memfit.data.decisions import Decision, Recompute, Rerun, Swap
from memfit.data.explanation import BudgetRow, Explanation, TensorRow
from memfit.data.tables import fit_table, format_ms, format_param, table, tally_lines
from memfit.data.units import format_bytes


class PlanFields(Protocol):
    """What the text reads of a ``Plan`` (see ``Plan`` for each field)."""

    @property
    def strategy(self) -> str: ...
    @property
    def decisions(self) -> Mapping[str, Decision]: ...
    @property
    def graph_hash(self) -> str: ...
    @property
    def params(self) -> Mapping[str, Any]: ...
    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def hardware(self) -> str: ...
    @property
    def reruns(self) -> tuple[Rerun, ...]: ...
    @property
    def explanation(self) -> Explanation | None: ...
    @property
    def regions(self) -> Sequence[PlanFields]: ...


def explain_text(plan: PlanFields, depth: int = 3, width: int = 100, rows: int | None = 40) -> str:
    """See ``Plan.explain``."""
    if plan.regions:
        return _regions_text(plan, depth, width, rows)
    head = (f"plan: strategy {plan.strategy!r}, hardware {plan.hardware or '-'}, budget "
            f"{format_bytes(plan.budget_bytes) if plan.budget_bytes else 'none'}, graph "
            f"{plan.graph_hash or '-'}")
    shown = {k: v for k, v in plan.params.items() if v not in (None, (), [], "", {})}
    if shown:  # unset filters left out; tuples and lists alike (a loaded plan has lists)
        head += "; parameters: " + ", ".join(f"{k}={format_param(v)}" for k, v in shown.items())
    explanation = plan.explanation
    if explanation is None:
        return "\n".join([head, "(no explanation recorded: plans made by memfit.plan or "
                          "memfit.compile carry one)", _bare_decisions(plan)])
    lines = [head, fit_table(("step", "peak", "step time", "exposed transfer", "recompute"), [
        ("unplanned", format_bytes(explanation.baseline_peak_bytes),
         format_ms(explanation.baseline_step_time_s), "-", "-"),
        (f"{plan.strategy} (predicted)", format_bytes(explanation.peak_bytes),
         format_ms(explanation.step_time_s), format_ms(explanation.exposed_transfer_s),
         format_ms(explanation.recompute_s)),
    ], width)]
    if plan.reruns:
        lines.append(f"explicit re-runs: {len(plan.reruns)} (the solver's schedule)")
    decided = explanation.rows
    if explanation.tally is not None:
        lines += tally_lines(explanation.tally)
    else:  # saved before tallies were recorded: the rows are all there is
        lines.append(f"{explanation.saved_tensors} saved tensors; {len(decided)} decided "
                     "tensors (a plan saved by an older memfit: plan again for the counts)")
    if decided:
        lines += [f"by module (first {depth} parts of the module path):",
                  _modules(explanation, depth, width), _decisions(decided, rows, width)]
    lines.append(_what_ifs(explanation, width))
    return "\n".join(line for line in lines if line)


def _modules(explanation: Explanation, depth: int, width: int) -> str:
    return fit_table(
        ("module", "swapped", "swap bytes", "recomputed", "recompute bytes", "exposed", "recompute"),
        [(m.scope, m.swapped, format_bytes(m.swapped_bytes), m.recomputed,
          format_bytes(m.recomputed_bytes), format_ms(m.exposed_s), format_ms(m.recompute_s))
         for m in explanation.by_module(depth)], width)


def _decisions(decided: tuple[TensorRow, ...], limit: int | None, width: int) -> str:
    shown = list(decided)
    on_the_way = sum(not r.saved for r in decided)
    tensors = f"{len(decided)} tensors" + (
        f", {on_the_way} of them not saved tensors but rebuilt on the way to one"
        if on_the_way else "")
    note = f"decisions ({tensors}; program order):"
    if limit is not None and len(decided) > limit:
        costly = sorted(decided, key=lambda r: (-r.time_paid_s, -r.size_bytes))[:limit]
        keep = {r.tensor for r in costly}
        shown = [r for r in decided if r.tensor in keep]
        note = (f"decisions ({tensors}; the {limit} costliest shown, program order; "
                "plan.explain(rows=None) for all):")
    return note + "\n" + table(
        ("tensor", "module", "bytes", "decision", "prefetch after", "time paid", "why"),
        [(r.tensor, r.scope or "(top level)", format_bytes(r.size_bytes), _decision(r),
          _prefetch(r), format_ms(r.time_paid_s), r.reason or "-") for r in shown])


def _decision(row: TensorRow) -> str:
    if row.decision == "recompute":
        return f"recompute x{row.reruns}" if row.reruns != 1 else "recompute"
    if row.decision == "swap" and len(row.prefetch_after) > 1:
        return f"swap ({len(row.prefetch_after)} swap-ins)"
    return row.decision


def _prefetch(row: TensorRow) -> str:
    if not row.prefetch_after:
        return "-"
    scope = row.prefetch_scopes[0] if row.prefetch_scopes else ""
    first = row.prefetch_after[0] + (f" ({scope})" if scope else "")
    more = len(row.prefetch_after) - 1
    return first + (f" +{more} more" if more else "")


def _what_ifs(explanation: Explanation, width: int) -> str:
    if explanation.budget_bytes is None:
        return "what if: no budget was given, so there is no budget to vary"
    if not explanation.what_if:
        return ("what if: not computed (compile and max_batch_size plan once; memfit.plan and "
                "`memfit plan` also plan at the budget x0.9 and x1.1)")
    rows = [_what_if_row(row, explanation.step_time_s) for row in explanation.what_if_table()]
    lines = ["what if the budget were (predicted; each row the fastest plan found at or under "
             "its budget):",
             fit_table(("budget", "bytes", "peak", "step time", "vs. this plan", "plan made for"),
                       rows, width)]
    lines += [_borrowed_note(row, explanation) for row in explanation.what_if_table()
              if row.borrowed]
    return "\n".join(lines)


def _what_if_row(row: BudgetRow, this_step_time_s: float) -> tuple[str, ...]:
    label = f"{row.factor:.0%}"
    if row.factor == 1.0:
        label += " (this budget)" if row.borrowed else " (this plan)"
    if row.best is None:
        return (label, format_bytes(row.budget_bytes),
                f"does not fit: minimum {format_bytes(row.minimum_bytes or 0)}", "-", "-", "-")
    step_time_s = row.best.step_time_s or 0.0
    change = step_time_s / this_step_time_s - 1 if this_step_time_s else 0.0
    made_for = "this budget" if not row.borrowed else f"the {row.made_for:.0%} budget"
    return (label, format_bytes(row.budget_bytes), format_bytes(row.best.peak_bytes or 0),
            format_ms(step_time_s), f"{change:+.1%}", made_for)


def _borrowed_note(row: BudgetRow, explanation: Explanation) -> str:
    """Why a row shows a plan made for a tighter budget, and what the planner made for its own."""
    own = next((c for c in explanation.what_if if c.factor == row.factor), None)
    own_time_s = explanation.step_time_s if row.factor == 1.0 else own.step_time_s if own else None
    made = ("did not fit" if own_time_s is None else f"takes {format_ms(own_time_s)}")
    assert row.best is not None
    return (f"at {row.factor:.0%}: the plan made for that budget {made}; the one made for "
            f"{row.made_for:.0%} ({format_bytes(row.best.budget_bytes)}) takes "
            f"{format_ms(row.best.step_time_s)} and fits too (the strategy is a heuristic: a looser "
            "budget can lead it to a slower plan), so the row shows it")


def _bare_decisions(plan: PlanFields) -> str:
    rows = []
    for name, decision in plan.decisions.items():
        kind = ("swap" if isinstance(decision, Swap) else
                "recompute" if isinstance(decision, Recompute) else "keep")
        after = ", ".join(s.after for s in decision.swap_ins) if isinstance(decision, Swap) else "-"
        rows.append((name, kind, after, decision.reason or "-"))
    if not rows:
        return "no decisions: every tensor is kept" + (
            f" ({len(plan.reruns)} explicit re-runs)" if plan.reruns else "")
    return table(("tensor", "decision", "prefetch after", "why"), rows)


def _regions_text(plan: PlanFields, depth: int, width: int, rows: int | None) -> str:
    """A plan of several regions: one row per region (its share of the budget: the budget less
    what is held beside it), then each region's own explanation."""
    budget = format_bytes(plan.budget_bytes) if plan.budget_bytes else "none"
    lines = [f"plan: strategy {plan.strategy!r}, hardware {plan.hardware or '-'}, budget {budget}, "
             f"{len(plan.regions)} regions (graph breaks), planned in the order they run, each "
             "beside the bytes the regions before it hold (their saves, the model's parameters "
             "and gradients); the step's peak is the highest region's"]
    table_rows = []
    for index, region in enumerate(plan.regions):
        explained = region.explanation
        if explained is None:
            table_rows.append((index, region.graph_hash, "-", "-", "-", "-", "-"))
            continue
        share = (format_bytes(explained.budget_bytes - explained.outside_bytes)
                 if explained.budget_bytes is not None else "no limit")
        table_rows.append((index, region.graph_hash, format_bytes(explained.outside_bytes),
                           share, format_bytes(explained.baseline_peak_bytes),
                           format_bytes(explained.peak_bytes), format_ms(explained.step_time_s)))
    lines.append(fit_table(("region", "graph", "held beside it", "its share of the budget",
                            "unplanned peak", "predicted peak", "step time"), table_rows, width))
    for index, region in enumerate(plan.regions):
        lines += [f"-- region {index} --", explain_text(region, depth, width, rows)]
    return "\n".join(lines)
