"""Text summaries for the command line: a plan on a hardware profile, and a saved timeline.

The renderers read only data: ``memfit.examples.plan_example`` builds the ``Planned`` they print.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.data.costgraph import CostGraph
from memfit.data.plan import Plan
from memfit.data.tables import format_ms
from memfit.data.timeline import Timeline
from memfit.data.units import format_bytes

BARS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Planned:
    """A planned, not run, step: what ``memfit plan`` prints."""

    model: str
    batch_size: int
    graph: CostGraph
    plan: Plan
    baseline: Timeline
    predicted: Timeline
    budget_bytes: int | None


def plan_summary(planned: Planned, width: int = 100, depth: int = 3,
                 rows: int | None = 40) -> str:
    """What ``memfit plan`` prints: the model and graph in one line, then ``plan.explain()``."""
    graph = planned.graph
    regions = len(planned.plan.regions)
    where = f"{regions} regions (graph breaks); the one whose peak is highest: " if regions else ""
    return (f"{planned.model}, batch {planned.batch_size}: {where}{len(graph.ops)} ops, "
            f"{len(graph.saved_tensors())} saved tensors\n"
            + planned.plan.explain(depth=depth, width=width, rows=rows))


def sparkline(values: tuple[int, ...], width: int) -> str:
    """``values`` squeezed into ``width`` block characters, each the maximum of its bucket."""
    if not values or width <= 0:
        return ""
    top = max(values) or 1
    buckets = min(width, len(values))
    line = []
    for bucket in range(buckets):
        chunk = values[bucket * len(values) // buckets:(bucket + 1) * len(values) // buckets]
        line.append(BARS[round(max(chunk) / top * (len(BARS) - 1))])
    return "".join(line)


def _times(timeline: Timeline) -> str:
    """The step's times, said to be simulated or measured; a measured run without intervals
    (a whole-step measurement) has no copy or re-run times, and does not claim zeros."""
    if timeline.source == "measured" and not timeline.intervals:
        return (f"step time {format_ms(timeline.step_time_s)} (measured, the whole step: copy and "
                "re-run times not measured)")
    return (f"step time {format_ms(timeline.step_time_s)}, exposed transfer "
            f"{format_ms(timeline.exposed_transfer_s)}, re-runs {format_ms(timeline.recompute_s)} "
            f"({timeline.source})")


def timeline_summary(timeline: Timeline, width: int = 100) -> str:
    """A saved timeline in a few lines: peak, time, where the peak is, the memory curve."""
    meta = timeline.meta
    lines = [f"{timeline.source} timeline" + (f" of {meta['graph']}" if "graph" in meta else "")
             + (f", strategy {meta['strategy']!r}" if "strategy" in meta else "")
             + (f", hardware {meta['hardware']}" if "hardware" in meta else ""),
             f"peak {format_bytes(timeline.peak_bytes)}"
             + (f" at {timeline.peak_label}" if timeline.peak_label else "")
             + f"; {_times(timeline)}; {len(timeline.memory_bytes)} actions"]
    if "measured_peak_bytes" in meta:
        lines.append(f"measured peak of the run: {format_bytes(meta['measured_peak_bytes'])}")
    if timeline.memory_bytes:
        lines.append(f"memory (0 .. {format_bytes(max(timeline.memory_bytes))}), "
                     "program order left to right:")
        lines.append(sparkline(timeline.memory_bytes, max(width - 2, 10)))
    return "\n".join(lines)
