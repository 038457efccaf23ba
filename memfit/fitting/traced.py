"""A step as ``torch.compile`` sees it: ``loss_fn(model, *inputs)`` as a module, and planning it
from fake inputs without running anything.

``memfit.compile`` runs this module compiled with memfit's backend; ``memfit.plan``,
``max_batch_size`` and the CLI trace the same module with fake inputs (Dynamo, then AOTAutograd,
then memfit's partitioner), keep the plan the partitioner made, and run nothing. So a plan made
ahead of time names the tensors of the graph the step will run.

Across graph breaks (a logger call in transformers' loss, Python between regions) every region
is traced and planned in the order it runs, each beside the saves of the regions before it, as
``memfit.fit``'s first iteration plans them; the step's plan then holds one plan per region
(``Plan.regions``), and ``whole_step`` sums them up.
"""

from __future__ import annotations

import contextlib
import hashlib
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from memfit.compiler.backend import Backend
from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import compiling_site
from memfit.compiler.region import Region
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError, CaptureError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.data.units import Budget, format_bytes
from memfit.fitting.callers_compile import own_trace
from memfit.model.schedule import PlanError
from memfit.model.sharding import Sharding, shard_graph
from memfit.planning.step import DeviceBudget, Planned, plan_step
from memfit.runtime.resident import device_of
from memfit.tracing.capture import refuse_meta_parameters, scalar_loss
from memfit.tracing.target import check_autocast

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
        return scalar_loss(self.loss_fn(self.model, *inputs))


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
    """Raised by the planning-only backend once it planned a region: it is not compiled, and
    the backend keeps the region planned (``Backend.compile_region``)."""

    keeps_region = True


class _PlanOnly(Backend):
    """memfit's backend that plans every region and compiles none.

    Each region is planned as ``memfit.fit``'s first iteration plans it, then stands in for
    itself by Dynamo's graph run on the fake inputs (no memory, no kernels), with its forward
    counted open: tracing goes on past a graph break, and the next region is planned beside
    this one's saves. ``stopped`` holds the plans in the order the regions run.
    """

    def __init__(self, options: BackendOptions, optimizer: torch.optim.Optimizer | None = None,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__(options, optimizer, model)
        self.stopped: list[Planned] = []
        self.runners: list[_RunOnFakes] = []

    def plan_region(self, *args: Any, **kwargs: Any) -> Any:
        super().plan_region(*args, **kwargs)
        raise _Stop

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list) -> Any:
        device = device_of(example_inputs)
        known = len(self.regions)
        try:
            self.compile_region(graph_module, example_inputs, device, compiling_site())
        except _ShardedStop as stop:
            self.stopped.append(stop.planned)
        except _Stop:
            self.stopped.append(as_planned(self.regions[-1]))
        for region in self.regions[known:]:  # its forward "ran": its saves are held
            region.forward_opened(None)  # no autograd node: open until the trace ends

        runner = _RunOnFakes(graph_module, self._target, device)
        self.runners.append(runner)
        return runner

    def _provisional(self, graph: CostGraph, hardware: Hardware, outside: int
                     ) -> tuple[Planned, int | None]:
        """A region a graph break follows, under a fraction: unplanned (``keep``), with no
        budget, so that the step's unplanned peak is taken beside the earlier regions'
        unplanned saves, as ``memfit.plan`` takes it, and the last region is planned under
        that fraction of it beside them."""
        return plan_step(graph, hardware, None, "keep", {}, outside), None

    def _over_budget(self, graph: CostGraph, hardware: Hardware, error: BudgetError,
                     pending: int, outside: int, own_open: int = 0) -> Planned:
        """A region that only misses the budget beside the saves of the regions before its graph
        break: refused, as any region that misses it (nothing runs to plan again after)."""
        raise BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant,
                          error.strategy, f"{error.note} The regions before its graph break "
                          f"hold {format_bytes(pending)} of saved values beside it.".strip(),
                          host_bytes=error.host_bytes)


class _RunOnFakes:
    """A region's stand-in while its step is traced for planning: Dynamo's graph, run eagerly
    on the fake inputs under the target's capture personality (so its outputs have the
    dtypes the planned region gives them). Closed after the trace: Dynamo keeps its cache
    entry, which no later trace reads (each has its own ``isolate_recompiles`` entries), and
    a closed one holds no graph."""

    def __init__(self, graph_module: fx.GraphModule, target: Callable, device: torch.device
                 ) -> None:
        self.graph_module: fx.GraphModule | None = graph_module
        self.target = target
        self.device = device

    def __call__(self, *args: Any) -> Any:
        if self.graph_module is None:
            raise AssertionError("a planning trace's region ran after its trace ended")
        with self.target(self.device):
            return self.graph_module(*args)

    def close(self) -> None:
        self.graph_module = self.target = None  # type: ignore[assignment]


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

    def _choose(self, graph: CostGraph, hardware: Hardware, outside: int, pending: int,
                eager: int = 0, own_open: int = 0, loop_graph: CostGraph | None = None) -> Any:
        state, options = self.state_to_come_bytes(), self.options
        sharding = options.sharding or Sharding()
        raise _ShardedStop(plan_step(shard_graph(graph, sharding, hardware), hardware,
                                     self.planning_budget, options.strategy, options.params,
                                     sharding.outside_bytes(outside, state),
                                     what_ifs=options.what_ifs))


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

    A step Dynamo breaks into several regions returns their ``whole_step``: its plan holds
    each region's (``Plan.regions``), and a fraction budget is of the whole step's unplanned
    peak. Planned one rank of a ``sharding``, the regions are planned one at a time, without
    the saves of the regions before each.

    The step is traced as ``hardware``'s device runs it (``memfit.tracing.target``): for a CUDA
    profile planned from CPU tensors, CUDA's attention kernels and, with ``autocast``, CUDA's
    autocast policy; for a profile of the parameters' own device, the step as it runs here
    (under ``torch.autocast`` with ``autocast``).

    Raises:
        BudgetError: if the strategy cannot fit the budget (a region beside the saves of the
            regions before it included).
        CaptureError: if the step cannot be traced (Dynamo's error), or Dynamo stopped
            compiling part of it (its recompile limit).
    """
    check_autocast(autocast)  # here, not inside Dynamo's trace, where it would be wrapped
    refuse_meta_parameters(model)
    options = PlanOptions(strategy, hardware, params, linearize, what_ifs, autocast, sharding,
                       optimizer)
    if budget is None or budget.bytes is not None:
        regions = _traced(model, loss_fn, inputs, budget, options)
    else:
        regions = _traced_at_a_fraction(model, loss_fn, inputs, budget, options)
    return regions[0] if len(regions) == 1 else whole_step(regions)


def _traced_at_a_fraction(model: torch.nn.Module, loss_fn: Callable,
                          inputs: Sequence[torch.Tensor], budget: Budget,
                          options: PlanOptions) -> list[Planned]:
    """The regions planned under a fraction of the whole step's unplanned peak.

    A region resolves a fraction against its own peak: right for a step of one region (traced
    once, as before), not for several. Where the step turns out to have several regions (or a
    region is refused, which could be by its own share), the step is traced unplanned for its
    peak, then planned again under that fraction of it in bytes.
    """
    try:
        regions = _traced(model, loss_fn, inputs, budget, options)
    except BudgetError as error:
        refused: BudgetError | None = error
    else:
        refused = None
        if len(regions) == 1:
            return regions
    unplanned = _traced(model, loss_fn, inputs, None, replace(options, strategy="keep",
                                                              what_ifs=False))
    if len(unplanned) == 1 and refused is not None:
        raise refused
    step_peak_bytes = max(planned.predicted_peak_bytes for planned in unplanned)
    return _traced(model, loss_fn, inputs, Budget(bytes=budget.to_bytes(step_peak_bytes)),
                   options)


@dataclass(frozen=True)
class PlanOptions:
    """What every trace of one ``trace_plan`` call plans with besides the budget."""

    strategy: str
    hardware: Hardware
    params: Mapping[str, Any]
    linearize: bool
    what_ifs: bool
    autocast: torch.dtype | None
    sharding: Sharding | None
    optimizer: torch.optim.Optimizer | None


def planning_backend(model: torch.nn.Module, budget: Budget | None, options: PlanOptions,
                     kind: type[_PlanOnly] | None = None) -> _PlanOnly:
    """The planning-only backend of one trace (``kind``, default by ``options.sharding``),
    configured as every planning trace of ``options`` is."""
    sharded = options.sharding is not None and options.sharding.active
    kind = kind or (_ShardedPlanOnly if sharded else _PlanOnly)
    planner = kind(BackendOptions(
        budget, options.strategy, options.hardware, params=options.params,
        linearize=options.linearize, what_ifs=options.what_ifs,
        scope_prefix="model.",  # LossModule holds the model as .model
        retarget=True, autocast=options.autocast,
        # a plan for an accelerator's profile describes that device's step, not this CPU's kernels
        kernel_temporaries=not options.hardware.async_copies,
        sharding=options.sharding if sharded else None), options.optimizer, model)
    return planner


def _traced(model: torch.nn.Module, loss_fn: Callable, inputs: Sequence[torch.Tensor],
            budget: Budget | None, options: PlanOptions) -> list[Planned]:
    """Trace the step on fake inputs with the planning-only backend: each region's plan."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    planner = planning_backend(model, budget, options)
    device = device_of(model.parameters())
    # real parameters meet fake activations in the regions run on fakes between graph breaks
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tuple(fake_like(t, device) for t in inputs)
    del mode
    # its own recompile count: each planning trace brings a new backend, and shared code (a
    # model's forward resumed after a graph break) would reach Dynamo's recompile limit
    compiled = torch.compile(loss_module(model, loss_fn), backend=planner, dynamic=False,
                             isolate_recompiles=True)
    try:
        with own_trace(), buffers_kept(model):
            compiled(*fake)
    except Exception as error:
        raise memfit_error(error) from None
    finally:
        for runner in planner.runners:
            runner.close()
    if planner.eager_codes:
        raise CaptureError(f"Dynamo hit its recompile limit on {planner.eager_codes[0]} while "
                           "planning, so part of the step was not planned: raise "
                           "torch._dynamo.config.recompile_limit, or call "
                           "torch._dynamo.reset() between plans")
    if not planner.stopped:
        raise CaptureError("torch.compile found no region with gradients in the step: "
                           "loss_fn(model, *inputs) must return a loss that requires grad")
    return planner.stopped


@contextlib.contextmanager
def buffers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put back the model's buffers that a trace on fake inputs wrote: the regions run on
    fakes with the real buffers, and a write that reads no fake value (batch norm's
    ``num_batches_tracked += 1``) lands in the real buffer (a ``memfit.plan`` of a batch-norm
    model counted a batch it never trained on)."""
    with torch.no_grad():
        kept = [(buffer, buffer._version, buffer.clone()) for buffer in model.buffers()
                if not isinstance(buffer, torch._subclasses.FakeTensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, version, value in kept:
                if buffer._version != version:
                    buffer.copy_(value)


def whole_step(regions: Sequence[Planned]) -> Planned:
    """The plans of a step's regions (graph breaks) as one ``Planned``.

    Its plan holds each region's (``Plan.regions``); its timelines sum the regions' times, and
    its peaks are the highest region's whole-device peak (each region's figures count the bytes
    the regions before it still hold); ``graph`` is that region's. ``regions`` keeps them all.
    """
    top = max(regions, key=lambda planned: planned.predicted_peak_bytes)
    outside = top.budget.outside_bytes
    plans = tuple(planned.plan for planned in regions)
    first = plans[0]
    plan = Plan(first.strategy, {}, _joined(p.graph_hash for p in plans), first.params,
                first.budget_bytes if top.budget.device_bytes is None else top.budget.device_bytes,
                first.hardware, topology_hash=_joined(p.topology_hash for p in plans),
                regions=plans)

    def summed(timelines: list[Timeline], peak_bytes: int) -> Timeline:
        return Timeline("simulated", peak_bytes - outside,
                        sum(t.step_time_s for t in timelines),
                        sum(t.exposed_transfer_s for t in timelines),
                        sum(t.recompute_s for t in timelines),
                        host_peak_bytes=max(t.host_peak_bytes for t in timelines))

    return Planned(top.graph, plan,
                   summed([p.baseline for p in regions],
                          max(p.baseline_peak_bytes for p in regions)),
                   summed([p.predicted for p in regions], top.predicted_peak_bytes),
                   top.budget, regions=tuple(regions))


def _joined(hashes: Iterable[str]) -> str:
    return hashlib.sha256("/".join(hashes).encode()).hexdigest()[:16]


def fake_like(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """An empty tensor with ``tensor``'s shape, strides, dtype and ``requires_grad``, on its
    device (``device`` for a meta tensor, where given)."""
    where = device if tensor.device.type == "meta" and device is not None else tensor.device
    fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                               device=where)
    return fake.requires_grad_(tensor.requires_grad)


def as_planned(region: Region) -> Planned:
    """A region's plan as ``plan_step`` returns one."""
    return Planned(region.plan_graph, region.plan, region.baseline, region.predicted,
                   DeviceBudget(region.budget_bytes, region.outside_bytes))

