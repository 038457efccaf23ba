"""The vDNN policies (Rhu et al.): vdnn_all, vdnn_conv and vdnn_dyn, one per registered name.

``_vdnn_layers`` says what a layer and a feature map are in a captured step; the policies differ
only in which feature maps they offload (each offloaded after its forward use and prefetched one
backward layer ahead):

- **vdnn_all**: every feature map. The most memory-frugal static policy.
- **vdnn_conv**: the feature maps forward convolutions read, the paper's middle policy for CNNs,
  where convolutions are the slow layers whose run time hides the copies. "Convolution" is
  matched strictly on the op kind (``aten.convolution`` and variants): on a transformer (GPT-2's
  ``Conv1D`` is a matrix multiply) nothing is offloaded, and with a budget below the unplanned
  peak the policy raises ``BudgetError``; use vdnn_all or vdnn_dyn there.
- **vdnn_dyn** (section III.C): the fastest vDNN configuration that fits the budget. A
  configuration is a policy (offload nothing, the convolution inputs, or every feature map) and
  an offload *boundary* (only the feature maps made by layers ``0..k-1`` are offloaded: layers
  near the input wait longest for their backward, so they are offloaded first). The search
  follows the paper: the unplanned step if it fits (it is the fastest), else vDNN_conv then
  vDNN_all, each with the smallest boundary that fits (found by bisection: offloading more never
  raises the peak, because a swapped buffer lives for a subset of the original's lifetime), a few
  larger boundaries, and the full policy; every candidate is simulated on ``hardware`` and the
  fastest that fits is returned. The full policies are candidates, so vdnn_dyn is never slower
  than vdnn_conv or vdnn_all where they fit.

Note:
    The paper also picks each layer's cuDNN algorithm (performance- vs memory-optimal workspace),
    then greedily downgrades layers until the step fits. In PyTorch the analogue is the attention
    backend, which is fixed when the step is captured: a CostGraph holds one backend per attention,
    so the algorithm axis has one point (the captured one, checked against ``attention``) and the
    greedy downgrade has nothing to act on. ``_vdnn_layers.resolve_attention`` says how to ask for
    another backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.model.schedule import live_buffers, lower, memory_profile
from memfit.model.simulate import simulate
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import HOST_DROPPED, require_fit
from memfit.planning.strategies.swapping._vdnn_layers import (
    FeatureMap,
    LayerView,
    VdnnConfig,
    check_budget,
    resolve_attention,
)
from memfit.planning.tuning import TUNING

POLICIES = ("conv", "all")  # vdnn_dyn tries the paper's order: the cheaper policy first


@dataclass(frozen=True)
class VdnnAllConfig(VdnnConfig):
    strategy: ClassVar[str] = "vdnn_all"


@dataclass(frozen=True)
class VdnnConvConfig(VdnnConfig):
    strategy: ClassVar[str] = "vdnn_conv"


@dataclass(frozen=True)
class VdnnDynConfig(VdnnConfig):
    strategy: ClassVar[str] = "vdnn_dyn"


@register("vdnn_all", config=VdnnAllConfig)
def plan_all(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
             **params) -> Plan:
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
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import chain
        >>> sorted(plan_all(chain(4), get_hardware("h100-pcie")).swapped)
        ['f0', 'f1', 'f2']
    """
    return _static(VdnnAllConfig, graph, hardware, budget_bytes, params, convolutions_only=False)


@register("vdnn_conv", config=VdnnConvConfig)
def plan_conv(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
              **params) -> Plan:
    """Offload the feature maps that forward convolutions read; prefetch one layer ahead.

    Arguments and errors as for ``plan_all``.

    Example:
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import resnet_like
        >>> sorted(plan_conv(resnet_like(1), get_hardware("h100-pcie")).swapped)
        ['b0_relu', 'stem']
    """
    return _static(VdnnConvConfig, graph, hardware, budget_bytes, params, convolutions_only=True)


def _static(config: type[VdnnConfig], graph: CostGraph, hardware: Hardware,
            budget_bytes: int | None, params: dict, convolutions_only: bool) -> Plan:
    """A static policy's plan: its feature maps offloaded, checked against ``budget_bytes``."""
    strategy, attention = config.strategy, config.from_params(params).attention
    budget_bytes = check_budget(strategy, budget_bytes)
    view = LayerView(graph)
    used = {"attention": resolve_attention(graph, attention, strategy),
            "layers": len(view.forward)}
    maps = [feature for feature in view.maps if feature.conv_input or not convolutions_only]
    result = view.make_plan(strategy, maps, hardware, budget_bytes, used)
    return require_fit(graph, result, budget_bytes, hardware.host_bytes)


@register("vdnn_dyn", config=VdnnDynConfig)
def plan_dyn(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
             **params) -> Plan:
    """The fastest simulated vDNN configuration whose peak fits ``budget_bytes``.

    Args:
        graph: the captured step.
        hardware: the device profile every candidate is simulated on.
        budget_bytes: device bytes the step may use at its peak. ``None``: the device's memory
            (``hardware.device_bytes``), as in the paper, which fits the GPU at hand.
        attention: ``"auto"`` (default) plans with the captured attention backend; ``"math"`` or
            ``"fused"`` insist on one (see the module's note).

    Raises:
        ValueError: for an unknown parameter or value, or an attention backend the step lacks.
        BudgetError: if even vDNN_all does not fit; its minimum is the smallest peak reached
            (each configuration offloads only what ``hardware.host_bytes`` holds; the error
            names that limit where it left feature maps on the device).

    Example:
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import chain
        >>> result = plan_dyn(chain(8), get_hardware("h100-pcie"), budget_bytes=8 << 20)
        >>> result.params["policy"], result.params["boundary"]
        ('all', 3)
    """
    attention = VdnnDynConfig.from_params(params).attention
    budget_bytes = check_budget("vdnn_dyn", budget_bytes)
    view = LayerView(graph)
    backend = resolve_attention(graph, attention, "vdnn_dyn")
    return _ConfigurationSearch(view, hardware, budget_bytes, backend).run()


@dataclass(frozen=True)
class _Configuration:
    plan: Plan
    peak_bytes: int
    step_time_s: float


class _ConfigurationSearch:
    def __init__(self, view: LayerView, hardware: Hardware, budget_bytes: int | None,
                 attention: str):
        self.view, self.hardware, self.budget_bytes = view, hardware, budget_bytes
        self.target = budget_bytes if budget_bytes is not None else hardware.device_bytes
        self.attention = attention
        self.tried: list[_Configuration] = []

    def run(self) -> Plan:
        unplanned = self.evaluate("none", [], 0, 0)
        if unplanned.peak_bytes <= self.target:
            return unplanned.plan
        for policy in POLICIES:
            maps = [m for m in self.view.maps if policy == "all" or m.conv_input]
            self.search_boundary(policy, maps)
        fitting = [c for c in self.tried if c.peak_bytes <= self.target]
        if fitting:
            return min(fitting, key=lambda c: (c.step_time_s, c.peak_bytes)).plan
        smallest = min(self.tried, key=lambda c: c.peak_bytes)
        schedule = lower(self.view.graph, smallest.plan)
        dominant = live_buffers(schedule, memory_profile(schedule).peak_index)
        limited = any(c.plan.params.get(HOST_DROPPED) for c in self.tried)
        raise BudgetError(self.target, smallest.peak_bytes, dominant, strategy="vdnn_dyn",
                          host_bytes=self.hardware.host_bytes if limited else None)

    def search_boundary(self, policy: str, maps: Sequence[FeatureMap]) -> None:
        """The smallest boundary that fits (bisection), a few past it, and the full policy."""
        layers = sorted({m.layer for m in maps})
        if not layers:
            return

        def by_boundary(boundary: int) -> list[FeatureMap]:
            return [m for m in maps if m.layer <= layers[boundary - 1]]

        full = self.evaluate(policy, maps, len(layers), len(layers))
        if full.peak_bytes > self.target:
            return
        low, high = 1, len(layers)  # high fits
        while low < high:
            middle = (low + high) // 2
            if self.evaluate(policy, by_boundary(middle), middle, len(layers)).peak_bytes \
                    <= self.target:
                high = middle
            else:
                low = middle + 1
        for boundary in range(high + 1, min(high + TUNING.vdnn_extra_boundaries, len(layers))):
            self.evaluate(policy, by_boundary(boundary), boundary, len(layers))

    def evaluate(self, policy: str, maps: Sequence[FeatureMap], boundary: int,
                 layers: int) -> _Configuration:
        """Simulate offloading ``maps``: the first ``boundary`` of the ``layers`` layers that hold
        the policy's feature maps (both recorded in the plan's params)."""
        params = {"attention": self.attention, "policy": policy, "boundary": boundary,
                  "policy_layers": layers, "layers": len(self.view.forward)}
        made = self.view.make_plan("vdnn_dyn", maps, self.hardware, self.budget_bytes, params)
        timeline = simulate(self.view.graph, made, self.hardware, record_intervals=False)
        candidate = _Configuration(made, timeline.peak_bytes, timeline.step_time_s)
        self.tried.append(candidate)
        return candidate
