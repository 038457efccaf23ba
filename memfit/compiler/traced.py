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

from memfit.compiler.backend import Backend
from memfit.compiler.plan_step import DeviceBudget, Planned, plan_step
from memfit.compiler.region import Region
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError, CaptureError
from memfit.data.hardware import Hardware
from memfit.data.units import Budget
from memfit.graph.capture import refuse_meta_parameters
from memfit.graph.target import check_autocast
from memfit.model.schedule import PlanError
from memfit.model.sharding import Sharding, shard_graph
from memfit.runtime.resident import device_of, reserved_state_bytes

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
    """Raised by the planning-only backend once it planned: nothing runs. It carries the region
    planned (the backend keeps no region whose compile did not finish)."""

    def __init__(self, region: Region | None = None) -> None:
        super().__init__()
        self.region = region


class _PlanOnly(Backend):
    """memfit's backend that plans the region and stops before AOTAutograd compiles it."""

    def plan_region(self, *args: Any, **kwargs: Any) -> Any:
        super().plan_region(*args, **kwargs)
        raise _Stop(self.regions[-1])


class _ShardedStop(_Stop):
    """Raised by the sharded planner with one rank's plan (its graph is not the captured one,
    so nothing is rewritten)."""

    def __init__(self, planned: Planned) -> None:
        super().__init__()
        self.planned = planned


class _ShardedPlanOnly(_PlanOnly):
    """Plans one rank of a ``Sharding``: the captured graph sharded, the optimizer state too.

    The captured region is the whole model's step; ``shard_graph`` makes it one rank's (sharded
    parameters, all-gathers, reduce-scatters or all-reduces), and FSDP shards the optimizer
    state that the bytes outside the graph hold."""

    sharding = Sharding()

    def _choose(self, graph: CostGraph, hardware: Hardware, outside: int, pending: int,
                eager: int = 0, own_open: int = 0) -> Any:
        state = sum(reserved_state_bytes(optimizer, device_of(self.model.parameters()))
                    for optimizer in self.optimizers) if self.model is not None else 0
        raise _ShardedStop(plan_step(shard_graph(graph, self.sharding, hardware), hardware,
                                     self.budget_override or self.budget, self.strategy,
                                     self.params, self.sharding.outside_bytes(outside, state),
                                     what_ifs=self.what_ifs))


def trace_plan(model: torch.nn.Module, loss_fn: Callable, inputs: Sequence[torch.Tensor],
               budget: Budget | None, strategy: str, hardware: Hardware,
               params: Mapping[str, Any], linearize: bool = False,
               what_ifs: bool = False, autocast: torch.dtype | None = None,
               sharding: Sharding | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> Planned:
    """Plan the step ``memfit.compile`` would run for inputs of these shapes; nothing runs.

    ``inputs`` may be real or ``meta`` tensors: each becomes a fake tensor on the parameters'
    device (a meta input) or its own, so no input memory is allocated. Bytes outside the graph
    (buffers, existing ``.grad``, ``optimizer``'s state, reserved before its first step) count
    as they would when the step runs. With an active ``sharding`` the plan is one rank's
    (``memfit.model.sharding``): its graph is the sharded one, which this process cannot run.

    The step is traced as ``hardware``'s device runs it (``memfit.graph.target``): for a CUDA
    profile planned from CPU tensors, CUDA's attention kernels and, with ``autocast``, CUDA's
    autocast policy; for a profile of the parameters' own device, the step as it runs here
    (under ``torch.autocast`` with ``autocast``).

    Raises:
        BudgetError: if the strategy cannot fit the budget.
        CaptureError: if the step cannot be traced as one graph (a graph break included).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_autocast(autocast)  # here, not inside Dynamo's trace, where it would be wrapped
    refuse_meta_parameters(model)
    sharded = sharding is not None and sharding.active
    kind = _ShardedPlanOnly if sharded else _PlanOnly
    planner = kind(budget, strategy, hardware, "aot_eager", optimizer, model, params)
    if sharded:
        planner.sharding = sharding  # type: ignore[attr-defined]
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
        planned = _stopped(error, planner)
        if planned is None:
            raise memfit_error(error) from None
    else:
        raise AssertionError("the planning-only backend ran the step")
    return planned


def _fake(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    where = device if tensor.device.type == "meta" else tensor.device
    fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                               device=where)
    return fake.requires_grad_(tensor.requires_grad)


def _stopped(error: BaseException, planner: Backend) -> Planned | None:
    """The plan the planning-only backend stopped with (``None``: it failed)."""
    from torch._dynamo.exc import BackendCompilerFailed

    if not isinstance(error, BackendCompilerFailed):
        return None
    inner = error.inner_exception
    if isinstance(inner, _ShardedStop):
        return inner.planned
    return as_planned(inner.region) if isinstance(inner, _Stop) and inner.region else None


def as_planned(region: Region) -> Planned:
    """A region's plan as ``plan_step`` returns one."""
    return Planned(region.graph, region.plan, region.baseline, region.predicted,
                   DeviceBudget(region.budget_bytes, region.outside_bytes))

