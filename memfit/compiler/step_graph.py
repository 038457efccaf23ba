"""A compiled step as the planner sees it: the hardware profile it is priced on
(``resolve_hardware``) and its ``CostGraph`` (``analyzed``). What follows is torch-free
(``memfit.planning.step.plan_step``).

Example:
    >>> hardware = resolve_hardware(None, torch.device("cpu"))
    >>> captured, graph = analyzed(captured, hardware, "step", linearize=False)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware, get_hardware
from memfit.lowering.rewrite import reorder
from memfit.model.linearize import linearize as as_late_as_possible
from memfit.tracing.analyze import analyze
from memfit.tracing.capture import Captured


def resolve_hardware(hardware: Hardware | str | None, device: torch.device) -> Hardware:
    """The profile to plan with: given, or the built-in ``cpu`` profile on a CPU, else measured."""
    if hardware is not None:
        return get_hardware(hardware)
    if device.type in ("cpu", "meta"):
        return get_hardware("cpu")
    from memfit.runtime.probe import measure_hardware

    return measure_hardware(device)


def analyzed(captured: Captured, hardware: Hardware, name: str, linearize: bool,
             kernel_temporaries: bool = False, owners: dict | None = None,
             compiler: str = "aot_eager") -> tuple[Captured, CostGraph]:
    """The step's CostGraph; with ``linearize``, the step reordered as late as possible first.

    The fx node order is the program order, so the captured graph itself is reordered and
    analyzed again: what is planned, rewritten and run is one order (``memfit.model.linearize``
    keeps random ops in their order and never raises the unplanned peak). ``owners`` is filled
    as ``analyze`` fills it (reordering keeps each node's fake values, so their storages).
    Op times are those of ``compiler``'s kernels (``analyze``).
    """
    graph = analyze(captured, hardware, name=name, kernel_temporaries=kernel_temporaries,
                    owners=owners, compiler=compiler)
    if not linearize:
        return captured, graph
    linear = as_late_as_possible(graph)
    if linear is graph:
        return captured, graph
    order = [op.name for op in linear.ops]
    captured = replace(captured, graph_module=reorder(captured.graph_module, order))
    if owners is not None:  # filled again for the reordered graph, whose first writers differ
        owners.clear()
    return captured, analyze(captured, hardware, name=name, kernel_temporaries=kernel_temporaries,
                             owners=owners, compiler=compiler)
