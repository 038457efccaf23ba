"""The vDNN view of a CostGraph: layers, their feature maps, offload with one-layer-ahead prefetch.

vDNN (Rhu et al.) reasons in *layers*: it offloads a layer's input feature maps after the layer's
forward pass and, while layer n runs backward, prefetches what layer n-1's backward will read. A
captured step has no layers, only aten ops, so memfit defines them as follows.

- **Layer**: a maximal run of consecutive ops of one phase that share a module path (``Op.scope``);
  an op with no scope (the loss, gradient accumulation) joins the run before it. On a CNN this is
  the paper's granularity (one ``Conv2d``, ``BatchNorm2d``, ``ReLU`` or pooling module per layer),
  on a transformer one module (``ln_1``, ``attn.c_attn``, the attention core, ``mlp.act``). Module
  paths are recorded on forward *and* backward ops, so the same rule finds the backward layers,
  and it needs no list of "layer" op kinds that would go stale.
- **Feature map**: a storage made by a forward op, not returned by the step, with bytes, that a
  backward op reads after its last forward read: what some layer's backward needs that is not a
  parameter. A layer's inputs and the intermediates a multi-op module saves (the attention
  probabilities of a math-backend attention) are both feature maps: each is the input ``X`` of a
  finer cuDNN-style layer. Its *layer* is the forward layer of its producer, so offloading layers
  ``0..k-1`` offloads the inputs of layers ``1..k``.
- **Conv input**: a feature map that a forward convolution reads (``aten.convolution`` and its
  variants, transposed ones included), matched on the op kind only. GPT-2's ``Conv1D`` modules are
  matrix multiplies and are *not* convolutions: vdnn_conv offloads nothing on a transformer.
- **Offload and prefetch**: ``Swap`` (the swap-out follows the producer; the device buffer dies
  after the last forward read) with one ``SwapIn`` serving every backward reader, issued after the
  first op of the backward layer that runs just before the layer of the first reader: one layer
  of lookahead, as in the paper. For the first backward layer it is issued right before the reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from numbers import Integral
from typing import Any, ClassVar

from memfit.data.costgraph import CostGraph, Phase
from memfit.data.hardware import Hardware
from memfit.data.plan import Decision, Plan, Swap, SwapIn
from memfit.model.host_memory import within_host
from memfit.planning.strategies._budget_checks import host_params
from memfit.planning.strategies._strategy_config import StrategyConfig

ATTENTION_CHOICES = ("auto", "math", "fused")
# Fused scaled-dot-product-attention kernels save only out and logsumexp for backward; the math
# backend (decomposed into bmm, softmax, dropout) saves the attention probabilities.
_FUSED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention",
                    "_flash_attention_forward", "_efficient_attention_forward")
_SOFTMAX = ("_softmax", "_safe_softmax", "softmax")


@dataclass(frozen=True)
class FeatureMap:
    """One offloadable saved activation.

    Args:
        tensor: its name.
        layer: the forward layer of its producer.
        conv_input: whether a forward convolution reads it.
        floor: the last op that reads the device original (its producer if no forward reader).
        consumers: the backward ops served by the prefetched copy, in execution order.
    """

    tensor: str
    layer: int
    conv_input: bool
    floor: int
    consumers: tuple[int, ...]


def layer_runs(graph: CostGraph, phase: Phase) -> tuple[tuple[int, ...], ...]:
    """The layers of one phase: op indices of each maximal run sharing a scope (see the module)."""
    runs: list[list[int]] = []
    scope = ""
    for index, op in enumerate(graph.ops):
        if op.phase != phase:
            continue
        if runs and (not op.scope or op.scope == scope):
            runs[-1].append(index)
        else:
            runs.append([index])
            scope = op.scope
    return tuple(tuple(run) for run in runs)


def is_convolution(kind: str) -> bool:
    """``aten.convolution``, ``aten.conv2d``, ``aten.cudnn_convolution``, ...; not backward ops."""
    base = kind.removeprefix("aten.").split(".")[0]
    return ("convolution" in base or base.startswith("conv")) and "backward" not in base


class LayerView:
    """A graph seen as vDNN layers: feature maps by layer, and the plans that offload them."""

    def __init__(self, graph: CostGraph):
        self.graph = graph
        self.forward = layer_runs(graph, "forward")
        self.backward = layer_runs(graph, "backward")
        self.backward_layer = {i: n for n, run in enumerate(self.backward) for i in run}

    @cached_property
    def maps(self) -> tuple[FeatureMap, ...]:
        """Every feature map, by layer, then by producer."""
        graph, ops = self.graph, self.graph.ops
        forward_layer = {i: n for n, run in enumerate(self.forward) for i in run}
        found = []
        for tensor in graph.tensors.values():
            if tensor.producer is None or tensor.is_output or tensor.size_bytes <= 0:
                continue
            producer = graph.index[tensor.producer]
            if ops[producer].phase != "forward":
                continue
            readers = [graph.index[c] for c in tensor.consumers]
            floor = max([producer] + [r for r in readers if ops[r].phase != "backward"])
            served = tuple(r for r in readers if r > floor and ops[r].phase == "backward")
            if not served:
                continue
            conv = any(ops[r].phase == "forward" and is_convolution(ops[r].kind) for r in readers)
            found.append((producer, FeatureMap(tensor.name, forward_layer[producer], conv, floor,
                                               served)))
        return tuple(feature for _, feature in sorted(found, key=lambda f: (f[1].layer, f[0])))

    def offload(self, maps: Iterable[FeatureMap]) -> dict[str, Swap]:
        """Swap each map out after its producer, prefetching it one backward layer ahead."""
        ops = self.graph.ops
        decisions = {}
        for feature in maps:
            first = feature.consumers[0]
            layer = self.backward_layer[first]
            if layer > 0:
                control = self.backward[layer - 1][0]
                how = f"prefetched at the start of the backward layer before ({ops[control].scope or 'top'})"
            else:
                control = first - 1
                how = "prefetched right before its reader (the first backward layer)"
            control = max(control, feature.floor)  # never beside the live original
            made_in = self.graph.op(self.graph.tensors[feature.tensor].producer or "").scope
            reason = (f"vDNN: feature map of forward layer {feature.layer} ({made_in or 'top'}), "
                      f"offloaded after its last forward read; {how}")
            swap_in = SwapIn(ops[control].name, tuple(ops[c].name for c in feature.consumers))
            decisions[feature.tensor] = Swap((swap_in,), reason=reason)
        return decisions

    def make_plan(self, strategy: str, maps: Iterable[FeatureMap], hardware: Hardware,
                  budget_bytes: int | None, params: Mapping[str, Any]) -> Plan:
        """The plan offloading ``maps``, in layer order while the host holds them
        (``hardware.host_bytes``; the rest are kept, and ``params["host_dropped"]`` counts them)."""
        offloaded: dict[str, Decision] = dict(self.offload(maps))
        decisions, dropped = within_host(self.graph, offloaded, hardware.host_bytes)
        return Plan(strategy, decisions, graph_hash=self.graph.structure_hash,
                    params={**params, **host_params(dropped)}, budget_bytes=budget_bytes,
                    hardware=hardware.name)


# ---- parameters shared by the three policies ----------------------------------------------------


@dataclass(frozen=True)
class VdnnConfig(StrategyConfig):
    """A vDNN policy's parameters, checked when built: the attention backend only (each policy
    registers a subclass that names it, for the messages)."""

    strategy: ClassVar[str] = "vdnn"
    attention: str = "auto"  # "auto": the captured backend; "math" or "fused" insist on one

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"{self.strategy}: attention must be one of "
                             f"{list(ATTENTION_CHOICES)}, got {self.attention!r}")


def check_budget(strategy: str, budget_bytes: object) -> int | None:
    """``None`` or a positive int, else ``ValueError``."""
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, Integral) or budget_bytes <= 0:
        raise ValueError(f"{strategy}: budget_bytes must be a positive int or None (parse '11GiB' "
                         f"with memfit.data.units.parse_bytes), got {budget_bytes!r}")
    return int(budget_bytes)


def attention_backend(graph: CostGraph) -> str:
    """How the step's attention was captured: ``"fused"``, ``"math"``, ``"mixed"`` or ``"none"``.

    A fused SDPA kernel (flash, memory-efficient, cuDNN) appears as one op; the math backend
    decomposes into bmm, softmax and dropout, so a forward softmax stands for it.
    """
    kinds = {op.kind.removeprefix("aten.").split(".")[0] for op in graph.forward_ops}
    fused = any(kind.startswith(_FUSED_ATTENTION) for kind in kinds)
    math = any(kind in _SOFTMAX for kind in kinds)
    return {(True, True): "mixed", (True, False): "fused", (False, True): "math"}.get(
        (fused, math), "none")


def resolve_attention(graph: CostGraph, attention: str, strategy: str) -> str:
    """The attention backend the plan runs with: the captured one, which ``attention`` must match.

    Note:
        The vDNN paper picks a cuDNN algorithm per layer, trading workspace for speed. Its PyTorch
        analogue is the SDPA backend (math saves the probabilities, fused kernels only the
        logsumexp), but that choice is made when the step is captured: one CostGraph holds one
        backend per attention, so a plan can only keep it. Ask for another by capturing the step
        under ``torch.nn.attention.sdpa_kernel``.

    Raises:
        ValueError: if ``attention`` names a backend other than the captured one.
    """
    captured = attention_backend(graph)
    if attention == "auto" or captured in ("none", attention):
        return captured
    raise ValueError(
        f"{strategy}: attention={attention!r}, but this step's attention was captured with the "
        f"{captured} backend, and a plan cannot change it: capture the step inside "
        "torch.nn.attention.sdpa_kernel(...) with the backend wanted (on CPU, dropout needs the "
        "math backend), or pass attention='auto'")
