"""A step as ``torch.compile`` sees it: ``loss_fn(model, *inputs)`` as a module, and planning it
from fake inputs without running anything.

``memfit.compile`` runs this module compiled with memfit's backend; ``memfit.plan``,
``max_batch_size`` and the CLI trace the same module with fake inputs (Dynamo, then AOTAutograd,
then memfit's partitioner), keep the plan the partitioner made, and stop before anything runs. So
a plan made ahead of time names the tensors of the graph the step will run.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from memfit.backend import Backend, Region, device_of
from memfit.core.errors import BudgetError, CaptureError
from memfit.core.hardware import Hardware
from memfit.core.schedule import PlanError
from memfit.core.units import Budget
from memfit.planning import DeviceBudget, Planned

MEMFIT_ERRORS = (BudgetError, CaptureError, PlanError)


class LossModule(torch.nn.Module):
    """``loss_fn(model, *inputs)`` as one module, so that Dynamo traces the whole step.

    ``plans`` is read in ``forward``, so Dynamo guards on it: raising it makes the next call
    trace, and so plan, the step again (the closed loop, more gradients resident).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.plans = 0

    def forward(self, *inputs: Any) -> Any:
        if self.plans < 0:
            raise AssertionError("memfit's plan count is never negative")
        return self.loss_fn(self.model, *inputs)


def loss_module(model: torch.nn.Module, loss_fn: Callable) -> LossModule:
    """A ``LossModule`` whose ``forward`` has a code object of its own.

    Note:
        Dynamo keeps its compiled entries per code object, at most ``recompile_limit`` (8) of
        them, and past that runs the frame eagerly, that is unplanned. One code object shared by
        every step of a process would reach that after 8 steps or shapes; one per step keeps
        each step's own shapes and re-plans apart.
    """
    module = LossModule(model, loss_fn)
    function = LossModule.forward
    fresh = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)
    module.forward = types.MethodType(fresh, module)  # type: ignore[method-assign]
    return module


def memfit_error(error: BaseException) -> BaseException:
    """The error to raise for one from a compiled call: memfit's own, unwrapped from Dynamo's
    ``BackendCompilerFailed``; a tracing failure as a ``CaptureError``; else ``error`` itself."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    if isinstance(error, BackendCompilerFailed):  # memfit's backend raised it: show it whole
        inner = error.inner_exception
        return inner.with_traceback(None) if isinstance(inner, MEMFIT_ERRORS) else inner
    if isinstance(error, TorchDynamoException):
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return CaptureError(f"torch.compile could not trace the step: {first}. Run "
                            "loss_fn(model, *inputs) eagerly to see the error in your code.")
    return error


class _Stop(Exception):
    """Raised by the planning-only backend once it planned: nothing runs."""


class _PlanOnly(Backend):
    """memfit's backend that plans the region and stops before AOTAutograd compiles it."""

    def plan_region(self, *args: Any, **kwargs: Any) -> Any:
        super().plan_region(*args, **kwargs)
        raise _Stop


def trace_plan(model: torch.nn.Module, loss_fn: Callable, inputs: Sequence[torch.Tensor],
               budget: Budget | None, strategy: str, hardware: Hardware,
               params: Mapping[str, Any], linearize: bool = False,
               what_ifs: bool = False, autocast: torch.dtype | None = None) -> Planned:
    """Plan the step ``memfit.compile`` would run for inputs of these shapes; nothing runs.

    ``inputs`` may be real or ``meta`` tensors: each becomes a fake tensor on the parameters'
    device (a meta input) or its own, so no input memory is allocated. Bytes outside the graph
    (buffers, existing ``.grad``) count as they would when the step runs.

    The step is traced as ``hardware``'s device runs it (``memfit.graph.target``): for a CUDA
    profile planned from CPU tensors, CUDA's attention kernels and, with ``autocast``, CUDA's
    autocast policy; for a profile of the parameters' own device, the step as it runs here
    (under ``torch.autocast`` with ``autocast``).

    Raises:
        BudgetError: if the strategy cannot fit the budget.
        CaptureError: if the step cannot be traced as one graph (a graph break included).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    planner = _PlanOnly(budget, strategy, hardware, "aot_eager", None, model, params)
    planner.linearize, planner.what_ifs = linearize, what_ifs
    planner.scope_prefix = "model."  # LossModule holds the model as .model
    planner.retarget, planner.autocast = True, autocast
    # a plan for an accelerator's profile describes that device's step, not this CPU's kernels
    planner.kernel_temporaries = not hardware.async_copies
    device = device_of(model.parameters())
    with FakeTensorMode() as mode:
        fake = tuple(_fake(t, device) for t in inputs)
    del mode
    compiled = torch.compile(loss_module(model, loss_fn), backend=planner, dynamic=False,
                             fullgraph=True)
    try:
        compiled(*fake)
    except Exception as error:
        region = _stopped_region(error, planner)
        if region is None:
            raise memfit_error(error) from None
    else:
        raise AssertionError("the planning-only backend ran the step")
    return as_planned(region)


def _fake(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    where = device if tensor.device.type == "meta" else tensor.device
    fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                               device=where)
    return fake.requires_grad_(tensor.requires_grad)


def _stopped_region(error: BaseException, planner: Backend) -> Region | None:
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(error, BackendCompilerFailed) and isinstance(error.inner_exception, _Stop):
        return planner.regions[-1]
    return None


def as_planned(region: Region) -> Planned:
    """A region's plan as ``plan_step`` returns one."""
    return Planned(region.graph, region.plan, region.baseline, region.predicted,
                   DeviceBudget(region.budget_bytes, region.outside_bytes))

