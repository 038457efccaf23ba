"""Every feature map swapped, each back just in time: vDNN with zero lookahead, auto's frugal swap.

vDNN prefetches a feature map one backward layer ahead of its reader so that the copy hides
behind that layer's compute; the copy so lives on the device through the whole layer before,
and how long that is depends on what a layer is (``_vdnn_layers``: a run of ops sharing a module
path). With zero lookahead each copy is issued right after the op before its reader, so at any
op the device holds only the swapped values that op reads: the least memory a swap plan of the
feature maps reaches. A value read by backward ops far apart (a block's input, read by the
residual add's backward and again by the query, key and value projections' backward) comes back
once per run of adjacent readers, so no copy waits on the device between them. On a CPU the
copies are synchronous anyway; on a GPU each copy back stalls the step by its transfer time,
which auto weighs against the other candidates: it wins where it is the fastest that fits,
typically where nothing else fits: it lowers the smallest peak auto reaches below what
recomputation reaches on some models (``bench/auto_floors.py`` measures it in the user's loop).

A run of readers that starts right after the original's last forward read is served by the
original (a copy made there would live as long, and free nothing), and a value with no other
run is not swapped: it would only cost copies. One pass over the feature maps builds the plan;
``require_fit`` simulates its memory once. Recomputation is not combined here: every forward
value that a backward op reads after its last forward read is a feature map, and the others
live on for a later forward or update reader whatever the plan does.
"""

from __future__ import annotations

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Decision, Plan, Swap, SwapIn
from memfit.model.host_memory import within_host
from memfit.planning.strategies._budget_checks import host_params, require_fit
from memfit.planning.strategies.swapping._vdnn_layers import FeatureMap, LayerView

NAME = "jit-swap"


def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None) -> Plan:
    """Swap every feature map out after its producer, back right before each run of its readers.

    Args:
        graph: the captured step.
        hardware: the device profile: its ``host_bytes`` limits the swaps (feature maps are
            added in layer order while the host holds them; the rest are kept).
        budget_bytes: device bytes the step may use at its peak; ``None``: no check.

    Raises:
        BudgetError: if the plan's peak exceeds ``budget_bytes``; its minimum is that peak, at
            which this plan fits (it names ``host_bytes`` where that limit left swaps out).

    Example:
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import chain
        >>> made = plan(chain(4), get_hardware("cpu"))
        >>> [swap_in.after for swap_in in made.decisions["f0"].swap_ins]
        ['f2_backward']
    """
    wanted: dict[str, Decision] = {}
    for feature in LayerView(graph).maps:
        swap = _just_in_time(graph, feature)
        if swap is not None:
            wanted[feature.tensor] = swap
    decisions, dropped = within_host(graph, wanted, hardware.host_bytes)
    made = Plan(NAME, decisions, graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, params={"swapped": len(decisions), **host_params(dropped)})
    return require_fit(graph, made, budget_bytes, hardware.host_bytes)


def _just_in_time(graph: CostGraph, feature: FeatureMap) -> Swap | None:
    """The swap of one feature map: one copy back per run of adjacent backward readers, issued
    after the op before the run; ``None`` where no copy frees anything.

    A run that starts right after the last forward read is served by the original (not named
    in any ``SwapIn``, so it lives up to that run's end): a copy made there would live exactly
    as long.
    """
    ops = graph.ops
    swap_ins = []
    for run in _adjacent_runs(feature.consumers):
        control = run[0] - 1
        if control > feature.floor:
            swap_ins.append(SwapIn(ops[control].name, tuple(ops[c].name for c in run)))
    if not swap_ins:
        return None
    reason = (f"swapped out after its last forward read ({ops[feature.floor].name}), back right "
              f"before each run of readers ({len(swap_ins)} copies; zero lookahead: least "
              "memory, the copies not hidden)")
    return Swap(tuple(swap_ins), reason=reason)


def _adjacent_runs(positions: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``positions`` (ascending) cut wherever an op lies between two of them: a copy kept
    across that op would hold memory no reader needs there."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and position - 1 == runs[-1][-1]:
            runs[-1].append(position)
        else:
            runs.append([position])
    return [tuple(run) for run in runs]
