"""vDNN_all (Rhu et al.): offload every layer's input feature maps, prefetch one layer ahead.

The most memory-frugal static vDNN policy: every feature map (see ``_vdnn_layers`` for what a layer
and a feature map are in a captured step) is copied to host memory after it is made, its device
buffer freed after its last forward read, and it is prefetched while the backward layer before its
reader runs.
"""

from __future__ import annotations

from memfit.core.costgraph import CostGraph
from memfit.core.hardware import Hardware
from memfit.core.plan import Plan
from memfit.strategies import register
from memfit.strategies._fit import require_fit
from memfit.strategies._vdnn_layers import (
    LayerView,
    check_attention,
    check_budget,
    resolve_attention,
)


def check_params(**params) -> None:
    """vdnn_all takes ``attention`` ('auto', 'math' or 'fused') only."""
    check_attention("vdnn_all", params)


@register("vdnn_all")
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params) -> Plan:
    """Offload every feature map after its forward use; prefetch it one backward layer ahead.

    Args:
        graph: the captured step.
        hardware: the device profile (recorded in the plan; the policy does not depend on it).
        budget_bytes: device bytes the step may use at its peak; ``None``: no check.
        attention: ``"auto"`` (default) plans with the attention backend the step was captured
            with; ``"math"`` or ``"fused"`` insist on one (see ``_vdnn_layers.resolve_attention``).

    Raises:
        ValueError: for an unknown parameter or value, or an attention backend the step lacks.
        BudgetError: if the plan's peak exceeds ``budget_bytes``; its minimum is that peak.

    Example:
        >>> from memfit.core.hardware import get_hardware
        >>> from memfit.core.synthetic import chain
        >>> sorted(plan(chain(4), get_hardware("h100-pcie")).swapped)
        ['f0', 'f1', 'f2']
    """
    attention = check_attention("vdnn_all", params)
    budget_bytes = check_budget("vdnn_all", budget_bytes)
    view = LayerView(graph)
    used = {"attention": resolve_attention(graph, attention, "vdnn_all"),
            "layers": len(view.forward)}
    result = view.make_plan("vdnn_all", view.maps, hardware, budget_bytes, used)
    return require_fit(graph, result, budget_bytes, hardware.host_bytes)
