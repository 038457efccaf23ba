"""Timeline: one run of a step, simulated or measured, in one type so that the two compare.

Data first: renderers (text tables, PNG plots) read a ``Timeline``; ``save``/``load`` keep one on
disk so a plot can be redrawn without running anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from memfit.data.files import write_text

Stream = Literal["compute", "d2h", "h2d", "comm"]  # comm: collectives (sharded steps)


class Interval(NamedTuple):
    """One action on one stream: ``[start_s, end_s)``. A named tuple, as ``Action`` is: a
    simulation with intervals makes one per action, and a frozen dataclass costs several times
    as much to build."""

    stream: Stream
    label: str
    start_s: float
    end_s: float
    kind: str = "compute"


@dataclass(frozen=True)
class Timeline:
    """A run of one step.

    Args:
        source: ``"simulated"`` or ``"measured"``.
        intervals: what ran on each stream and when (may be empty for a memory-only measurement).
        memory_labels: the program-order actions, one per ``memory_bytes`` sample.
        memory_bytes: live device bytes while each action ran (its allocations made).
        peak_bytes: the highest device bytes seen.
        step_time_s: end of the last action.
        exposed_transfer_s: compute time spent waiting for copies (what swapping costs).
        recompute_s: compute time spent re-running forward ops (what recomputing costs).
        peak_label: the action at the peak.
        host_peak_bytes: the most bytes swapped out to the host and not yet freed at once
            (``memfit.model.host_memory``; what ``Hardware.host_bytes`` limits).
    """

    source: Literal["simulated", "measured"]
    peak_bytes: int
    step_time_s: float
    exposed_transfer_s: float = 0.0
    recompute_s: float = 0.0
    intervals: tuple[Interval, ...] = ()
    memory_labels: tuple[str, ...] = ()
    memory_bytes: tuple[int, ...] = ()
    peak_label: str = ""
    host_peak_bytes: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        return {**asdict(self), "intervals": [interval._asdict() for interval in self.intervals]}

    @staticmethod
    def from_json(data: dict) -> Timeline:
        return Timeline(
            source=data["source"],
            peak_bytes=int(data["peak_bytes"]),
            step_time_s=float(data["step_time_s"]),
            exposed_transfer_s=float(data.get("exposed_transfer_s", 0.0)),
            recompute_s=float(data.get("recompute_s", 0.0)),
            intervals=tuple(Interval(**i) for i in data.get("intervals", ())),
            memory_labels=tuple(data.get("memory_labels", ())),
            memory_bytes=tuple(int(b) for b in data.get("memory_bytes", ())),
            peak_label=data.get("peak_label", ""),
            host_peak_bytes=int(data.get("host_peak_bytes", 0)),
            meta=dict(data.get("meta", {})),
        )

    def save(self, path: str | Path) -> None:
        write_text(path, json.dumps(self.to_json()))

    @staticmethod
    def load(path: str | Path) -> Timeline:
        return Timeline.from_json(json.loads(Path(path).read_text()))


def peak_gap(predicted: Timeline, measured: Timeline) -> float:
    """Relative gap of the predicted peak to the measured one: (predicted - measured) / measured."""
    if measured.peak_bytes == 0:
        return 0.0 if predicted.peak_bytes == 0 else float("inf")
    return (predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes
