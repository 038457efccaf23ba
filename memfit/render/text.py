"""Text renderers: the step report and plain tables that fit a terminal."""

from __future__ import annotations

from collections.abc import Sequence

from memfit.data.explanation import Tally
from memfit.data.units import format_bytes
from memfit.model.explain import tally


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 0 else "-"


def tally_lines(counted: Tally, how: str = "predicted") -> list[str]:
    """What a plan swaps and what it recomputes, as ``step.report()``, ``plan.explain()``,
    ``memfit demo`` say it: the saved tensors split into swapped, recomputed and kept (one
    population, so the parts add up to the total), then the copies and the re-runs (forward ops
    run again, the bytes they rebuild, their time). ``how`` says where the times come from
    (``"predicted"``: the simulator)."""
    split = (f"saved tensors: {counted.saved} = {counted.swapped} swapped "
             f"({format_bytes(counted.swapped_bytes)}) + {counted.recomputed} recomputed + "
             f"{counted.kept} kept")
    if counted.swapped_unsaved:
        split += (f"; also swapped: {counted.swapped_unsaved} forward values read again only in "
                  f"the forward pass ({format_bytes(counted.swapped_unsaved_bytes)})")
    lines = [split]
    if counted.swap_ins:
        lines.append(f"swaps: {counted.swap_ins} swap-ins, exposed transfer "
                     f"{_time(counted.exposed_transfer_s)} {how}")
    if not counted.rerun_count:
        return [*lines, "re-runs: none (no forward op runs twice)"]
    return [*lines, f"re-runs: {counted.rerun_count} forward op runs ({counted.rerun_ops} "
                    f"distinct ops) rebuild {format_bytes(counted.rerun_bytes)}, "
                    f"{_time(counted.recompute_s)} of compute {how}"]


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
         _time(compiled.baseline.step_time_s)),
        (f"{plan.strategy} (predicted)", format_bytes(compiled.predicted.peak_bytes + outside),
         _time(compiled.predicted.step_time_s)),
    ]
    if measured is not None:
        rows.append((f"{plan.strategy} (measured)", format_bytes(measured.peak_bytes),
                     _time(measured.step_time_s)))
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


def format_param(value: object) -> str:
    """A plan parameter as the user wrote it; a mapping of step times (auto's candidates) in ms,
    said to be predicted (they are simulated, never measured)."""
    if isinstance(value, tuple):
        return str(list(value))
    if isinstance(value, dict) and all(v is None or isinstance(v, float) for v in value.values()):
        return "{" + ", ".join(
            f"{k}: {'does not fit' if v is None else f'{v * 1e3:.3f} ms'}" for k, v in value.items()
        ) + "} (predicted)"
    return str(value)


def _round_row(index: int, round_) -> tuple[object, ...]:
    measured = round_.measured_peak_bytes
    return (index, format_bytes(round_.planning_budget_bytes),
            format_bytes(round_.predicted_peak_bytes),
            "-" if measured is None else format_bytes(measured),
            "-" if round_.step_time_s is None else _time(round_.step_time_s))


def fit_table(headers: Sequence[str], rows: Sequence[Sequence[object]], width: int) -> str:
    """``table``, or the same table transposed (one column per row) when it is wider than ``width``.

    Note:
        Result tables have few rows and many columns; turned on their side they fit an
        80-column terminal, and stay valid Markdown.
    """
    wide = table(headers, rows)
    if max(len(line) for line in wide.splitlines()) <= width or not rows:
        return wide
    columns = [str(row[0]) for row in rows]
    turned = [[header, *(row[index] for row in rows)] for index, header in enumerate(headers)]
    return table([str(headers[0]), *columns], turned[1:])
