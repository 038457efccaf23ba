"""The public entry points: compile a training step under a budget, plan one, measure a peak.

``compile`` returns a ``Step``: calling it runs forward and backward of ``loss_fn(model, *inputs)``
under a plan and leaves every parameter's ``.grad`` as ``loss.backward()`` would (accumulating).
A new input shape re-captures and re-plans; the same shape reuses the plan.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.explain import explain
from memfit.core.hardware import PROFILES, Hardware, get_hardware
from memfit.core.linearize import linearize as as_late_as_possible
from memfit.core.plan import Plan, topology_hash
from memfit.core.schedule import PlanError
from memfit.core.simulate import simulate
from memfit.core.timeline import Timeline
from memfit.core.units import Budget, format_bytes
from memfit.graph.analyze import analyze
from memfit.graph.capture import Captured, capture, check_inputs, input_signature
from memfit.graph.rewrite import reorder, rewrite
from memfit.runtime.executor import Executor
from memfit.runtime.measure import measure_peak as _measure_peak
from memfit.runtime.profile import run_measured
from memfit.strategies import get_strategy, resolve_budget_and_strategy

__all__ = ["Step", "Round", "BudgetWarning", "compile", "plan", "measure_peak"]


class _SharedExclusive:
    """Steps run side by side in threads (shared); a capture and its planning run alone
    (exclusive). Tracing uses process-wide torch state: a capture in one thread beside a
    measured run in another failed now and then with functorch's "Expected current_level > 0"."""

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


class BudgetWarning(UserWarning):
    """A measured step ran over the budget and re-planning could not bring it back under."""


@dataclass(frozen=True)
class ClosedLoop:
    """How a step re-plans after a measured peak over the budget (``CLOSED_LOOP``)."""

    max_rounds: int = 4  # plans per input signature, the first included; then warn
    margin_fraction: float = 0.1  # the planning budget drops by the excess plus this much of it
    margin_bytes: int = 512  # ... plus one CUDA allocator block, so rounding cannot undo it


CLOSED_LOOP = ClosedLoop()


@dataclass(frozen=True)
class Round:
    """One plan of the closed loop, in whole-device bytes (bytes outside the graph included).

    Args:
        planning_budget_bytes: the budget the plan was made for (the user's, in the first round).
        predicted_peak_bytes: the simulator's peak of that plan.
        measured_peak_bytes: the highest measured peak of the steps run with it (``None`` before).
        step_time_s: the measured time of its first step.
    """

    planning_budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    step_time_s: float | None = None


@dataclass
class Compiled:
    """Everything memfit made for one input signature."""

    captured: Captured
    graph: CostGraph
    plan: Plan
    program: torch.fx.GraphModule
    baseline: Timeline  # the unplanned step, simulated
    predicted: Timeline  # the planned step, simulated
    budget_bytes: int | None
    outside_bytes: int  # device bytes outside the graph (existing .grad) at planning time
    # the last few measured steps; bounded, as a training loop calls a step thousands of times
    measured: deque[Timeline] = field(default_factory=lambda: deque(maxlen=8))
    hardware: Hardware | None = None  # the profile it was planned with (the closed loop re-plans)
    rounds: list[Round] = field(default_factory=list)  # the closed loop, one per plan
    settled: bool = False  # the closed loop stopped (fits, or warned that it cannot)


class Step:
    """A training step compiled to fit a memory budget. Build one with ``memfit.compile``.

    Attributes:
        plan: the ``Plan`` for the most recent input signature.
        graph: its ``CostGraph``.
        predicted / baseline: simulated timelines of the planned and the unplanned step.
        measured: the measured timeline of the most recent call (``None`` before the first).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, budget: Budget | None,
                 strategy: str, hardware: Hardware | str | None, measure: bool,
                 params: Mapping[str, Any], linearize: bool = False,
                 plan: Plan | None = None) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.budget = budget
        self.strategy = strategy
        self.hardware_spec = hardware
        self.measure = measure
        self.params = dict(params)
        self.linearize = linearize
        self.fixed_plan = plan  # a plan given to compile(plan=...): used as is, checked per shape
        self._compiled: dict[tuple, Compiled] = {}
        self._last: Compiled | None = None

    # ---- running -------------------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run forward and backward; accumulate gradients into ``.grad``; return the loss.

        With a budget and ``measure``, a step whose measured peak is over the budget still
        completes (its gradients are exact), and the next call runs a plan made for a budget
        lowered by the excess: see ``Step.rounds``. After ``CLOSED_LOOP.max_rounds`` plans, or
        when no tighter plan exists, it warns (``BudgetWarning``) with the bytes still over.

        Raises:
            BudgetError: if the plan cannot fit the budget (raised before anything runs).
            CaptureError: if the step cannot be captured.
        """
        check_inputs(inputs)
        if input_signature(self.model, inputs) in self._compiled:
            compiled = self.compile_for(*inputs)  # planned: nothing traces
        else:
            with _STEPS.exclusive():
                compiled = self.compile_for(*inputs)
        flat = self._flat_inputs(compiled.captured, inputs)  # held: inputs are resident
        measured = None
        with _STEPS.shared():
            if self.measure:
                existing = [p.grad for p in self.model.parameters() if p.grad is not None]
                outputs, measured = run_measured(compiled.program, list(flat), track=existing)
                compiled.measured.append(measured)
            else:
                outputs = Executor(compiled.program, device=_device_of(flat)).run_flat(list(flat))
        del flat
        loss = self._apply(compiled.captured, outputs)
        if measured is not None and compiled.budget_bytes is not None:
            self._close_loop(compiled, measured)
        return loss

    def _close_loop(self, compiled: Compiled, measured: Timeline) -> None:
        """Record the step in this plan's round; if it ran over, re-plan tighter for the next."""
        budget_bytes = compiled.budget_bytes
        assert budget_bytes is not None
        if not compiled.rounds:
            compiled.rounds.append(Round(budget_bytes, _whole(compiled)))
        last = compiled.rounds[-1]
        compiled.rounds[-1] = replace(
            last, measured_peak_bytes=max(last.measured_peak_bytes or 0, measured.peak_bytes),
            step_time_s=measured.step_time_s if last.step_time_s is None else last.step_time_s)
        excess = measured.peak_bytes - budget_bytes
        if excess <= 0 or compiled.settled:
            return
        over = (f"the measured peak {format_bytes(measured.peak_bytes)} is over the budget "
                f"{format_bytes(budget_bytes)} by {format_bytes(excess)}")
        if len(compiled.rounds) >= CLOSED_LOOP.max_rounds:
            return self._give_up(compiled, f"{over} after {len(compiled.rounds)} plans")
        margin = int(excess * CLOSED_LOOP.margin_fraction) + CLOSED_LOOP.margin_bytes
        # the plan's own peak, not just its budget, must drop by the excess: a plan predicted
        # under its budget leaves that slack for the model's error to eat first
        planning = min(last.planning_budget_bytes, last.predicted_peak_bytes) - excess - margin
        try:
            made, planning = self._replan(compiled, planning, last.predicted_peak_bytes)
        except (BudgetError, PlanError) as error:
            return self._give_up(compiled, f"{over}, and no plan fits a tighter "
                                           f"{format_bytes(planning)}: {error}")
        assert compiled.hardware is not None
        predicted = simulate(compiled.graph, made, compiled.hardware)
        if predicted.peak_bytes >= compiled.predicted.peak_bytes:
            return self._give_up(compiled, f"{over}, and re-planning for "
                                           f"{format_bytes(planning)} does not lower the peak")
        compiled.plan, compiled.predicted = made, predicted
        compiled.program = rewrite(compiled.captured.graph_module, compiled.graph, made)
        compiled.rounds.append(Round(planning, _whole(compiled)))

    def _replan(self, compiled: Compiled, planning_bytes: int,
                predicted_bytes: int) -> tuple[Plan, int]:
        """A plan for ``planning_bytes``; if none fits, the smallest one under ``predicted_bytes``.
        Returns the plan and the budget it was made for.

        Note:
            The excess is what the last plan measured over its prediction; the next plan may
            swap or recompute the very tensors that caused it, so the tightest plan is worth
            one measured try before giving up.
        """
        assert compiled.hardware is not None
        plan_for = partial(make_plan, compiled.graph, compiled.hardware, strategy=self.strategy,
                           params=self.params, outside_bytes=compiled.outside_bytes)
        try:
            return plan_for(budget=Budget(bytes=max(planning_bytes, 1)))[0], planning_bytes
        except BudgetError as error:
            if error.minimum_bytes >= predicted_bytes:
                raise
            return plan_for(budget=Budget(bytes=error.minimum_bytes))[0], error.minimum_bytes

    @staticmethod
    def _give_up(compiled: Compiled, why: str) -> None:
        compiled.settled = True
        warnings.warn(f"memfit: {why.rstrip('.')}. Lower the budget you pass, or shrink the batch.",
                      BudgetWarning, stacklevel=4)

    def _flat_inputs(self, captured: Captured, inputs) -> list[torch.Tensor]:
        """One value per placeholder, bound by descriptor (never by position)."""
        flat = []
        placeholders = captured.graph_module.graph.find_nodes(op="placeholder")
        for node, binding in zip(placeholders, captured.inputs, strict=True):
            if binding.kind == "parameter":
                flat.append(self.model.get_parameter(binding.target).detach())
            elif binding.kind == "buffer":
                flat.append(self.model.get_buffer(binding.target))
            elif binding.kind == "input":
                flat.append(inputs[binding.index].detach())
            elif binding.kind == "tangent":  # the seed of backward: d loss / d loss = 1
                value = node.meta["val"]
                flat.append(torch.ones(value.shape, dtype=value.dtype, device=_device_of(inputs)))
            else:
                raise AssertionError(f"unexpected graph input {binding}")
        return flat

    def _apply(self, captured: Captured, outputs) -> torch.Tensor:
        """Write gradients and buffer updates into the model, only after the whole step ran."""
        loss = None
        with torch.no_grad():
            for binding, value in zip(captured.outputs, outputs, strict=True):
                if binding.kind == "loss":
                    loss = value
                elif binding.kind == "gradient" and value is not None:
                    parameter = self.model.get_parameter(binding.target)
                    if parameter.grad is None:
                        parameter.grad = value
                    else:
                        parameter.grad.add_(value)
                elif binding.kind == "buffer_update":
                    self.model.get_buffer(binding.target).copy_(value)
        assert loss is not None
        return loss

    # ---- planning ------------------------------------------------------------------------------

    def compile_for(self, *inputs: torch.Tensor) -> Compiled:
        """Capture, analyze, plan and rewrite for these inputs' signature (cached)."""
        check_inputs(inputs)
        signature = input_signature(self.model, inputs)
        compiled = self._compiled.get(signature)
        if compiled is None:
            compiled = self._compile(inputs)
            self._compiled[signature] = compiled
        self._last = compiled
        return compiled

    def _compile(self, inputs) -> Compiled:
        device = inputs[0].device if inputs else torch.device("cpu")
        hardware = resolve_hardware(self.hardware_spec, device)
        captured = capture(self.model, self.loss_fn, *inputs)
        captured, graph = analyzed(captured, hardware, type(self.model).__name__, self.linearize)
        outside_bytes = sum(
            p.grad.untyped_storage().nbytes() for p in self.model.parameters() if p.grad is not None
        )
        made, baseline, budget_bytes = make_plan(graph, hardware, self.budget, self.strategy,
                                                 self.params, outside_bytes, self.fixed_plan,
                                                 what_ifs=False)
        program = rewrite(captured.graph_module, graph, made)
        predicted = simulate(graph, made, hardware)
        return Compiled(captured, graph, made, program, baseline, predicted, budget_bytes,
                        outside_bytes, hardware=hardware)

    # ---- reading -------------------------------------------------------------------------------

    @property
    def compiled(self) -> Compiled:
        if self._last is None:
            raise RuntimeError("this step has not run yet: call it once (or .compile_for(*inputs))")
        return self._last

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
        return self.compiled.measured[-1] if self.compiled.measured else None

    @property
    def rounds(self) -> list[Round]:
        """The closed loop for the most recent input signature: one ``Round`` per plan."""
        return self.compiled.rounds

    def report(self) -> str:
        """Baseline / predicted / measured peak, predicted / measured time, what was swapped."""
        from memfit.render.text import step_report

        return step_report(self.compiled)


def _whole(compiled: Compiled) -> int:
    """The predicted peak of the whole device: the graph's and the bytes outside it."""
    return compiled.predicted.peak_bytes + compiled.outside_bytes


def analyzed(captured: Captured, hardware: Hardware, name: str,
             linearize: bool) -> tuple[Captured, CostGraph]:
    """The step's CostGraph; with ``linearize``, the step reordered as late as possible first.

    The fx node order is the program order, so the captured graph itself is reordered and
    analyzed again: what is planned, rewritten and run is one order (``memfit.core.linearize``
    keeps random ops in their order and never raises the unplanned peak).
    """
    graph = analyze(captured, hardware, name=name)
    if not linearize:
        return captured, graph
    linear = as_late_as_possible(graph)
    if linear is graph:
        return captured, graph
    order = [op.name for op in linear.ops]
    captured = replace(captured, graph_module=reorder(captured.graph_module, order))
    return captured, analyze(captured, hardware, name=name)


def resolve_hardware(hardware: Hardware | str | None, device: torch.device) -> Hardware:
    """The profile to plan with: given, or the built-in ``cpu`` profile on a CPU, else measured."""
    if hardware is not None:
        return get_hardware(hardware)
    if device.type in ("cpu", "meta"):
        return get_hardware("cpu")
    from memfit.runtime.probe import measure_hardware

    return measure_hardware(device)


def make_plan(graph: CostGraph, hardware: Hardware, budget: Budget | None, strategy: str,
              params: Mapping[str, Any], outside_bytes: int = 0,
              fixed: Plan | None = None, what_ifs: bool = True) -> tuple[Plan, Timeline, int | None]:
    """Plan ``graph``: returns the plan, the unplanned step's timeline and the budget in bytes.

    The budget covers the whole device; bytes outside the graph (existing ``.grad``) come off it.
    The plan carries its ``Explanation``: rows per decision and, with ``what_ifs``, the plans at
    the budget x0.9 and x1.1. Those are two more plan calls, so ``compile`` and the batch search,
    which plan on the way to running, leave them out; ``memfit.plan`` and ``memfit plan``, whose
    job is to explain, keep them. A ``fixed`` plan (``compile(plan=...)``) is checked and
    returned as is.

    Raises:
        BudgetError: if the strategy cannot fit the budget.
        PlanError: if ``fixed`` was made for another graph, input shape or hardware.
    """
    keep = get_strategy("keep")(graph, hardware)
    baseline = simulate(graph, keep, hardware)
    if fixed is not None:
        fixed.check_for(graph, hardware.name)
        made_for = fixed.explanation.budget_bytes if fixed.explanation else fixed.budget_bytes
        return fixed, baseline, made_for
    budget_bytes = None
    if budget is not None:
        budget_bytes = budget.to_bytes(baseline.peak_bytes + outside_bytes)
    chosen = get_strategy(strategy)

    def replan(graph_budget_bytes: int | None) -> Plan:
        return chosen(graph, hardware, graph_budget_bytes, **params)

    if budget_bytes is None:
        made = replan(None)
    else:
        try:
            made = replan(max(budget_bytes - outside_bytes, 1))
        except BudgetError as error:  # report the whole device, the bytes outside the graph included
            raise BudgetError(budget_bytes, error.minimum_bytes + outside_bytes, error.dominant,
                              error.strategy, error.note) from None
    explanation = explain(graph, made, hardware, baseline, budget_bytes, outside_bytes,
                          replan if what_ifs else None)
    return (replace(made, topology_hash=topology_hash(graph), explanation=explanation), baseline,
            budget_bytes)


def _device_of(tensors) -> torch.device:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def compile(model: torch.nn.Module, loss_fn: Callable, budget: str | int | float | None = None,
            strategy: str | None = None, hardware: Hardware | str | None = None, *,
            measure: bool = True, linearize: bool = False, plan: Plan | None = None,
            **params: Any) -> Step:
    """Compile ``loss_fn(model, *inputs)`` into a step that fits ``budget``.

    Args:
        model: the module to train.
        loss_fn: ``loss_fn(model, *inputs) -> scalar tensor``.
        budget: device bytes the step may use at its peak, read as on the command line
            (``memfit.core.units.parse_budget``): a bare number at most 1 is a fraction of the
            unplanned step's peak (``0.5``, ``"0.5"``; ``1`` is the whole peak, not one byte), an
            int above 1 is bytes, a size string is bytes (``"3GiB"``); a float above 1 is
            refused (write an int or units). ``None``: no limit.
        strategy: ``"auto"`` (the fastest mix of keep, swap and recompute that fits), ``"keep"``
            (the unplanned step), ``"swap"`` (TFLMS), ``"checkpoint"``, ``"optimal-recompute"``,
            ``"vdnn_all"``, ``"vdnn_conv"``, ``"vdnn_dyn"``, ... (``memfit.strategies.
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
        ValueError: for a malformed budget, an unknown strategy or parameter, or a bad value;
            for ``plan`` together with a budget, strategy or parameters.
        PlanError: at the first step, if ``plan`` was made for another graph, input shape or
            hardware (the message says which, and what to do).

    Example:
        >>> step = memfit.compile(model, loss_fn, budget="0.5")   # strategy="auto"
        >>> loss = step(input_ids, labels)
        >>> print(step.report())
        >>> step.plan.save("step.plan.json")   # later: memfit.compile(model, loss_fn,
        >>> #     plan=memfit.Plan.load("step.plan.json"))
    """
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
         strategy: str | None = None, linearize: bool = False, **params: Any) -> Plan:
    """Plan a step without running it; ``inputs`` may be meta tensors.

    ``linearize`` reorders the forward pass first, as in ``compile``. The plan explains itself
    (``plan.explain()``), saves (``plan.save(path)``) and runs (``compile(..., plan=plan)``).

    Raises:
        BudgetError, ValueError, CaptureError: as ``compile``.
    """
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    resolved = get_hardware(hardware)
    captured = capture(model, loss_fn, *inputs)
    _, graph = analyzed(captured, resolved, type(model).__name__, linearize)
    made, _, _ = make_plan(graph, resolved, parsed, chosen, params)
    return made


def measure_peak(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Device bytes at the peak of ``fn(*args, **kwargs)``, tensors among the arguments included.

    On CUDA this is ``torch.cuda.max_memory_allocated``; on CPU, memfit's dispatch-level tracker.
    For the full result use ``memfit.runtime.measure.measure_peak``.
    """
    return _measure_peak(fn, *args, **kwargs).peak_bytes
