"""Plain text tables that fit a terminal, and the figures in them: shared by every text memfit
prints (``plan.explain()``, ``step.report()``, ``memfit demo``, the command line, the benchmarks).

Data only: they read the frozen types (``Tally``) and nothing above them, so ``Plan.explain``
(``memfit.data.plan_text``) renders with them in the data layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.data.explanation import Tally
from memfit.data.units import format_bytes


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


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


def format_time(seconds: float) -> str:
    """Seconds in milliseconds to two places; ``"-"`` for a negative time (none measured)."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 0 else "-"


def format_ms(seconds: float | None) -> str:
    """Seconds in milliseconds, three places below 0.1 s and one above; ``"-"`` for ``None``."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.1 else f"{seconds * 1e3:.1f} ms"


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
                     f"{format_time(counted.exposed_transfer_s)} {how}")
    if not counted.rerun_count:
        return [*lines, "re-runs: none (no forward op runs twice)"]
    return [*lines, f"re-runs: {counted.rerun_count} forward op runs ({counted.rerun_ops} "
                    f"distinct ops) rebuild {format_bytes(counted.rerun_bytes)}, "
                    f"{format_time(counted.recompute_s)} of compute {how}"]
