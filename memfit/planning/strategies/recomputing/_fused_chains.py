"""Re-run every chain of memory-bound ops from the library calls' outputs: auto's inductor plan.

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
what it cannot see.
"""

from __future__ import annotations

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.op_classes import MEMORY, op_class
from memfit.data.plan import Plan, Recompute
from memfit.model.kernels import fusible
from memfit.model.schedule import lower, memory_profile
from memfit.planning.tuning import TUNING

NAME = "fused-chains"


def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int) -> Plan | None:
    """The plan recomputing every memory-bound forward value, and library calls' values until
    it fits ``budget_bytes``; ``None`` for a graph inductor does not run (nothing is fused
    there) or where it does not fit.

    Example:
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import chain
        >>> plan(chain(4), get_hardware("cpu"), 1) is None  # an aot_eager graph
        True
    """
    if graph.compiler != "inductor":
        return None
    chains = _chain_values(graph)
    calls = _library_values(graph)
    if not chains and not calls:
        return None
    chosen: tuple[str, ...] = ()
    peak = _peak(graph, chains, chosen)
    for call in calls[:TUNING.fused_chains_calls_tried]:
        if peak <= budget_bytes:
            break
        lower_peak = _peak(graph, chains, (*chosen, call))
        if lower_peak < peak:
            chosen, peak = (*chosen, call), lower_peak
    if peak > budget_bytes:
        return None
    return _plan(graph, chains, chosen, budget_bytes, hardware)


def _chain_values(graph: CostGraph) -> tuple[str, ...]:
    """The forward values generated kernels make, but those the step returns."""
    return tuple(tensor for op in graph.forward_ops if fusible(op) for tensor in op.outputs
                 if not graph.tensors[tensor].is_output)


def _library_values(graph: CostGraph) -> tuple[str, ...]:
    """The saved values of forward library calls (matmuls, convolutions, attention), cheapest
    re-run per byte first."""
    saved = {tensor.name for tensor in graph.saved_tensors()}
    values = [(op.time_s / graph.tensors[tensor].size_bytes, tensor)
              for op in graph.forward_ops if op_class(op.kind) != MEMORY
              for tensor in op.outputs if tensor in saved and not graph.tensors[tensor].is_output
              and graph.tensors[tensor].size_bytes > 0]
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
