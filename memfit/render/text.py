"""Text renderers: the step report. Plain tables and figures: ``memfit.data.tables``."""

from __future__ import annotations

from memfit.data.tables import format_param, format_time, table, tally_lines
from memfit.data.units import format_bytes
from memfit.model.explain import tally


def step_report(compiled, measured=None, rounds=()) -> str:
    """What a compiled step planned, predicted and measured, as a short table.

    ``compiled`` is the region that ran (``memfit.compiler.backend.Region``), ``measured`` its last
    measured ``Timeline`` (whole device), ``rounds`` its closed loop. Each figure says whether
    it was simulated (predicted) or measured."""
    plan, graph = compiled.plan, compiled.graph
    budget = format_bytes(compiled.budget_bytes) if compiled.budget_bytes else "none"
    outside = compiled.outside_bytes
    rows = [
        ("unplanned (simulated)", format_bytes(compiled.baseline.peak_bytes + outside),
         format_time(compiled.baseline.step_time_s)),
        (f"{plan.strategy} (predicted)", format_bytes(compiled.predicted.peak_bytes + outside),
         format_time(compiled.predicted.step_time_s)),
    ]
    if measured is not None:
        rows.append((f"{plan.strategy} (measured)", format_bytes(measured.peak_bytes),
                     format_time(measured.step_time_s)))
    lines = [
        f"memfit step: {graph.name}, {len(graph.ops)} ops, strategy {plan.strategy!r}, "
        f"budget {budget}, hardware {plan.hardware or '-'}",
        table(("run", "peak", "step time"), rows),
        *tally_lines(tally(graph, plan, compiled.predicted)),
    ]
    if rounds:
        lines.append("closed loop (a measured peak over the budget re-plans for a tighter one):")
        lines.append(table(("round", "planning budget", "predicted peak", "measured peak",
                            "step time (measured)"),
                           [_round_row(i, r) for i, r in enumerate(rounds, 1)]))
    judged = next((r for r in reversed(rounds) if r.measured_peak_bytes), None)
    if judged is not None and judged.measured_peak_bytes:  # the plan that ran, not a newer one
        gap = (judged.predicted_peak_bytes - judged.measured_peak_bytes) / judged.measured_peak_bytes
        lines.append(f"prediction gap: {gap:+.2%} of the measured peak")
    elif measured is not None and measured.peak_bytes > 0:
        gap = (compiled.predicted.peak_bytes + outside - measured.peak_bytes) / measured.peak_bytes
        lines.append(f"prediction gap: {gap:+.2%} of the measured peak")
    if plan.params:
        lines.append("parameters: " + ", ".join(f"{k}={format_param(v)}"
                                                for k, v in plan.params.items()))
    return "\n".join(lines)


def _round_row(index: int, round_) -> tuple[object, ...]:
    measured = round_.measured_peak_bytes
    return (index, format_bytes(round_.planning_budget_bytes),
            format_bytes(round_.predicted_peak_bytes),
            "-" if measured is None else format_bytes(measured),
            "-" if round_.step_time_s is None else format_time(round_.step_time_s))
