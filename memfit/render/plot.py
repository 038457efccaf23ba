"""PNG renderer: live device bytes over one step, the picture of the TFLMS and vDNN papers.

Data first: ``memory_plot`` reads only ``Timeline`` objects (simulated or loaded from JSON), so a
saved run can be redrawn without torch or a model. matplotlib runs with the Agg backend, so this
works on a machine with no display.

Example:
    >>> memory_plot({"unplanned": step.baseline, "swap": step.predicted}, "memory.png",
    ...             budget_bytes=step.compiled.budget_bytes)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from memfit.data.costgraph import CostGraph
from memfit.data.files import replacing
from memfit.data.timeline import Timeline

MIB = 2**20
STREAMS = ("compute", "d2h", "h2d")
# one colour per kind of action in the Gantt panel; swap-outs and swap-ins stand out from compute
KIND_COLOURS = {"compute": "#4c72b0", "swap_out": "#dd8452", "swap_in": "#55a868", "wait": "#c44e52"}
PHASE_COLOURS = {"backward": "#888888", "update": "#bbbbbb"}


def with_phases(timeline: Timeline, graph: CostGraph) -> Timeline:
    """A copy of ``timeline`` whose ``meta["phase_starts"]`` gives the fraction of the program at
    which each phase begins, so that a saved timeline can draw the forward/backward boundary.

    Note:
        A timeline knows its actions only by label; compute labels are op names, so the phase of
        each action is read from ``graph``. Copies inherit the phase of the compute op before them.
    """
    phase_of = {op.name: op.phase for op in graph.ops}
    labels = timeline.memory_labels
    starts: dict[str, float] = {}
    first_labels: dict[str, str] = {}
    for index, label in enumerate(labels):
        phase = phase_of.get(label)
        if phase is not None and phase not in starts:
            starts[phase] = index / max(len(labels) - 1, 1)
            first_labels[phase] = label
    return replace(timeline, meta={**timeline.meta, "phase_starts": starts,
                                   "phase_start_labels": first_labels})


def _positions(timeline: Timeline, x_axis: str, common: frozenset[str]) -> list[float]:
    """x of each memory sample: program position in 0..1, or the simulated start time in ms.

    Note:
        Position counts only the labels every timeline has (the original ops), so a planned
        step's extra copy actions do not shift its curve against the unplanned one; each copy
        sits at the op before it. Memory is counted in program order (``model/schedule.py``), so
        on the time axis each action sits at the start of the compute action at or before it.
    """
    count = len(timeline.memory_bytes)
    if x_axis == "position" or not timeline.intervals:
        if not common:
            return [index / max(count - 1, 1) for index in range(count)]
        positions, done = [], 0
        for label in timeline.memory_labels:
            done += label in common
            positions.append(max(done - 1, 0) / max(len(common) - 1, 1))
        return positions
    compute_start = {i.label: i.start_s for i in timeline.intervals if i.stream == "compute"}
    positions, clock = [], 0.0
    for label in timeline.memory_labels:
        clock = compute_start.get(label, clock)
        positions.append(clock * 1e3)
    return positions


def _common_labels(timelines: Mapping[str, Timeline]) -> frozenset[str]:
    """Labels present in every timeline that has memory samples (empty if any lacks labels)."""
    sampled = [t for t in timelines.values() if t.memory_bytes]
    if not sampled or any(len(t.memory_labels) != len(t.memory_bytes) for t in sampled):
        return frozenset()
    common = frozenset(sampled[0].memory_labels)
    for timeline in sampled[1:]:
        common &= frozenset(timeline.memory_labels)
    return common


def _memory_panel(axes, timelines: Mapping[str, Timeline], budget_bytes: int | None,
                  x_axis: str) -> None:
    """Draw one curve per timeline with memory samples, each measured peak as a short thick bar
    at the right edge in the colour of its run's curve, the budget and the phase boundaries.

    A run is the name before its parenthesis (``"swap (measured)"`` is the ``swap`` run), so a
    run's measured peak and its predicted curve share a colour, and the budget line stays the
    only dashed red line.
    """
    common = _common_labels(timelines)
    colours: dict[str, str] = {}
    for name, timeline in timelines.items():
        if not timeline.memory_bytes:
            continue
        megabytes = [size / MIB for size in timeline.memory_bytes]
        simulated = timeline.source == "simulated"  # wide and pale, so a measured line on top shows
        (line,) = axes.plot(_positions(timeline, x_axis, common), megabytes,
                            linewidth=3.0 if simulated else 1.1, alpha=0.55 if simulated else 1.0,
                            label=f"{name} (peak {timeline.peak_bytes / MIB:.1f} MiB)")
        colours.setdefault(_run_name(name), line.get_color())
    for name, timeline in timelines.items():
        if timeline.memory_bytes:
            continue
        colour = colours.get(_run_name(name))  # None: the next colour of the cycle
        axes.axhline(timeline.peak_bytes / MIB, xmin=0.9, xmax=1.0, color=colour, linewidth=4.0,
                     solid_capstyle="butt",
                     label=f"{name} peak {timeline.peak_bytes / MIB:.1f} MiB")
    if budget_bytes is not None:
        axes.axhline(budget_bytes / MIB, color="#c44e52", linestyle="--", linewidth=1.2,
                     label=f"budget {budget_bytes / MIB:.1f} MiB")
    if x_axis == "position":
        _phase_lines(axes, timelines, common)
    axes.set_ylabel("live device memory (MiB)")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)


def _run_name(name: str) -> str:
    """The run a timeline's name belongs to: ``"swap (measured)"`` -> ``"swap"``."""
    return name.split(" (")[0]


def _phase_lines(axes, timelines: Mapping[str, Timeline], common: frozenset[str]) -> None:
    """A vertical line where backward (and the update) starts, from the first timeline that knows.

    The line sits at the first op of the phase, placed as that timeline's curve places it.
    """
    for timeline in timelines.values():
        starts = dict(timeline.meta.get("phase_starts") or {})
        first_labels = timeline.meta.get("phase_start_labels") or {}
        if first_labels and timeline.memory_bytes:
            positions = dict(zip(timeline.memory_labels, _positions(timeline, "position", common),
                                 strict=False))
            starts.update({phase: positions[label] for phase, label in first_labels.items()
                           if label in positions})
        for phase, colour in PHASE_COLOURS.items():
            if phase in starts:
                axes.axvline(starts[phase], color=colour, linewidth=1, linestyle="-.")
                axes.text(starts[phase], 0.98, f" {phase} starts", color=colour, fontsize=8,
                          va="top", transform=axes.get_xaxis_transform())
        if starts:
            return


def _gantt_panel(axes, name: str, timeline: Timeline) -> None:
    """The predicted compute / d2h / h2d streams of one timeline, coloured by action kind (and
    the communication stream of a sharded step's collectives, where it has one)."""
    has_comm = any(interval.stream == "comm" for interval in timeline.intervals)
    streams = (*STREAMS, "comm") if has_comm else STREAMS
    for row, stream in enumerate(streams):
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for interval in timeline.intervals:
            if interval.stream == stream and interval.end_s > interval.start_s:
                span = (interval.start_s * 1e3, (interval.end_s - interval.start_s) * 1e3)
                by_kind.setdefault(interval.kind, []).append(span)
        for kind, spans in by_kind.items():
            axes.broken_barh(spans, (row - 0.4, 0.8), color=KIND_COLOURS.get(kind, "#999999"))
    axes.set_yticks(range(len(streams)), streams)
    axes.set_ylim(-0.6, len(streams) + 0.4)  # room above the top row for the legend
    axes.set_xlabel(f"{timeline.source} time of {name!r} (ms)")
    handles = [axes.bar(0, 0, color=colour, label=kind) for kind, colour in KIND_COLOURS.items()]
    axes.legend(handles=handles, loc="upper right", fontsize=7, ncol=4)
    axes.grid(alpha=0.3, axis="x")


def memory_plot(timelines: Mapping[str, Timeline], path: str | Path,
                budget_bytes: int | None = None, title: str = "device memory over one step",
                x_axis: Literal["position", "time"] = "position",
                gantt: str | None | Literal[True] = True) -> Path:
    """Write a PNG of live device memory over the step, one line per timeline.

    Args:
        timelines: name -> timeline; names become legend entries. A timeline with no memory
            samples (a measured peak only) is drawn as a short bar at the right edge.
        path: where to write the PNG.
        budget_bytes: draw the budget as a dashed line (``None``: no line).
        title: the figure title.
        x_axis: ``"position"`` (default): program position normalised to 0..1, so an unplanned
            and a planned step with different action counts overlay; ``"time"``: simulated ms.
        gantt: add a second panel with the compute / d2h / h2d streams of the timeline named
            here; ``True`` (default) picks the last timeline that has intervals, ``None`` none.

    Returns:
        The path written.

    Raises:
        ValueError: if ``timelines`` is empty or ``gantt`` names an unknown timeline.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not timelines:
        raise ValueError("memory_plot needs at least one timeline")
    gantt_name = _gantt_choice(timelines, gantt)
    rows = 2 if gantt_name is not None else 1
    figure, axes = plt.subplots(rows, 1, figsize=(10, 4.2 * rows), squeeze=False,
                                height_ratios=[3, 1.4][:rows])
    _memory_panel(axes[0][0], timelines, budget_bytes, x_axis)
    axes[0][0].set_xlabel(x_label(timelines, x_axis))
    axes[0][0].set_title(title)
    if gantt_name is not None:
        _gantt_panel(axes[1][0], gantt_name, timelines[gantt_name])
    figure.tight_layout()
    path = Path(path)
    with replacing(path) as temporary:
        figure.savefig(temporary, dpi=110)
    plt.close(figure)
    return path


def x_label(timelines: Mapping[str, Timeline], x_axis: str) -> str:
    """The memory panel's x label: program position, or the time axis named by where its
    times come from (a timeline without intervals, such as a measured peak, has no times and is
    drawn by program position either way; a measured one with intervals is never "simulated")."""
    timed = sorted({t.source for t in timelines.values() if t.intervals and t.memory_bytes})
    if x_axis == "position" or not timed:
        return "program position (fraction of the step's ops run)"
    return f"{' and '.join(timed)} time (ms)"


def _gantt_choice(timelines: Mapping[str, Timeline], gantt: str | None | bool) -> str | None:
    if gantt is None or gantt is False:
        return None
    if gantt is True:
        with_intervals: Sequence[str] = [n for n, t in timelines.items() if t.intervals]
        return with_intervals[-1] if with_intervals else None
    if gantt not in timelines:
        raise ValueError(f"gantt={gantt!r} names no timeline: use one of {sorted(timelines)}")
    return gantt
