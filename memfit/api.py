"""The public entry points: compile a training step under a budget, plan one, measure a peak.

One path: ``compile`` returns a ``Step`` that runs ``loss_fn(model, *inputs)`` compiled with
memfit's ``torch.compile`` backend, then ``loss.backward()``, so every parameter's ``.grad``
accumulates as PyTorch's own; Dynamo's guards decide when a region is traced and planned again
(a new shape, a frozen layer). ``plan`` traces the same module with fake inputs and keeps the
plan, running nothing. Planning is ``memfit.planning.step.plan_step``; the closed loop is
``memfit.compiler.closed_loop``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from memfit.compiler.backend import Backend
from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.closed_loop import CLOSED_LOOP, Loop, Round
from memfit.compiler.region import Region
from memfit.compiler.step_graph import analyzed, resolve_hardware
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetWarning
from memfit.data.hardware import PROFILES, Hardware, get_hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.data.units import Budget
from memfit.fitting.arguments import (
    check_flags,
    check_hardware_and_optimizer,
    check_optimizer_of,
    check_step,
    the_users_error,
)
from memfit.fitting.callers_compile import own_trace
from memfit.fitting.cluster import FsdpBlock, resolve_sharding
from memfit.fitting.traced import as_planned, loss_module, memfit_error, trace_plan
from memfit.model.sharding import DEFAULT_BUCKET_BYTES
from memfit.planning.step import Planned, plan_step
from memfit.planning.strategies import resolve_budget_and_strategy
from memfit.runtime.measure import measure_allocator_peak, profiler_running
from memfit.runtime.resident import device_of
from memfit.tracing.capture import check_inputs, input_signature

__all__ = ["Step", "Round", "BudgetWarning", "CLOSED_LOOP", "compile", "plan", "measure_peak",
           "analyzed", "resolve_hardware"]


class _SharedExclusive:
    """Steps run side by side in threads (shared); a call that may trace and plan, or that is
    measured, runs alone (exclusive). Tracing uses process-wide torch state (a capture beside a
    run in another thread can fail with functorch's "Expected current_level > 0"),
    and the profiler whose allocator events measure a step sees every thread's allocations."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._running = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive)
            self._running += 1
        try:
            yield
        finally:
            with self._condition:
                self._running -= 1
                self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive and not self._running)
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


_STEPS = _SharedExclusive()


class Step:
    """A training step compiled to fit a memory budget. Build one with ``memfit.compile``.

    A call runs ``torch.compile(LossModule(model, loss_fn), backend=<memfit's>, dynamic=False)``
    and then ``loss.backward()``: the backend plans each compiled region (``memfit.backend``), and
    gradients accumulate into ``.grad`` by PyTorch's own autograd.

    Attributes:
        plan: the ``Plan`` of the newest region planned for the most recent input signature.
        graph: its ``CostGraph``.
        predicted / baseline: simulated timelines of the planned and the unplanned region.
        measured: the measured peak and time of the most recent call (``None`` before the first,
            or without ``measure``); whole-device bytes, the bytes outside the graph included.
        rounds: the closed loop for the most recent input signature, one ``Round`` per plan.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, budget: Budget | None,
                 strategy: str, hardware: Hardware | str | None, measure: bool,
                 params: Mapping[str, Any], linearize: bool = False,
                 plan: Plan | None = None) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.hardware_spec = hardware
        self.measure = measure
        self.params = dict(params)
        self.closed_loop = plan is None  # a given plan is used as is
        self.backend = Backend(BackendOptions(
            budget, strategy, hardware, params=params, linearize=linearize, fixed_plan=plan,
            warn_over_prediction=not self.closed_loop,  # the loop re-plans instead
            scope_prefix="model."),  # LossModule holds the model as .model
            model=model)
        self._module = loss_module(model, loss_fn)
        self._compiled = torch.compile(self._module, backend=self.backend, dynamic=False)
        self._regions: dict[tuple, Region] = {}  # the newest region of each input signature
        self._loops: dict[tuple, Loop] = {}
        self._measured: dict[tuple, Timeline] = {}
        self._traced: set[tuple] = set()  # signatures that ran since the last forced re-plan
        self._last: tuple | None = None

    # ---- running -------------------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run forward and backward; accumulate gradients into ``.grad``; return the loss.

        With a budget and ``measure``, a step whose measured peak is over the budget still
        completes (its gradients are exact), and the next call runs a plan made for a budget
        lowered by the excess (``memfit.compiler.closed_loop``).

        Raises:
            BudgetError: if the plan cannot fit the budget (raised before anything runs).
            CaptureError: if the step cannot be traced.
            PlanError: if a given plan does not fit the step.
        """
        check_inputs(inputs)
        signature = input_signature(self.model, inputs)
        loop = self._loops.setdefault(signature, Loop())
        known = len(self.backend.regions)
        alone = self.measure or signature not in self._traced
        with _STEPS.exclusive() if alone else _STEPS.shared():
            self.backend.override_budget(loop.planning)
            try:
                loss, measured = self._run(inputs)
            except Exception as error:
                raise the_users_error(memfit_error(error),
                                      lambda: self.loss_fn(self.model, *inputs), self.model,
                                      inputs) from None
        self._traced.add(signature)
        if len(self.backend.regions) > known:
            self._regions[signature] = self.backend.regions[-1]
        self._last = signature
        if measured is not None:
            self._measured[signature] = measured
            self._close_loop(signature, measured)
        return loss

    def _run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Timeline | None]:
        if not self.measure:
            return self._forward_backward(*inputs), None
        if profiler_running():  # profilers do not nest: the user's session is left alone
            return self._measured_by_regions(inputs)
        resident = (list(self.model.parameters()), list(self.model.buffers()),
                    [p.grad for p in self.model.parameters() if p.grad is not None])
        start_s = time.perf_counter()
        measurement = measure_allocator_peak(self._forward_backward, *inputs, track=resident)
        elapsed_s = time.perf_counter() - start_s
        return measurement.result, Timeline("measured", measurement.peak_bytes, elapsed_s)

    def _measured_by_regions(self, inputs: tuple[torch.Tensor, ...]
                             ) -> tuple[torch.Tensor, Timeline | None]:
        """Run the step while the user's profiler records: its peak is the highest of its
        regions' measured runs in this call, which count what ops return beside what is resident
        (``run_measured``'s ``"ops"``; kernel scratch is not seen); ``None`` when no run of this
        call was measured (past the backend's ``measure_runs``)."""
        before = {id(region): region.measured_runs for region in self.backend.regions}
        start_s = time.perf_counter()
        loss = self._forward_backward(*inputs)
        elapsed_s = time.perf_counter() - start_s
        peaks = [peak for region in self.backend.regions
                 if region.measured_runs > before.get(id(region), 0)
                 for peak in (region.measured_forward_bytes, region.measured_backward_bytes)
                 if peak is not None]
        if not peaks:
            return loss, None
        return loss, Timeline("measured", max(peaks), elapsed_s, meta={"measured_by": "ops"})

    def _forward_backward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with own_trace():
            loss = self._compiled(*inputs)
        loss.backward()
        return loss.detach()

    def _force_replan(self) -> None:
        """Make the next call of every signature trace, and so plan, again."""
        self._module.plans += 1
        self._traced.clear()

    def _close_loop(self, signature: tuple, measured: Timeline) -> None:
        region = self._regions.get(signature)
        if region is None or not self.closed_loop:
            return
        hardware = self.backend.hardware_for(device_of(self.model.parameters()))

        def plan_for(budget_bytes: int) -> Planned:
            return plan_step(region.graph, hardware, Budget(bytes=budget_bytes), self.strategy,
                             self.params, region.outside_bytes)

        if self._loops[signature].record(as_planned(region), measured, plan_for):
            self._force_replan()

    # ---- reading -------------------------------------------------------------------------------

    @property
    def compiled(self) -> Region:
        """The newest region planned for the most recent input signature."""
        if self._last is None or self._last not in self._regions:
            raise RuntimeError("this step has not run yet: call it once")
        return self._regions[self._last]

    @property
    def regions(self) -> list[Region]:
        """Every region the step planned, in order (new shapes and re-plans add regions)."""
        return self.backend.regions

    @property
    def plan(self) -> Plan:
        return self.compiled.plan

    @property
    def graph(self) -> CostGraph:
        return self.compiled.graph

    @property
    def predicted(self) -> Timeline:
        return self.compiled.predicted

    @property
    def baseline(self) -> Timeline:
        return self.compiled.baseline

    @property
    def measured(self) -> Timeline | None:
        return self._measured.get(self._last) if self._last is not None else None

    @property
    def loop(self) -> Loop:
        """The closed loop of the most recent input signature."""
        if self._last is None:
            raise RuntimeError("this step has not run yet: call it once")
        return self._loops[self._last]

    @property
    def rounds(self) -> list[Round]:
        """The closed loop for the most recent input signature: one ``Round`` per plan."""
        return self.loop.rounds

    @property
    def budget_bytes(self) -> int | None:
        """The user's budget for the most recent input signature, whole device."""
        rounds = self.loop.rounds
        return rounds[0].planning_budget_bytes if rounds else self.compiled.budget_bytes

    def report(self) -> str:
        """Baseline / predicted / measured peak, predicted / measured time, what was swapped."""
        from memfit.render.text import step_report

        return step_report(self.compiled, self.measured, self.rounds)


def compile(model: torch.nn.Module, loss_fn: Callable, budget: str | int | float | None = None,
            strategy: str | None = None, hardware: Hardware | str | None = None, *,
            measure: bool = True, linearize: bool = False, plan: Plan | None = None,
            **params: Any) -> Step:
    """Compile ``loss_fn(model, *inputs)`` into a step that fits ``budget``.

    Args:
        model: the module to train.
        loss_fn: ``loss_fn(model, *inputs) -> scalar tensor``.
        budget: device bytes the step may use at its peak, read as on the command line
            (``memfit.data.units.parse_budget``): a bare number at most 1 is a fraction of the
            unplanned step's peak (``0.5``, ``"0.5"``; ``1`` is the whole peak, not one byte), an
            int above 1 is bytes, a size string is bytes (``"3GiB"``); a float above 1 is
            refused (write an int or units). ``None``: no limit.
        strategy: ``"auto"`` (the fastest mix of keep, swap and recompute that fits), ``"keep"``
            (the unplanned step), ``"swap"`` (TFLMS), ``"checkpoint"``, ``"optimal-recompute"``,
            ``"vdnn_all"``, ``"vdnn_conv"``, ``"vdnn_dyn"``, ... (``memfit.planning.strategies.
            strategy_names()``). Default: ``"auto"`` with a budget, ``"keep"`` without.
        hardware: a profile name (``"h100-pcie"``, ``"cpu"``, ...) or ``Hardware`` for the cost
            model. Default: ``cpu`` on a CPU, measured on an accelerator.
        measure: measure every step's device peak (cheap; off to shave the tracker's overhead).
        linearize: reorder the forward pass as late as possible before planning (default
            ``False``): values made early and read late (side inputs, masks) are made right
            before their reader. Results are bit for bit the same and the unplanned peak never
            rises; it costs one more analysis of the captured graph.
        plan: a ``Plan`` made before (``memfit.plan``, ``step.plan``, ``memfit.Plan.load``), used
            as is instead of planning; it fixes the budget, strategy and parameters, and its
            hardware profile is the default ``hardware``. Each input shape is checked against it.
        **params: the strategy's parameters, e.g. ``lb=3, ctrld_strategy="direct_order"``.

    Raises:
        ValueError: for a malformed budget, an unknown strategy, parameter or hardware profile,
            or a bad value; for ``plan`` together with a budget, strategy or parameters.
        PlanError: at the first step, if ``plan`` was made for another graph, input shape or
            hardware (the message says which, and what to do).

    Example:
        >>> step = memfit.compile(model, loss_fn, budget="0.5")   # strategy="auto"
        >>> loss = step(input_ids, labels)
        >>> print(step.report())
        >>> step.plan.save("step.plan.json")   # later: memfit.compile(model, loss_fn,
        >>> #     plan=memfit.Plan.load("step.plan.json"))
    """
    check_step(model, loss_fn)
    check_flags(measure=measure, linearize=linearize)
    check_hardware_and_optimizer(hardware, None)
    if plan is not None:
        if not isinstance(plan, Plan):
            raise ValueError(f"plan= takes a memfit.Plan, not {type(plan).__name__}: read a saved "
                             "one with memfit.Plan.load(path)")
        if budget is not None or strategy is not None or params:
            raise ValueError("plan= already fixes the budget, strategy and parameters: pass "
                             "either plan= or budget/strategy/parameters, not both")
        if hardware is None and plan.hardware in PROFILES:
            hardware = plan.hardware
        return Step(model, loss_fn, None, plan.strategy, hardware, measure, {}, linearize, plan)
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    return Step(model, loss_fn, parsed, chosen, hardware, measure, params, linearize)


def plan(model: torch.nn.Module, loss_fn: Callable, *inputs: torch.Tensor,
         budget: str | int | float | None = None, hardware: Hardware | str = "h100-pcie",
         strategy: str | None = None, linearize: bool = False,
         autocast: torch.dtype | None = None, world_size: int = 1,
         sharding: str = "none", fsdp_block: FsdpBlock = None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         optimizer: torch.optim.Optimizer | None = None, **params: Any) -> Plan:
    """Plan a step without running it; ``inputs`` may be meta tensors.

    ``linearize`` reorders the forward pass first, as in ``compile``. The plan explains itself
    (``plan.explain()``), saves (``plan.save(path)``) and runs (``compile(..., plan=plan)``).
    A step that Dynamo breaks into regions (a logger call in transformers' loss, Python between
    regions) is planned region by region, each beside the saves of those before it: the plan
    holds one plan per region (``plan.regions``, in the order they run), ``plan.explain()``
    lists each with its share of the budget, and ``compile(..., plan=plan)`` gives each region
    its own.

    The graph planned is the one ``hardware``'s device runs (``memfit.tracing.target``): planned
    from CPU or meta tensors for a GPU profile, the step's attention is CUDA's kernel (flash or
    memory-efficient: no S x S scores kept) and ``autocast`` (``torch.bfloat16`` or
    ``torch.float16``) applies CUDA's autocast policy, as ``torch.autocast("cuda", dtype)``
    around the step would; for the ``"cpu"`` profile it is ``torch.autocast("cpu", dtype)``.
    Such a plan runs only on its device: ``compile(..., plan=plan)`` on CPU tensors refuses a
    plan whose graph differs from the CPU's.

    Args:
        world_size: ranks of a data-parallel job to plan one rank of (default 1: one device).
            ``inputs`` are then one rank's batch, and ``budget`` is one rank's device bytes.
        sharding: ``"none"`` (default), ``"fsdp"`` (FSDP2 ``fully_shard`` on each block and
            on the root, ``reshard_after_forward=True``) or ``"ddp"``. With ``world_size`` > 1
            the plan is one rank's (``memfit.model.sharding``): sharded parameters, gradients
            and optimizer state, all-gathers and reduce-scatters (or DDP's bucketed
            all-reduces) timed on the profile's interconnect. Such a plan is for reading and
            comparing; it names a graph this process does not run.
        fsdp_block: the FSDP units: a module class, a predicate ``(path, module) -> bool`` or
            module paths; default: the children of the largest ``nn.ModuleList``.
        bucket_bytes: DDP's gradient bucket size (default 25 MiB, DDP's ``bucket_cap_mb``).
        optimizer: the optimizer whose state is resident beside the step (reserved before its
            first step); FSDP shards it. Default: none counted. It must step some of
            ``model``'s parameters.

    Raises:
        BudgetError, ValueError, CaptureError: as ``compile``; ValueError also for a sharding
            the hardware profile states no interconnect for, and for an optimizer that steps
            none of ``model``'s parameters.

    Example:
        >>> plan = memfit.plan(model, loss_fn, tokens, budget="70GiB", hardware="h100-sxm",
        ...                    world_size=8, sharding="fsdp", optimizer=adamw)
    """
    check_step(model, loss_fn)
    check_inputs(inputs)
    check_flags(linearize=linearize)
    check_hardware_and_optimizer(hardware, optimizer)
    check_optimizer_of(model, optimizer)
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    spread = resolve_sharding(model, sharding, world_size, fsdp_block, bucket_bytes)
    return trace_plan(model, loss_fn, inputs, parsed, chosen, get_hardware(hardware), params,
                      linearize, what_ifs=True, autocast=autocast, sharding=spread,
                      optimizer=optimizer).plan


def measure_peak(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Device bytes at the peak of ``fn(*args, **kwargs)``, measured as memfit's own steps are:
    compiled code runs compiled (a fitted model's plan stays in use), nothing is switched off.

    What it counts: on CUDA, ``torch.cuda.max_memory_allocated`` (every byte the caching
    allocator handed out, whoever holds it). On a CPU, the bytes of the tensors among ``args``,
    ``kwargs`` and ``track=`` (one storage once: pass the parameters, gradients and optimizer
    state resident during the call) plus the most the CPU allocator held above its level at the
    call's start, read from the profiler's allocator events: what ops return and what kernels
    allocate inside one op. memfit's swap buffers on a CPU come from numpy and are not counted.

    Raises:
        ProfilerRunning: on a CPU while a profiler of the user's is open (profilers do not nest;
            memfit leaves that session alone).

    Example:
        >>> peak_bytes = memfit.measure_peak(iteration, track=(list(model.parameters()),
        ...                                                    optimizer.state, batch))

    For the full result (the call's return value, the bytes at its start) use
    ``memfit.runtime.measure.measure_allocator_peak``.
    """
    return measure_allocator_peak(fn, *args, **kwargs).peak_bytes


def report(model_or_backend: torch.nn.Module | Backend) -> str:
    """What memfit planned for a model from ``memfit.fit`` (or a ``memfit.backend``): per
    compiled region its budget, unplanned, predicted and measured peak (and the gap), what was
    swapped and recomputed; then how often plans were remade, and which code ran outside any
    plan (``memfit.compiler.report``)."""
    from memfit.compiler.report import regions_report

    planner = model_or_backend
    if not isinstance(planner, Backend):
        planner = getattr(model_or_backend, "_memfit_backend", None)
    if not isinstance(planner, Backend):
        raise ValueError("memfit.report takes a model returned by memfit.fit or a memfit.backend")
    return regions_report(planner)
