"""vDNN_conv (Rhu et al.): offload only the input feature maps of convolution layers.

The paper's middle policy, for CNNs, where convolutions are the slow layers whose run time hides
the copies. "Convolution" is matched strictly on the op kind (``aten.convolution`` and variants):
on a transformer (GPT-2's ``Conv1D`` is a matrix multiply) nothing is offloaded, and with a budget
below the unplanned peak the policy raises ``BudgetError``; use vdnn_all or vdnn_dyn there.
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
    """vdnn_conv takes ``attention`` ('auto', 'math' or 'fused') only."""
    check_attention("vdnn_conv", params)


@register("vdnn_conv")
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params) -> Plan:
    """Offload the feature maps that forward convolutions read; prefetch one layer ahead.

    Args:
        graph: the captured step.
        hardware: the device profile (recorded in the plan; the policy does not depend on it).
        budget_bytes: device bytes the step may use at its peak; ``None``: no check.
        attention: as for vdnn_all: ``"auto"`` (default), ``"math"`` or ``"fused"``.

    Raises:
        ValueError: for an unknown parameter or value, or an attention backend the step lacks.
        BudgetError: if the plan's peak exceeds ``budget_bytes``; its minimum is that peak.

    Example:
        >>> from memfit.core.hardware import get_hardware
        >>> from memfit.core.synthetic import resnet_like
        >>> sorted(plan(resnet_like(1), get_hardware("h100-pcie")).swapped)
        ['b0_relu', 'stem']
    """
    attention = check_attention("vdnn_conv", params)
    budget_bytes = check_budget("vdnn_conv", budget_bytes)
    view = LayerView(graph)
    used = {"attention": resolve_attention(graph, attention, "vdnn_conv"),
            "layers": len(view.forward)}
    maps = [feature for feature in view.maps if feature.conv_input]
    result = view.make_plan("vdnn_conv", maps, hardware, budget_bytes, used)
    return require_fit(graph, result, budget_bytes, hardware.host_bytes)
