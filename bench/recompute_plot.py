"""The recomputation section's figure: measured peak against step time, one panel per model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.recompute_methods import ModelResult, Row
from memfit.data.files import replacing

STYLES = {  # family: (colour, marker, joined by a line)
    "eager": ("black", "*", False),
    "torch.utils.checkpoint": ("tab:blue", "s", False),
    "torch.compile budget": ("tab:orange", "^", True),
    "memfit checkpoint modes": ("tab:green", "D", False),
    "memfit checkpoint memory, budget": ("tab:olive", "o", True),
    "memfit keep / swap": ("tab:gray", "X", False),
    "optimal": ("tab:red", "P", True),
}


def _points(result: ModelResult, family: str) -> list[tuple[float, float, Row]]:
    """(peak as % of eager measured the same way, step time x eager, row), by peak.

    Note:
        Both axes are ratios within a measuring method and a timing group: the profiler also
        sees kernel workspaces the dispatch tracker cannot (3D convolution's im2col buffers),
        and compiled methods were timed beside their own eager runs.
    """
    found = []
    for row in result.rows:
        eager_bytes = result.eager_peak_bytes.get(row.peak_method)
        if row.family == family and row.peak_bytes and row.step_time_s and eager_bytes:
            found.append((100 * row.peak_bytes / eager_bytes,
                          row.step_time_s / row.eager_step_time_s, row))
    return sorted(found, key=lambda point: point[0])


def plot(results: Sequence[ModelResult], path: Path | str) -> None:
    """Write the figure to ``path`` (PNG, matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 5), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        for family, (colour, marker, joined) in STYLES.items():
            points = _points(result, family)
            if points:
                optimal = family == "optimal"
                axis.plot([p[0] for p in points], [p[1] for p in points], color=colour,
                          marker=marker, markersize=10 if optimal else 9,
                          linestyle="-" if joined else "none", linewidth=2.2 if optimal else 1.5,
                          zorder=5 if optimal else 2, alpha=0.85,
                          label="optimal-recompute (every budget, sorted by peak)" if optimal
                          else family)
        eager_mib = result.eager_peak_bytes.get("tracker", 0) / 2**20
        axis.set_title(f"{result.name}\n(eager: {eager_mib:.1f} MiB by the tracker)", fontsize=9)
        axis.set_xlabel("measured peak, % of eager's (same measuring method)")
        axis.set_ylabel("step time, x eager's (median, same timing group)")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    figure.tight_layout()
    with replacing(path) as temporary:
        figure.savefig(temporary, dpi=100)
    plt.close(figure)
