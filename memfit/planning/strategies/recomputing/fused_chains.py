"""Re-run every chain of memory-bound ops from the library calls' outputs (inductor only).

Under inductor a chain of memory-bound ops (a batch norm's statistics and normalisation, an
activation, a residual add) re-runs inside the backward kernels that read it: fused, it costs
little more than reading what the chain reads, and its values are never stored
(``memfit.model.inlining``). ``torch.compile``'s own partitioner works from the same fact: it
saves the outputs of matmuls and convolutions and recomputes the memory-bound ops between
them, and under ``activation_memory_budget`` recomputes library calls too. This candidate is
that plan in memfit's terms, priced by memfit's model of inductor's program (inlined values,
fused re-runs, in-place writes) and checked against the budget:

1. recompute every forward value a generated kernel makes (``memfit.model.kernels.fusible``)
   that the step does not return;
2. where that does not fit, also recompute library calls' values, cheapest re-run per byte
   first, each only where it lowers the peak (re-running a call re-runs what it reads too, and
   can raise it), until the plan fits (one simulation per call tried, at most
   ``TUNING.fused_chains_calls_tried``).

The separator-block DP prices recomputation on eager's program (every value stored,
``memfit.model.keep_profile``), on which re-running a whole chain frees little: this plan is
what it cannot see. ``auto`` prices it as one of its candidates under inductor; named on its own
(``strategy="fused-chains"``) it plans the same way and refuses where it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.op_classes import MEMORY, op_class
from memfit.data.plan import Plan, Recompute
from memfit.model.kernels import fusible
from memfit.model.schedule import lower, memory_profile
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import require_fit
from memfit.planning.strategies._strategy_config import StrategyConfig
from memfit.planning.tuning import TUNING

NAME = "fused-chains"


@dataclass(frozen=True)
class FusedChainsConfig(StrategyConfig):
    """fused-chains takes no parameters; it plans inductor's program only."""

    strategy: ClassVar[str] = NAME
    compilers: ClassVar[tuple[str, ...]] = ("inductor",)


@register(NAME, config=FusedChainsConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
         **params) -> Plan:
    """The plan recomputing every memory-bound forward value the step does not return, and
    library calls' values, cheapest per byte first, where each lowers the peak, until it fits
    ``budget_bytes`` (``None``: the chains alone).

    Raises:
        ValueError: for any parameter, or a graph inductor does not run (nothing is fused
            there: use ``compiler="inductor"``).
        BudgetError: where the lowest peak it finds does not fit ``budget_bytes`` (that peak
            is the minimum), or the host does not hold what it swaps (none).

    Example:
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import chain
        >>> plan(chain(4), get_hardware("cpu"))  # an aot_eager graph
        Traceback (most recent call last):
        ValueError: strategy 'fused-chains' plans the program inductor runs ...
    """
    FusedChainsConfig.from_params(params)
    if graph.compiler != "inductor":
        raise ValueError(f"strategy {NAME!r} plans the program inductor runs (fused kernels), "
                         f"this graph is {graph.compiler}'s: use compiler=\"inductor\" or "
                         "another strategy")
    chains = _chain_values(graph)
    calls = _library_values(graph, chains)
    chosen: tuple[str, ...] = ()
    peak = _peak(graph, chains, chosen)
    for call in calls[:TUNING.fused_chains_calls_tried]:
        if budget_bytes is None or peak <= budget_bytes:
            break
        lower_peak = _peak(graph, chains, (*chosen, call))
        if lower_peak < peak:
            chosen, peak = (*chosen, call), lower_peak
    return require_fit(graph, _plan(graph, chains, chosen, budget_bytes, hardware),
                       budget_bytes, hardware.host_bytes)


def _chain_values(graph: CostGraph) -> tuple[str, ...]:
    """The forward values generated kernels make, but those the step returns."""
    return tuple(tensor for op in graph.forward_ops if fusible(op) for tensor in op.outputs
                 if not graph.tensors[tensor].is_output)


def _library_values(graph: CostGraph, chains: tuple[str, ...]) -> tuple[str, ...]:
    """The values of forward library calls (matmuls, convolutions, attention) the backward reads
    once ``chains`` re-run there (directly, or as what a re-run chain reads: attention scores
    under a re-run softmax), cheapest re-run per byte first."""
    rerun = set(chains)
    held: set[str] = set()
    reached = [tensor.name for tensor in graph.saved_tensors()]
    while reached:
        tensor = reached.pop()
        if tensor in held:
            continue
        held.add(tensor)
        producer = graph.tensors[tensor].producer
        if tensor in rerun and producer is not None:
            reached.extend(graph.op(producer).inputs)
    values = [(op.time_s / graph.tensors[tensor].size_bytes, tensor)
              for op in graph.forward_ops if op_class(op.kind) != MEMORY
              for tensor in op.outputs if tensor in held and tensor not in rerun
              and not graph.tensors[tensor].is_output and graph.tensors[tensor].size_bytes > 0]
    return tuple(tensor for _, tensor in sorted(values))


def _plan(graph: CostGraph, chains: tuple[str, ...], calls: tuple[str, ...],
          budget_bytes: int | None = None, hardware: Hardware | None = None) -> Plan:
    why = "re-run inside the backward's kernels"
    decisions = {tensor: Recompute(why) for tensor in chains}
    decisions.update({tensor: Recompute("a library call: cheapest per byte") for tensor in calls})
    return Plan(NAME, decisions, graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name if hardware else "",
                params={"library_calls_recomputed": len(calls)})


def _peak(graph: CostGraph, chains: tuple[str, ...], calls: tuple[str, ...]) -> int:
    return memory_profile(lower(graph, _plan(graph, chains, calls))).peak_bytes
