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

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.hardware import Hardware
from memfit.core.plan import Plan
from memfit.core.timeline import Timeline
from memfit.core.units import Budget, format_bytes
from memfit.graph.capture import DECOMPOSE
from memfit.graph.joint import as_captured, elide_clones, record_scopes, split
from memfit.graph.rewrite import rewrite
from memfit.planning import BudgetWarning, Planned, analyzed, plan_step, resolve_hardware
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
    resident_bytes: int = 0  # model and optimizer bytes (reserved state included) it planned for
    saved_bytes: int = 0  # device bytes its forward saves for its backward
    open_forwards: int = 0  # forwards run whose backward has not run yet (their saves are alive)

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
        self.optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer else []
        self.model = model
        self.params = dict(params)
        self.regions: list[Region] = []
        self.replans = 0  # plans made again because more stayed resident than planned for
        # set by memfit.compile's Step: its options, and the closed loop's tighter budget
        self.linearize = False
        self.fixed_plan: Plan | None = None
        self.budget_override: Budget | None = None
        self.what_ifs = False
        self.scope_prefix = ""  # where the model sits in the compiled module (Step's "model.")  # memfit.plan explains its plan: the plans at the budget x0.9, x1.1

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        device = device_of(example_inputs)
        engine = CopyEngine(device)
        if self.compiler == "inductor":
            from memfit.graph.inductor import compile_with_inductor

            return compile_with_inductor(graph_module, example_inputs, self._partition(device),
                                         engine)
        compile_module = _runner(engine, self.regions)
        return aot_autograd(fw_compiler=compile_module, bw_compiler=compile_module,
                            partition_fn=self._partition(device), decompositions=DECOMPOSE,
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
        hardware = resolve_hardware(self.hardware_spec, device)
        elide_clones(joint)
        record_scopes(joint, self.scope_prefix)
        captured = as_captured(joint, num_fwd_outputs, static_lifetime_input_indices)
        captured, graph = analyzed(captured, hardware, f"region {len(self.regions)}",
                                   self.linearize, kernel_temporaries=True)
        inside = sum(binding_bytes(node) for node, binding in
                     zip(joint.graph.find_nodes(op="placeholder"), captured.inputs, strict=True)
                     if binding.kind == "parameter")
        resident = resident_bytes(self.model, self.optimizers, device)
        # regions whose forward ran and whose backward has not hold their saved values meanwhile
        # (a model with graph breaks: the later region plans around the earlier one's saves)
        pending = sum(region.saved_bytes * region.open_forwards for region in self.regions)
        outside = max(0, resident - inside) + pending
        budget = self.budget_override or self.budget
        try:
            planned = plan_step(graph, hardware, budget, self.strategy, self.params, outside,
                                self.fixed_plan, self.what_ifs)
        except BudgetError as error:
            if not pending:
                raise
            planned = self._over_budget(graph, hardware, error, pending, outside)
        program = rewrite(captured.graph_module, graph, planned.plan)
        forward, backward = split(program, num_fwd_outputs, static_lifetime_input_indices)
        index = len(self.regions)
        forward.meta[REGION_KEY] = backward.meta[REGION_KEY] = index
        self.regions.append(Region(index, graph, planned.plan, planned.baseline,
                                   planned.predicted, planned.budget.device_bytes, outside,
                                   forward, backward, resident,
                                   saved_device_bytes(forward, num_fwd_outputs)))
        return forward, backward

    def _over_budget(self, graph: CostGraph, hardware: Hardware, error: BudgetError,
                     pending: int, outside: int) -> Planned:
        """Plan a region that only misses the budget because earlier regions (before a graph
        break) still hold their saves: at its smallest peak, with a warning, so training goes on
        exactly; planning the regions jointly is not done yet."""
        warnings.warn(
            f"memfit: a compiled region cannot fit {format_bytes(error.budget_bytes)} while the "
            f"regions before it (a graph break) hold {format_bytes(pending)} of saved values; it "
            f"runs at its smallest peak, {format_bytes(error.minimum_bytes)}. Remove the graph "
            "break (torch._dynamo.explain(model)(...) shows it) or raise the budget.",
            BudgetWarning, stacklevel=2)
        return plan_step(graph, hardware, Budget(bytes=error.minimum_bytes), self.strategy,
                         self.params, outside)

    # ---- re-planning when more stays resident ---------------------------------------------------

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state from now on (found by its first ``step``)."""
        if self.model is None or any(known is optimizer for known in self.optimizers):
            return
        mine = {id(parameter) for parameter in self.model.parameters()}
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            self.optimizers.append(optimizer)

    def stale(self, device: torch.device) -> bool:
        """Whether more bytes are resident now than the newest plans left room for: optimizer
        state that was not reserved, gradients kept across micro-batches. Only with a budget:
        without one, nothing can be over it."""
        if self.budget is None or not self.regions:
            return False
        planned = self.regions[-1].resident_bytes
        return resident_bytes(self.model, self.optimizers, device) > planned

    def report(self) -> str:
        """Per compiled region: budget, unplanned and predicted peak, what was swapped and
        recomputed (re-runs and their predicted time), and how often a plan was remade."""
        from memfit.core.recompute import planned_reruns
        from memfit.render.text import table

        if not self.regions:
            return "memfit: no region has been compiled yet (call the model once)"
        rows = []
        for region in self.regions:
            plan, graph = region.plan, region.graph
            reruns = [r for group in planned_reruns(graph, plan).values() for r in group]
            rerun_s = sum(graph.op(rerun.op).time_s for rerun in reruns)
            rows.append((region.index, len(graph.ops),
                         format_bytes(region.budget_bytes) if region.budget_bytes else "none",
                         format_bytes(region.baseline_peak_bytes),
                         format_bytes(region.predicted_peak_bytes),
                         f"{plan.strategy} ({plan.params.get('solver', plan.strategy)})",
                         len(plan.swapped), f"{len(reruns)} ({rerun_s * 1e3:.2f} ms)",
                         f"{region.predicted.step_time_s * 1e3:.2f} ms"))
        text = table(("region", "ops", "budget", "unplanned", "predicted", "strategy", "swapped",
                      "re-runs (time)", "step (simulated)"), rows)
        if self.replans:
            text += (f"\nplanned again {self.replans} time(s): more stayed resident than the "
                     "earlier plans left room for (optimizer state, kept gradients)")
        return text


REGION_KEY = "memfit_region"  # GraphModule.meta: which region a forward / backward module is


def saved_device_bytes(forward: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Device bytes of the values ``forward`` returns for its backward: not its inputs (the
    caller holds those anyway), not memfit's host copies and random states."""
    from memfit.graph.analyze import storage_key, tensors_in

    output = forward.graph.find_nodes(op="output")[0]
    sizes: dict = {}
    for node in output.args[0][num_fwd_outputs:]:
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            continue
        if node.meta.get("memfit", {}).get("kind") in ("swap_out", "rng_save"):
            continue
        for tensor in tensors_in(node.meta.get("val")):
            sizes.setdefault(storage_key(tensor), tensor.untyped_storage().nbytes())
    return sum(sizes.values())


def binding_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def _runner(engine: CopyEngine, regions: list[Region]):
    """AOTAutograd's module compiler for ``aot_eager``: the module's own generated code, boxed
    (it frees its inputs as it goes), run with the region's copy engine current; a region's
    forward opens it and its backward closes it (see ``Region.open_forwards``)."""
    from torch.fx.graph import _BoxedCodeGen

    def compile_module(module: fx.GraphModule, example_inputs) -> Any:
        index = module.meta.get(REGION_KEY)
        region = regions[index] if index is not None else None
        is_backward = any(node.meta.get("autograd_backward") for node in module.graph.nodes)
        if is_backward:
            _zeros_at_first_use(module.graph)
        module.graph.set_codegen(_BoxedCodeGen())
        module.recompile()
        forward = module.forward

        def run(args: list) -> Any:
            with active_engine(engine):
                result = forward(args)
            if region is not None:
                region.open_forwards += -1 if is_backward else 1
                region.open_forwards = max(region.open_forwards, 0)
            return result

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile_module


def _zeros_at_first_use(graph: fx.Graph) -> None:
    """Let a backward module take ``None`` for the gradient of an output nothing used: zeros of
    the traced layout are made where the gradient is first read.

    Autograd otherwise materializes these zeros before the backward starts (a Llama's unused
    key/value cache and logits: 256 KB at a peak that eager does not have, since in eager no one
    asks for them), and they live until the backward reads them, for a cached key or value in the
    last layer the backward reaches. ``memfit.fitted`` turns materialization off for its regions.
    """
    for placeholder in graph.find_nodes(op="placeholder"):
        value = placeholder.meta.get("val")
        if not placeholder.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        if not placeholder.users:
            continue
        first = min(placeholder.users, key=_position(graph).__getitem__)
        with graph.inserting_before(first):
            zeros = graph.call_function(_zeros_if_none, (placeholder, tuple(value.shape),
                                                         tuple(value.stride()), value.dtype,
                                                         value.device))
        placeholder.replace_all_uses_with(zeros, delete_user_cb=lambda user, made=zeros: user is not made)


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: index for index, node in enumerate(graph.nodes)}


def _zeros_if_none(gradient: torch.Tensor | None, shape: tuple[int, ...],
                   stride: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """``gradient``, or zeros in the layout it was traced with (what autograd would have made)."""
    if gradient is not None:
        return gradient
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


def device_of(values) -> torch.device:
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
    from memfit.strategies import resolve_budget_and_strategy

    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: use one of {COMPILERS}")
    if compiler == "inductor" and budget is not None:
        warnings.warn("memfit: compiler='inductor' is experimental: inductor fuses and reorders "
                      "the planned modules, and measured peaks above the budget were seen (a CNN "
                      "with re-runs, GPT-2 with swaps); use compiler='aot_eager' where the budget "
                      "must hold", BudgetWarning, stacklevel=2)
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    return Backend(parsed, chosen, hardware, compiler, optimizer, model, params)
