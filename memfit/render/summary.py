"""Text summaries for the command line: a plan on a hardware profile, and a saved timeline.

``plan_example`` is the one place here that touches torch: it builds an example model, captures
its step and plans it (nothing runs). The renderers read only the resulting data.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.core.costgraph import CostGraph
from memfit.core.plan import Plan
from memfit.core.timeline import Timeline
from memfit.core.units import format_bytes
from memfit.render.text import fit_table

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


def plan_example(model: str, batch_size: int | None, model_args: Mapping[str, Any],
                 budget: str | None, hardware: str, strategy: str | None,
                 params: Mapping[str, Any]) -> Planned:
    """Build ``examples.<model>``, capture its step and plan it for ``hardware``.

    Note:
        The model is built on the CPU with random weights and real (small) inputs; capture traces
        with fake tensors, so no step runs. GPT-2 cannot yet be captured from ``meta`` inputs
        (transformers' mask code reads a value), which is why real inputs are used here.

    Raises:
        ValueError: unknown model argument, strategy, parameter or hardware; a bad budget.
        BudgetError: if the strategy cannot reach the budget.
    """
    from memfit import examples
    from memfit.api import make_plan, resolve_budget_and_strategy
    from memfit.core.hardware import get_hardware
    from memfit.core.simulate import simulate
    from memfit.graph.analyze import analyze
    from memfit.graph.capture import capture

    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    profile = get_hardware(hardware)
    try:
        example = examples.EXAMPLES[model](**model_args)
    except TypeError as error:
        raise ValueError(f"bad --model-arg for {model}: {error}") from None
    batch = batch_size or example.batch_size
    inputs = tuple(t.to("meta") for t in example.inputs(batch))  # shapes only: nothing runs
    captured = capture(example.model, example.loss_fn, *inputs)
    graph = analyze(captured, profile, name=example.name)
    made, baseline, budget_bytes = make_plan(graph, profile, parsed, chosen, params)
    return Planned(model, batch, graph, made, baseline, simulate(graph, made, profile),
                   budget_bytes)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.1 else f"{seconds * 1e3:.1f} ms"


def swapped_by_scope(graph: CostGraph, plan: Plan, depth: int) -> list[tuple[str, int, int, int]]:
    """``(scope, tensors, bytes, swap-ins)`` of the swapped tensors, grouped by the first
    ``depth`` parts of their producer's module path, in execution order."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    order: dict[str, int] = {}
    for name in plan.swapped:
        tensor = graph.tensors[name]
        assert tensor.producer is not None
        scope = ".".join(graph.op(tensor.producer).scope.split(".")[:depth]) or "(top level)"
        order.setdefault(scope, graph.index[tensor.producer])
        group = groups[scope]
        group[0] += 1
        group[1] += tensor.size_bytes
        group[2] += len(plan.decisions[name].swap_ins)  # type: ignore[union-attr]
    return [(scope, *groups[scope]) for scope in sorted(groups, key=order.__getitem__)]


def plan_summary(planned: Planned, width: int = 100, depth: int = 3) -> str:
    """Unplanned vs predicted peak and step time, exposed transfer, swapped tensors by scope."""
    plan, graph = planned.plan, planned.graph
    budget = format_bytes(planned.budget_bytes) if planned.budget_bytes else "none"
    rows = [("unplanned", format_bytes(planned.baseline.peak_bytes),
             _ms(planned.baseline.step_time_s), "-"),
            (f"{plan.strategy} (predicted)", format_bytes(planned.predicted.peak_bytes),
             _ms(planned.predicted.step_time_s), _ms(planned.predicted.exposed_transfer_s))]
    lines = [f"{planned.model}, batch {planned.batch_size}: {len(graph.ops)} ops, "
             f"{len(graph.saved_tensors())} saved tensors; strategy {plan.strategy!r}, "
             f"budget {budget}, hardware {plan.hardware}",
             fit_table(("step", "peak", "step time", "exposed transfer"), rows, width)]
    groups = swapped_by_scope(graph, plan, depth)
    if groups:
        swapped_bytes = sum(bytes_ for _, _, bytes_, _ in groups)
        lines.append(f"swapped: {len(plan.swapped)} tensors, {format_bytes(swapped_bytes)}, "
                     f"{plan.swap_in_count} swap-ins; by module scope:")
        lines.append(fit_table(("scope", "tensors", "bytes", "swap-ins"),
                               [(s, n, format_bytes(b), k) for s, n, b, k in groups], width))
    recomputed = getattr(plan, "recomputed", ())
    if recomputed:
        lines.append(f"recomputed: {len(recomputed)} tensors, "
                     f"{format_bytes(sum(graph.tensors[n].size_bytes for n in recomputed))}")
    tuned = {k: v for k, v in plan.params.items() if k in ("n_tensors", "lb", "swap_branches")}
    if tuned:
        lines.append("parameters: " + ", ".join(f"{k}={v}" for k, v in tuned.items()))
    return "\n".join(lines)


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


def timeline_summary(timeline: Timeline, width: int = 100) -> str:
    """A saved timeline in a few lines: peak, time, where the peak is, the memory curve."""
    meta = timeline.meta
    lines = [f"{timeline.source} timeline" + (f" of {meta['graph']}" if "graph" in meta else "")
             + (f", strategy {meta['strategy']!r}" if "strategy" in meta else "")
             + (f", hardware {meta['hardware']}" if "hardware" in meta else ""),
             f"peak {format_bytes(timeline.peak_bytes)}"
             + (f" at {timeline.peak_label}" if timeline.peak_label else "")
             + f"; step time {_ms(timeline.step_time_s)}; exposed transfer "
             f"{_ms(timeline.exposed_transfer_s)}; {len(timeline.memory_bytes)} actions"]
    if "measured_peak_bytes" in meta:
        lines.append(f"measured peak of the run: {format_bytes(meta['measured_peak_bytes'])}")
    if timeline.memory_bytes:
        lines.append(f"memory (0 .. {format_bytes(max(timeline.memory_bytes))}), "
                     "program order left to right:")
        lines.append(sparkline(timeline.memory_bytes, max(width - 2, 10)))
    return "\n".join(lines)
