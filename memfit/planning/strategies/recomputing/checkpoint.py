"""Gradient checkpointing as in openai/gradient-checkpointing: keep checkpoints, recompute the rest.

Three ways to choose the checkpoints (``checkpoints=``):

- ``"memory"``: graph separators (articulation points, or small separator sets from a min-fill
  tree decomposition when there are none), about sqrt(n) of them evenly spaced; with a budget,
  as many as the budget needs, picking the count with the least recompute time that fits.
- ``"speed"``: keep the outputs of expensive ops (matmul, convolution, attention) and recompute
  the cheap ones, in chains of at most ``max_chain`` ops from a kept value.
- a list of module-path globs (``"transformer.h.*"``: the outputs of each matching module, as
  ``torch.utils.checkpoint`` around every block would keep) or op / tensor names.

Every other forward tensor is recomputed: freed after its last forward use and rebuilt once,
right before the first backward op that needs it (``Recompute``).

When the peak is in the forward pass (skip connections, a value read by an early and a late
branch), recomputing for the backward pass cannot lower it; ``forward_recompute`` then also
frees forward values across that peak and re-runs them before their late forward reader
(``memfit.planning.strategies.recomputing._forward_recompute``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from memfit.data.costgraph import CostGraph, Op
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Recompute
from memfit.model import separators
from memfit.model.profile import BaseProfile
from memfit.model.schedule import peak_bytes
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import require_fit
from memfit.planning.strategies._strategy_config import StrategyConfig, positive_int
from memfit.planning.strategies.recomputing._forward_recompute import recompute_in_forward
from memfit.planning.strategies.recomputing._separator_count_search import (
    CountBounds,
    kept_tensors,
    least_recompute_fitting,
    lowest_peak,
)

EXPENSIVE_KINDS = frozenset({
    "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul", "aten.linear",
    "aten.convolution", "aten._convolution", "aten.cudnn_convolution",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward", "aten._efficient_attention_forward",
})


@dataclass(frozen=True)
class CheckpointConfig(StrategyConfig):
    """checkpoint's parameters (see ``plan``), checked when built."""

    strategy: ClassVar[str] = "checkpoint"
    checkpoints: str | Sequence[str] = "memory"  # "memory", "speed", or globs and op names
    max_chain: int = 4  # "speed": the longest chain of cheap ops rebuilt from one kept value
    forward_recompute: bool | None = None  # None: only when the backward-only plan does not fit

    def __post_init__(self) -> None:
        if self.forward_recompute not in (None, True, False):
            raise ValueError(f"forward_recompute must be True, False or None (automatic), "
                             f"got {self.forward_recompute!r}")
        positive_int("max_chain", self.max_chain)
        checkpoints = self.checkpoints
        is_list = isinstance(checkpoints, (list, tuple)) and all(
            isinstance(c, str) for c in checkpoints)
        if checkpoints not in ("memory", "speed") and not (is_list and checkpoints):
            raise ValueError(f"checkpoints must be 'memory', 'speed' or a non-empty list of "
                             f"module-path globs or op names, got {checkpoints!r}")


@register("checkpoint", config=CheckpointConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, *,
         checkpoints: str | Sequence[str] = "memory", max_chain: int = 4,
         forward_recompute: bool | None = None, **unknown) -> Plan:
    """Keep checkpoints and recompute every other forward tensor.

    Args:
        checkpoints: ``"memory"`` (sqrt(n) separators; default), ``"speed"`` (keep matmul /
            conv / attention outputs) or a list of module-path globs and op names.
        max_chain: in ``"speed"`` mode, the longest chain of cheap ops recomputed from one kept
            value (default 4); longer chains are cut by keeping a value, so a rebuild never
            replays a whole residual stream.
        forward_recompute: also re-run forward values across a peak in the forward pass
            (see the module note). ``None`` (default): only when a budget is given and the
            backward-only plan does not fit it; ``True``: always (with no budget, lower the
            forward peak as far as it goes), for more recompute time; ``False``: never.

    Raises:
        ValueError: for an unknown parameter or mode, or a list that matches nothing.
        BudgetError: if no choice of checkpoints of this mode fits ``budget_bytes``.
    """
    CheckpointConfig.from_params({"checkpoints": checkpoints, "max_chain": max_chain,
                                 "forward_recompute": forward_recompute, **unknown})
    params = {"checkpoints": checkpoints, "max_chain": max_chain,
              "forward_recompute": forward_recompute}
    if checkpoints == "memory":
        made = _memory_mode(graph, hardware, budget_bytes, params)
    else:
        kept = (_speed_checkpoints(graph, max_chain) if checkpoints == "speed"
                else _listed_checkpoints(graph, checkpoints))
        made = recompute_all_but(graph, kept, hardware, budget_bytes, params)
    if forward_recompute or (forward_recompute is None and not _fits(graph, made, budget_bytes)):
        made = recompute_in_forward(graph, made, hardware, budget_bytes)
    return require_fit(graph, made, budget_bytes)


def _fits(graph: CostGraph, made: Plan, budget_bytes: int | None) -> bool:
    return budget_bytes is None or peak_bytes(graph, made) <= budget_bytes


def recompute_all_but(graph: CostGraph, kept: Iterable[str], hardware: Hardware,
                      budget_bytes: int | None, params: dict) -> Plan:
    """A plan that recomputes every forward tensor except ``kept`` (and step outputs)."""
    kept = set(kept)
    phase = {op.name: op.phase for op in graph.ops}
    decisions = {
        name: Recompute("not a checkpoint")
        for name, tensor in graph.tensors.items()
        if tensor.producer is not None and phase[tensor.producer] == "forward"
        and not tensor.is_output and name not in kept
    }
    return Plan("checkpoint", decisions, graph_hash=graph.structure_hash, params=params,
                budget_bytes=budget_bytes, hardware=hardware.name)


def _speed_checkpoints(graph: CostGraph, max_chain: int) -> set[str]:
    """Outputs of expensive ops, plus values whose rebuild would cost more memory than it saves.

    A cheap op is recomputed only when each of its inputs is resident, saved for the backward
    pass anyway, or recomputed itself: rebuilding ``relu(mm)`` from an ``mm`` output that nothing
    else keeps would keep that output instead, which saves nothing. Chains of recomputed ops are
    cut at ``max_chain``.
    """
    saved = {t.name for t in graph.saved_tensors()}
    depth: dict[str, int] = {}  # recomputed tensor -> ops between it and a kept value
    kept: set[str] = set()
    for op in graph.forward_ops:
        chain = 1 + max((depth.get(t, 0) for t in op.inputs), default=0)
        sources_free = all(
            t in saved or t in depth or graph.tensors[t].producer is None for t in op.inputs
        )
        for tensor in op.outputs:
            if op.kind in EXPENSIVE_KINDS or chain > max_chain or not sources_free:
                kept.add(tensor)
            else:
                depth[tensor] = chain
    return kept


def _listed_checkpoints(graph: CostGraph, patterns: Sequence[str]) -> set[str]:
    """Tensors named, or leaving a module instance whose path matches a glob."""
    kept: set[str] = set()
    for pattern in patterns:
        found = _by_name(graph, pattern) or _module_outputs(graph, pattern)
        if not found:
            raise ValueError(f"checkpoint {pattern!r} matches no op, tensor or module path; "
                             "module paths look like 'transformer.h.*' or 'layer1.0'")
        kept |= found
    return kept


def _by_name(graph: CostGraph, name: str) -> set[str]:
    if name in graph.tensors:
        return {name}
    if name in graph.index:
        return set(graph.op(name).outputs)
    return set()


def _module_outputs(graph: CostGraph, pattern: str) -> set[str]:
    """Forward tensors made inside a matching module instance and read outside it."""
    phase = {op.name: op.phase for op in graph.ops}
    kept = set()
    for op in graph.forward_ops:
        instance = _instance(op, pattern)
        if instance is None:
            continue
        for tensor in op.outputs:
            readers = [graph.op(c) for c in graph.tensors[tensor].consumers if phase[c] == "forward"]
            if any(not _inside(reader.scope, instance) for reader in readers):
                kept.add(tensor)
    return kept


def _instance(op: Op, pattern: str) -> str | None:
    """The shortest prefix of the op's module path that matches ``pattern``."""
    parts = op.scope.split(".") if op.scope else []
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if fnmatch.fnmatchcase(prefix, pattern):
            return prefix
    return None


def _inside(scope: str, instance: str) -> bool:
    return scope == instance or scope.startswith(instance + ".")


def _memory_mode(graph: CostGraph, hardware: Hardware, budget_bytes: int | None,
                 params: dict) -> Plan:
    """sqrt(n) separators; with a budget, the separator count that fits with least recompute,
    or the one with the lowest peak when none fits (the caller may still lower it).

    With a budget every count is a candidate, found by branch and bound on cheap lower bounds
    (``_separator_count_search``): a graph with a thousand separators is priced a few times, not a
    thousand.
    """
    points = separators.articulation_points(graph)
    enough = max(2, round(len(graph.forward_ops) ** 0.5 / 2))
    candidates = [(p,) for p in points] if len(points) >= enough else list(separators.separator_sets(graph))
    if not candidates:
        raise ValueError("this graph has no separators to checkpoint at; name checkpoints "
                         "explicitly (checkpoints=[...]) or use checkpoints='speed'")
    held = [frozenset(_separator_tensors(graph, separator)) for separator in candidates]
    if budget_bytes is None:
        return _kept_every(graph, hardware, None, params, held,
                           max(1, round(len(graph.forward_ops) ** 0.5)))
    model = BaseProfile.of(graph)  # exact for recompute-only plans, and far cheaper than simulate
    droppable = frozenset(recompute_all_but(graph, (), hardware, None, params).recomputed)
    bounds = CountBounds(model, droppable, held)
    counts = range(1, len(candidates) + 1)
    count = least_recompute_fitting(bounds, counts, budget_bytes)
    if count is None:
        count = lowest_peak(bounds, counts)
    return _kept_every(graph, hardware, budget_bytes, params, held, count)


def _kept_every(graph: CostGraph, hardware: Hardware, budget_bytes: int | None, params: dict,
                held: Sequence[frozenset[str]], count: int) -> Plan:
    """Keep ``count`` evenly spaced separators; recompute the rest."""
    return recompute_all_but(graph, kept_tensors(held, count), hardware, budget_bytes,
                             {**params, "count": count})


def _separator_tensors(graph: CostGraph, separator: Sequence[str]) -> set[str]:
    """The storages a separator's ops hold: their outputs, or what a view op aliases."""
    tensors: set[str] = set()
    for name in separator:
        op = graph.op(name)
        tensors |= set(op.outputs or op.inputs[:1])
    return tensors
