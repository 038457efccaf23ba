"""memfit as a ``torch.compile`` backend: every compiled region planned under the byte budget.

``memfit.fit(model, budget=..., optimizer=opt)`` is ``torch.compile(model, backend=memfit.backend(
...), dynamic=False)``: Dynamo captures the user's regions with its guards and graph breaks,
AOTAutograd traces each region's forward and backward into a joint graph with fake tensors, and
memfit is its partitioner: it builds the region's ``CostGraph``, plans it (any strategy), rewrites
the joint program (swap-outs, swap-ins, waits, re-runs with their random states) and splits it
into the forward and backward modules that AOTAutograd runs. The user's loop, ``loss.backward()``,
hooks, gradient accumulation and optimizers stay PyTorch's own.

Example:
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> model = memfit.fit(model, budget="20GiB", optimizer=optimizer)
    >>> for batch in loader:
    ...     loss = model(**batch).loss
    ...     loss.backward()
    ...     optimizer.step(); optimizer.zero_grad()
    >>> print(memfit.report(model))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memfit.core.costgraph import CostGraph
from memfit.core.hardware import Hardware
from memfit.core.plan import Plan
from memfit.core.simulate import simulate
from memfit.core.timeline import Timeline
from memfit.core.units import Budget, format_bytes
from memfit.graph.analyze import analyze
from memfit.graph.joint import as_captured, split
from memfit.graph.rewrite import rewrite
from memfit.runtime.resident import resident_bytes
from memfit.runtime.streams import CopyEngine, active_engine

COMPILERS = ("aot_eager", "inductor")


@dataclass
class Region:
    """One compiled region memfit planned: its graph, plan, prediction and the two modules.

    Args:
        budget_bytes: the whole-device budget the region was planned for (``None``: no budget).
        outside_bytes: device bytes alive outside the region while it runs (parameters of other
            regions, gradients kept across micro-batches, optimizer state, reserved or real).
    """

    index: int
    graph: CostGraph
    plan: Plan
    baseline: Timeline
    predicted: Timeline
    budget_bytes: int | None
    outside_bytes: int
    forward: fx.GraphModule
    backward: fx.GraphModule

    @property
    def predicted_peak_bytes(self) -> int:
        """The whole device's predicted peak while this region runs."""
        return self.predicted.peak_bytes + self.outside_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.baseline.peak_bytes + self.outside_bytes


class Backend:
    """A ``torch.compile`` backend whose partitioner is memfit's planner. Build with
    ``memfit.backend``; ``regions`` lists what it planned, ``report()`` shows it."""

    def __init__(self, budget: Budget | None, strategy: str, hardware: Hardware | str | None,
                 compiler: str, optimizer: torch.optim.Optimizer | None,
                 model: torch.nn.Module | None, params: Mapping[str, Any]) -> None:
        self.budget = budget
        self.strategy = strategy
        self.hardware_spec = hardware
        self.compiler = compiler
        self.optimizer = optimizer
        self.model = model
        self.params = dict(params)
        self.regions: list[Region] = []

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        device = _device_of(example_inputs)
        engine = CopyEngine(device)
        if self.compiler == "inductor":
            from memfit.graph.inductor import compile_with_inductor

            return compile_with_inductor(graph_module, example_inputs, self._partition(device),
                                         engine)
        compile_module = _runner(engine)
        return aot_autograd(fw_compiler=compile_module, bw_compiler=compile_module,
                            partition_fn=self._partition(device),
                            keep_inference_input_mutations=True)(graph_module, example_inputs)

    def _partition(self, device: torch.device):
        def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None, **_):
            return self.plan_region(joint, device, num_fwd_outputs, static_lifetime_input_indices)

        return partition

    def plan_region(self, joint: fx.GraphModule, device: torch.device, num_fwd_outputs: int,
                    static_lifetime_input_indices: list[int] | None
                    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Plan one region's joint graph and split the rewritten program into its two modules.

        Raises:
            BudgetError: if no plan of the strategy fits, before anything runs.
        """
        from memfit.api import make_plan, resolve_hardware

        hardware = resolve_hardware(self.hardware_spec, device)
        captured = as_captured(joint, num_fwd_outputs, static_lifetime_input_indices)
        graph = analyze(captured, hardware, name=f"region {len(self.regions)}")
        inside = sum(binding_bytes(node) for node, binding in
                     zip(joint.graph.find_nodes(op="placeholder"), captured.inputs, strict=True)
                     if binding.kind == "parameter")
        outside = max(0, resident_bytes(self.model, self.optimizer, device) - inside)
        made, baseline, budget_bytes = make_plan(graph, hardware, self.budget, self.strategy,
                                                 self.params, outside, what_ifs=False)
        program = rewrite(joint, graph, made)
        forward, backward = split(program, num_fwd_outputs, static_lifetime_input_indices)
        predicted = simulate(graph, made, hardware)
        self.regions.append(Region(len(self.regions), graph, made, baseline, predicted,
                                   budget_bytes, outside, forward, backward))
        return forward, backward

    def report(self) -> str:
        """Per compiled region: budget, unplanned and predicted peak, what was decided."""
        from memfit.render.text import table

        if not self.regions:
            return "memfit: no region has been compiled yet (call the model once)"
        rows = []
        for region in self.regions:
            plan = region.plan
            rows.append((region.index, len(region.graph.ops),
                         format_bytes(region.budget_bytes) if region.budget_bytes else "none",
                         format_bytes(region.baseline_peak_bytes),
                         format_bytes(region.predicted_peak_bytes),
                         f"{plan.strategy} ({plan.params.get('solver', plan.strategy)})",
                         len(plan.swapped), len(plan.reruns)))
        return table(("region", "ops", "budget", "unplanned", "predicted", "strategy",
                      "swapped", "re-runs"), rows)


def binding_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def _runner(engine: CopyEngine):
    """AOTAutograd's module compiler for ``aot_eager``: the module's own generated code, boxed
    (it frees its inputs as it goes), run with the region's copy engine current."""
    from torch.fx.graph import _BoxedCodeGen

    def compile_module(module: fx.GraphModule, example_inputs) -> Any:
        module.graph.set_codegen(_BoxedCodeGen())
        module.recompile()
        forward = module.forward

        def run(args: list) -> Any:
            with active_engine(engine):
                return forward(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile_module


def _device_of(values) -> torch.device:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def backend(budget: str | int | float | None = None, strategy: str | None = None,
            hardware: Hardware | str | None = None, compiler: str = "aot_eager",
            optimizer: torch.optim.Optimizer | None = None, *,
            model: torch.nn.Module | None = None, **params: Any) -> Backend:
    """A ``torch.compile`` backend that plans every compiled region under ``budget``.

    Args:
        budget: device bytes of the whole iteration's peak (parameters, gradients, optimizer
            state, inputs, activations, temporaries): an int of bytes, a size string
            (``"20GiB"``) or a fraction in (0, 1] of the unplanned peak. ``None``: no limit.
        strategy: as ``memfit.compile`` (default ``"auto"`` with a budget, ``"keep"`` without).
        hardware: the profile for the cost model (default: ``cpu`` on a CPU, measured on a GPU).
        compiler: how the planned modules run: ``"aot_eager"`` (their generated Python code;
            gradients bit for bit eager's with deterministic algorithms on) or ``"inductor"``
            (inductor compiles them, fused kernels and all; memfit replaces only its
            partitioner, so results are ``torch.compile(model)``'s, see ``memfit.graph.inductor``).
        optimizer: the optimizer of the loop, so that its state is reserved in the budget before
            its first ``step()`` creates it. Without it, state that exists when a region is
            planned still counts, but on the first iteration none exists yet.
        model: the model, so that its parameters outside a region count (``memfit.fit`` passes it).
        **params: the strategy's parameters.

    Raises:
        ValueError: for a malformed budget, an unknown strategy, parameter or compiler.

    Example:
        >>> compiled = torch.compile(model, backend=memfit.backend(budget=0.5), dynamic=False)
    """
    from memfit.api import resolve_budget_and_strategy

    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: use one of {COMPILERS}")
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    return Backend(parsed, chosen, hardware, compiler, optimizer, model, params)


def fit(model: torch.nn.Module, budget: str | int | float | None = None,
        strategy: str | None = None, hardware: Hardware | str | None = None,
        compiler: str = "aot_eager", optimizer: torch.optim.Optimizer | None = None,
        **params: Any) -> torch.nn.Module:
    """``model`` compiled so that each training iteration fits ``budget``: the one-line form of
    ``torch.compile(model, backend=memfit.backend(...), dynamic=False)``.

    Each input shape is planned on its own (``dynamic=False``); Dynamo's guards decide when a
    region is traced and planned again (a frozen layer, a changed Python value, a new shape).
    Arguments are those of ``memfit.backend``; ``memfit.report(compiled)`` shows the plans.

    Example:
        >>> model = memfit.fit(model, budget=0.5, optimizer=optimizer)
        >>> loss = model(**batch).loss; loss.backward(); optimizer.step()
    """
    planner = backend(budget, strategy, hardware, compiler, optimizer, model=model, **params)
    compiled = torch.compile(model, backend=planner, dynamic=False)
    compiled.__class__ = _fitted_class()
    compiled._memfit_backend = planner  # type: ignore[assignment]
    return compiled


def _fitted_class() -> type:
    """``torch.compile``'s module type, raising memfit's own errors as they are.

    Dynamo wraps an error of a backend in ``BackendCompilerFailed``; a ``BudgetError`` (with its
    ``minimum_bytes``) or a ``CaptureError`` is what the user can act on, so it comes out whole.
    """
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.exc import BackendCompilerFailed

    from memfit.core.errors import BudgetError, CaptureError
    from memfit.core.schedule import PlanError

    class FittedModule(OptimizedModule):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().__call__(*args, **kwargs)
            except BackendCompilerFailed as failed:
                inner = failed.inner_exception
                if isinstance(inner, (BudgetError, CaptureError, PlanError)):
                    raise inner.with_traceback(None) from None
                raise

    return FittedModule


def report(model_or_backend: torch.nn.Module | Backend) -> str:
    """What memfit planned for a model from ``memfit.fit`` (or a ``memfit.backend``)."""
    planner = model_or_backend
    if not isinstance(planner, Backend):
        planner = getattr(model_or_backend, "_memfit_backend", None)
    if not isinstance(planner, Backend):
        raise ValueError("memfit.report takes a model returned by memfit.fit or a memfit.backend")
    return planner.report()
