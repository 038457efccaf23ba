"""Recomputation on the CPU (issue #3): memory / step-time curves of every way to trade time for memory.

For each model, in one process, on one batch with one seed: eager; ``torch.utils.checkpoint``
around every block and around every other block; ``torch.compile(backend="aot_eager")`` under
``activation_memory_budget``; memfit's ``checkpoint`` modes and budgets; memfit ``keep`` and
``swap`` for reference; and the optimal schedule (``optimal-recompute``) at fractions of the
unplanned peak, then at the measured peak of every other recomputing method and at its own minimum,
with a computed verdict per model: does the optimal schedule sit on or below each other method?

Peaks are the step's device bytes: parameters and inputs plus the step's own peak above them, by
memfit's dispatch tracker, or by the profiler's allocator events for compiled code (a dispatch
mode would disable it). Step times are medians of timed steps run in turn (a, b, c, a, b, c, ...)
after a warm-up, so that the load of a shared machine falls on every method alike.

Three files: the methods and their rows (``bench/recompute_methods.py``), running and measuring
them (``bench/recompute_measure.py``), and here the tables, the verdict and the section's text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import memfit
from bench.common import mib, ms
from bench.recompute_measure import measure_model
from bench.recompute_methods import (
    OPTIMAL,
    REPEATS,
    SINGLE_THREAD_NOTE,
    ModelResult,
    RecomputeModel,
)
from memfit import examples
from memfit.data.tables import table

RECOMPUTE_HEADERS = ("method", "measured peak", "% of eager", "measured by",
                     f"step time (median of {REPEATS})", "x eager", "memfit predicted peak",
                     "gradients vs eager")


def render_rows(result: ModelResult) -> list[tuple]:
    """Table rows; a method that did not run shows why in place of its peak."""
    rendered = []
    for row in result.rows:
        if row.peak_bytes is None:
            rendered.append((row.name, row.note, "-", row.peak_method, "-", "-", "-", "-"))
            continue
        eager_bytes = result.eager_peak_bytes.get(row.peak_method)
        share = f"{row.peak_bytes / eager_bytes:.0%}" if eager_bytes else "-"
        ratio = (f"{row.step_time_s / row.eager_step_time_s:.2f}x"
                 if row.step_time_s and row.eager_step_time_s else "-")
        predicted = mib(row.predicted_bytes) if row.predicted_bytes is not None else "-"
        step = ms(row.step_time_s) if row.step_time_s is not None else "-"
        rendered.append((row.name, mib(row.peak_bytes), share, row.peak_method, step, ratio,
                         predicted, row.gradients))
    return rendered


VERDICT_HEADERS = ("alternative", "its peak", "optimal's budget (memfit frame)", "optimal's peak",
                   "peak <=", "step time: alternative / optimal", "step time <=",
                   "predicted recompute: alternative / optimal", "recompute <=", "optimal's solver")


def _at_most(mine: float | None, theirs: float | None, slack: float = 0.0) -> str:
    if mine is None or theirs is None:
        return "-"
    return "yes" if mine <= theirs * (1 + slack) + 1e-12 else "**no**"


def verdict(result: ModelResult) -> tuple[list[tuple], list[str]]:
    """The optimal row at each alternative's peak against that alternative, computed.

    Returns:
        the verdict table's rows, and summary lines (counts of "yes", the minimum, the solvers).
    """
    by_name = {row.name: row for row in result.rows}
    rows, peaks, times, recomputes = [], [], [], []
    for optimal in (row for row in result.rows if row.copies):
        other = by_name[optimal.copies]
        budget = mib(optimal.budget_bytes) if optimal.budget_bytes is not None else "-"
        if optimal.peak_bytes is None:
            rows.append((other.name, mib(other.peak_bytes), budget, optimal.note, "**no**", "-",
                         "-", "-", "-", "-"))
            peaks.append("**no**")
            continue

        def pair(a: float | None, b: float | None, show: Callable[[float], str]) -> str:
            return f"{show(a) if a is not None else 'n/a'} / {show(b) if b is not None else 'n/a'}"

        peak_ok = _at_most(optimal.peak_bytes, other.peak_bytes)
        time_ok = _at_most(optimal.step_time_s, other.step_time_s)
        recompute_ok = _at_most(optimal.predicted_recompute_s, other.predicted_recompute_s)
        peaks.append(peak_ok)
        times.append(time_ok)
        recomputes.append(recompute_ok)
        rows.append((other.name, mib(other.peak_bytes), budget,
                     f"{mib(optimal.peak_bytes)} ({optimal.peak_method})", peak_ok,
                     pair(other.step_time_s, optimal.step_time_s, ms), time_ok,
                     pair(other.predicted_recompute_s, optimal.predicted_recompute_s, ms),
                     recompute_ok, optimal.solver or "-"))

    def count(found: list[str]) -> str:
        priced = [f for f in found if f != "-"]
        return f"{priced.count('yes')} of {len(priced)}"

    lines = [f"Verdict, computed from the rows above (the budget: the alternative's peak in "
             f"memfit's frame, its predicted peak where it is a memfit plan): at each of {len(peaks)} other methods' "
             f"measured peaks, the optimal schedule's measured peak is at or below it for "
             f"{count(peaks)}; its predicted recompute time (the planner's objective, memfit's "
             f"cost model) is at or below the alternative's for {count(recomputes)} (those "
             f"memfit can price: its own plans, and torch.utils.checkpoint as every forward op of "
             f"the wrapped blocks; torch.compile's partition is not priced); its measured step "
             f"time is at or below for {count(times)}. Step times are medians of {REPEATS} on a "
             f"shared 2-core CPU: differences of a few percent are noise."]
    minimum = [row for row in result.rows if row.family == "optimal" and not row.copies
               and row.name.endswith("at its minimum")]
    eager = result.eager_peak_bytes.get("tracker")
    for row in minimum:
        if row.peak_bytes is None:
            lines.append(f"At its own minimum ({mib(row.budget_bytes or 0)}): {row.note}.")
            continue
        share = f", {row.peak_bytes / eager:.0%} of eager" if eager else ""
        lines.append(f"At its own minimum, a budget of {mib(row.budget_bytes or 0)}: measured "
                     f"peak {mib(row.peak_bytes)}{share}, step time {ms(row.step_time_s or 0)}, "
                     f"predicted recompute {ms(row.predicted_recompute_s or 0)}, solver "
                     f"`{row.solver or '-'}`.")
    keep = by_name.get('memfit "keep"')
    if keep is not None and keep.step_time_s and keep.eager_step_time_s:
        lines.append(f'memfit "keep" (no recomputation, no swapping) ran at '
                     f"{keep.step_time_s / keep.eager_step_time_s:.2f}x eager's step time here: "
                     "memfit's executor overhead, which every memfit row pays on top of its "
                     "recomputation and torch.utils.checkpoint / torch.compile do not.")
    solvers = sorted({row.solver for row in result.rows if row.family == "optimal" and row.solver})
    lines.append("Solvers that won (`plan.params[\"solver\"]`) across this model's optimal rows: "
                 + (", ".join(f"`{name}`" for name in solvers) or "none") + ".")
    return rows, lines


RECOMPUTE_MODELS = (
    RecomputeModel("GPT-2 (6 layers, width 192, sequence 256, batch 4)",
                   lambda: examples.gpt2(layers=6, width=192, heads=4, vocab=256, sequence=256), 4,
                   ("GPT2Block",), "a transformer block `transformer.h.<i>` (6)"),
    RecomputeModel("ResNet-50-shaped (stage widths 32-256, 128x128 images, batch 4)",
                   lambda: examples.resnet50_shaped(widths=(32, 64, 128, 256), image=128), 4,
                   ("ResNetBottleNeckLayer",),
                   "a bottleneck layer `resnet.encoder.stages.<i>.layers.<j>` (16)"),
    RecomputeModel("3D U-Net (MONAI, channels 4-32, 48^3 volumes, batch 2)",
                   lambda: examples.unet3d(channels=(4, 8, 16, 32), size=48), 2,
                   ("ResidualUnit", "Convolution"),
                   "a MONAI `ResidualUnit` (4 down, 3 up) or an up-sampling `Convolution` "
                   "(3), outermost only"),
)


def recompute_section(log: Callable[[str], None], plot_path=None,
                      models: Sequence[RecomputeModel] = RECOMPUTE_MODELS) -> str:
    """The Markdown section of RESULTS.md; draws the curves to ``plot_path`` when given."""
    results, parts = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see SINGLE_THREAD_NOTE
    try:
        for bench in models:
            started = time.perf_counter()
            results.append(measure_model(bench, log))
            log(f"recompute {bench.name}: {time.perf_counter() - started:.0f} s")
    finally:
        torch.set_num_threads(threads)
    for bench, result in zip(models, results, strict=True):
        parts += [f"\n### {bench.name}\n", f"A block is {bench.block_description}.\n",
                  table(RECOMPUTE_HEADERS, render_rows(result))]
        verdict_rows, lines = verdict(result)
        if verdict_rows:
            parts += ["\n" + lines[0] + "\n", table(VERDICT_HEADERS, verdict_rows),
                      "\n" + " ".join(lines[1:]) + "\n"]
    if plot_path is not None:
        from bench.recompute_plot import plot

        plot(results, plot_path)
    if OPTIMAL not in memfit.strategy_names():
        log(f"recompute: strategy {OPTIMAL!r} is not available yet; no optimal rows")
    optimal = (f"The `{OPTIMAL}` rows plan the least recompute time that fits: Checkmate's MILP "
               "on graphs of up to 100 ops, a DP over separator blocks above (these models have "
               "hundreds to a thousand ops), and the checkpoint \"memory\" / \"speed\" plans "
               "priced beside it; the verdict names the solver that won. They run at the same "
               "fractions as memfit's budgets, then, after the other methods are measured, at "
               "the measured peak of each torch.utils.checkpoint row, each memfit checkpoint "
               "mode and each torch.compile row below eager, as a budget in bytes (memfit's "
               "budget, like the tracker's peak, counts parameters and inputs; a compiled row's "
               "profiler peak is first lowered by eager's profiler-minus-tracker difference, "
               "and the optimal row beside it is measured by the profiler and timed in the "
               "compiled row's group), and at its own minimum (the strategy's "
               "`BudgetError.minimum_bytes` for a 1-byte budget on the captured graph)." if
               OPTIMAL in memfit.strategy_names() else f"The optimal schedule (`{OPTIMAL}`) is "
               "not available in this build: no rows for it.")
    intro = [
        "## Recomputation: memory / step-time curves\n",
        "On this CPU, where recomputing costs real time. Per model, one process, one batch, one "
        "seed. Measured peak: the step's device bytes, parameters and inputs included, by "
        "memfit's dispatch tracker, or for torch.compile by the profiler's allocator events (a "
        "dispatch mode disables compiled code) plus the same parameter and input bytes; % of "
        "eager compares with eager measured the same way. Step time: the median of "
        f"{REPEATS} steps after a warm-up, the tracker's methods timed in turn (a, b, c, a, ...), "
        "each compiled method in turn with eager, so `x eager` compares within one group. "
        "Memfit budgets are fractions of the unplanned (predicted) peak; memfit runs with "
        "`measure=False`. " + SINGLE_THREAD_NOTE + " " + optimal,
        f"\n![memory / step-time curves]({Path(plot_path).name if plot_path else 'recompute.png'})"
        "\n",
    ]
    return "\n".join(intro + parts)
