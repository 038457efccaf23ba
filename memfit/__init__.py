"""memfit: fit a PyTorch training step into a device-memory budget.

The public API, nothing else. Names are imported lazily so that the torch-free layers
(``memfit.data``, ``memfit.model``, ``memfit.planning``) import without torch.

Example:
    >>> step = memfit.compile(model, loss_fn, budget="0.5", strategy="swap")
    >>> loss = step(input_ids, labels)      # gradients land in .grad, as loss.backward() would
    >>> print(step.report())
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "fit": "memfit.fitting.fitted",
    "unfit": "memfit.fitting.fitted",
    "backend": "memfit.fitting.fitted",
    "report": "memfit.api",
    "Backend": "memfit.compiler.backend",
    "compile": "memfit.api",
    "plan": "memfit.api",
    "measure_peak": "memfit.api",
    "Step": "memfit.api",
    "Round": "memfit.api",
    "BudgetWarning": "memfit.api",
    "max_batch_size": "memfit.search",
    "BatchSearch": "memfit.search",
    "FrontierPoint": "memfit.planning.batches",
    "capture": "memfit.tracing.capture",
    "measure_hardware": "memfit.runtime.probe",
    "BudgetError": "memfit.data.errors",
    "CaptureError": "memfit.data.errors",
    "PlanError": "memfit.data.errors",
    "PlanFileError": "memfit.data.plan_json",
    "Plan": "memfit.data.plan",
    "Keep": "memfit.data.plan",
    "Swap": "memfit.data.plan",
    "SwapIn": "memfit.data.plan",
    "Recompute": "memfit.data.plan",
    "Rerun": "memfit.data.plan",
    "Decision": "memfit.data.plan",
    "Explanation": "memfit.data.explanation",
    "CostGraph": "memfit.data.costgraph",
    "Timeline": "memfit.data.timeline",
    "Hardware": "memfit.data.hardware",
    "PROFILES": "memfit.data.hardware",
    "simulate": "memfit.model.simulate",
    "strategy_names": "memfit.planning.strategies",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
