"""How ``strategy="auto"``'s planning time grows with depth on real captured GPT-2 steps.

Issue 13, point 5: ``auto`` on transformers GPT-2 at 24 and 48 layers should add under 5 s and
10 s of CPU to what capture and analysis take, growing near-linearly from 6 to 48 layers. The
synthetic 10,000-op graphs of ``bench.planning`` do not show it: a captured transformer's
separator blocks, swap candidates and control ops are what the planner walks.

Each depth is captured once on meta inputs (width 256, so a capture is seconds, not minutes),
analyzed for ``h100-pcie``, then planned by ``auto`` at half its unplanned simulated peak. The
planning figure is process CPU time (``time.process_time``: the machine's cores are shared, so
wall time would count the neighbours); the growth exponent is the slope of log(planning time)
over log(layers) between the shallowest and the deepest graph. Each row's plan digest (a hash of
its decisions, simulated peak and step time) shows whether a change to the planner changed a
plan. ``--profile`` prints cProfile's top entries of each plan call.

Run: ``python -m bench.planning_scaling [--layers 6 12 24 48] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import math
import pstats
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memfit import examples
from memfit.compiler.step_graph import analyzed
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.data.tables import table
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy
from memfit.search import meta_inputs
from memfit.tracing.capture import capture

LAYERS = (6, 12, 24, 48)
WIDTH = 256
BATCH_SIZE = 4
PROFILE = "h100-pcie"
FRACTION = 0.5  # of the unplanned simulated peak
GOALS_S = {24: 5.0, 48: 10.0}  # issue 13: planning CPU added to capture and analysis
SORT = "cumulative"
HEADERS = ("layers", "ops", "capture + analysis", "auto (CPU)", "auto's choice", "plan digest")


@dataclass(frozen=True)
class ScalingRow:
    """One depth: its graph's size, what capturing and planning it took, and the plan."""

    layers: int
    ops: int
    capture_s: float
    planning_s: float
    solver: str
    digest: str


def captured_graph(layers: int) -> tuple[CostGraph, float]:
    """GPT-2 of ``layers`` layers, width 256, captured on meta inputs and analyzed; and the
    wall seconds that took."""
    example = examples.gpt2(layers=layers, width=WIDTH, heads=4, vocab=1024, sequence=256)
    started = time.perf_counter()
    inputs = meta_inputs(example.make_inputs, BATCH_SIZE)
    _, graph = analyzed(capture(example.model, example.loss_fn, *inputs), get_hardware(PROFILE),
                        type(example.model).__name__, False)
    return graph, time.perf_counter() - started


def plan_digest(graph: CostGraph, plan: Plan | None) -> str:
    """A short hash of the plan's decisions and its simulated peak and step time."""
    if plan is None:
        return "no plan fits"
    timeline = simulate(graph, plan, get_hardware(PROFILE), record_intervals=False)
    content = json.dumps([plan.to_json()["decisions"], timeline.peak_bytes,
                          repr(timeline.step_time_s)], sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:12]


def planned(graph: CostGraph, profiled: bool, log: Callable[[str], None]
            ) -> tuple[Plan | None, float]:
    """``auto``'s plan at ``FRACTION`` of the peak (``None``: none fits) and its CPU seconds."""
    hardware = get_hardware(PROFILE)
    peak_bytes = simulate(graph, Plan("keep"), hardware, record_intervals=False).peak_bytes
    profiler = cProfile.Profile() if profiled else None
    started = time.process_time()
    if profiler:
        profiler.enable()
    try:
        made: Plan | None = get_strategy("auto")(graph, hardware, int(FRACTION * peak_bytes))
    except BudgetError:
        made = None
    if profiler:
        profiler.disable()
    seconds = time.process_time() - started
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(SORT).print_stats(25)
        log(text.getvalue())
    return made, seconds


def scaling_rows(layers: Sequence[int] = LAYERS, profiled: bool = False,
                 log: Callable[[str], None] = print) -> list[ScalingRow]:
    """One row per depth, captured and planned one after the other."""
    warm, _ = captured_graph(1)
    planned(warm, False, lambda _: None)  # imports and first calls
    rows = []
    for depth in layers:
        graph, capture_s = captured_graph(depth)
        made, planning_s = planned(graph, profiled, log)
        solver = made.params["solver"] if made else "no plan fits"
        row = ScalingRow(depth, len(graph.ops), capture_s, planning_s, solver,
                         plan_digest(graph, made))
        log(f"{depth} layers ({row.ops} ops): capture + analysis {capture_s:.1f} s, "
            f"auto {planning_s:.2f} s CPU ({solver}), digest {row.digest}")
        rows.append(row)
    return rows


def growth_exponent(rows: Sequence[ScalingRow]) -> float:
    """The slope of log(planning time) over log(layers), shallowest to deepest row."""
    first, last = rows[0], rows[-1]
    return math.log(last.planning_s / first.planning_s) / math.log(last.layers / first.layers)


def scaling_section(rows: Sequence[ScalingRow]) -> str:
    """The Markdown report: the table, the exponent and each goal's verdict."""
    cells = [[r.layers, r.ops, f"{r.capture_s:.1f} s", f"{r.planning_s:.2f} s", r.solver,
              r.digest] for r in rows]
    lines = [table(HEADERS, cells), ""]
    if len(rows) > 1:
        lines.append(f"Planning time grows as layers^{growth_exponent(rows):.2f} "
                     f"({rows[0].layers} to {rows[-1].layers} layers).")
    for row in rows:
        if row.layers in GOALS_S:
            limit = GOALS_S[row.layers]
            verdict = "met" if row.planning_s < limit else "not met"
            lines.append(f"Goal at {row.layers} layers (< {limit:.0f} s): {verdict}.")
    return "\n".join(lines)


SCALING_TITLE = "## Planning time on captured GPT-2 steps (auto), 6 to 48 layers"


def scaling_markdown(log: Callable[[str], None] = print) -> str:
    """The section ``bench.run`` writes: title, what was measured, the table and verdicts."""
    return "\n".join([
        SCALING_TITLE, "",
        "transformers GPT-2, width 256, captured on meta inputs and analyzed for `h100-pcie`, then "
        "planned by `auto` at half the unplanned simulated peak. Planning is process CPU time "
        "(the machine's cores are shared); capture + analysis is wall time. The digest hashes "
        "each plan's decisions, simulated peak and step time (a planner change that keeps it "
        "changed no plan).", "",
        scaling_section(scaling_rows(log=log))])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries")
    arguments = parser.parse_args(argv)
    print(scaling_section(scaling_rows(arguments.layers, arguments.profile)))


if __name__ == "__main__":
    main()
