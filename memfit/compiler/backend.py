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

import contextlib
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.compiler.graph_breaks import (
    compiling_site,
    latest_regions,
    regions_ahead,
    save_at_most,
    saves_caps,
    units_ahead_cap,
    watch_recompile_limit,
)
from memfit.compiler.plan_step import BudgetWarning, Planned, analyzed, plan_step, resolve_hardware
from memfit.compiler.replanning import (
    count_eager_in_prediction,
    eager_room_needed,
    plan_again_when_stale,
)
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.data.units import Budget, format_bytes
from memfit.graph.capture import DECOMPOSE
from memfit.graph.joint import (
    as_captured,
    drop_unread_running_statistics,
    elide_clones,
    record_scopes,
    split,
)
from memfit.graph.lifetimes import (
    observe_loop,
    output_tangents,
    output_tensor_names,
    remember_outputs,
    tangents_given,
    trainable_parameter_bytes,
    with_later_gradients,
)
from memfit.graph.rewrite import rewrite
from memfit.graph.rnn import eager_lstm_kernels, run_rnn_layers_for_training, size_lstm_buffers
from memfit.graph.target import host_code, retargeted
from memfit.model.simulate import simulate
from memfit.runtime.outside import EagerWatch
from memfit.runtime.ranks import (
    agree_max,
    agree_on_eager_bytes,
    agree_on_hardware,
    agree_on_plan,
    raise_if_any_failed,
)
from memfit.runtime.region_peak import measure_region_run
from memfit.runtime.resident import (
    fsdp_in_flight_bytes,
    fsdp_unit_modules,
    local_tensor,
    resident_bytes,
)
from memfit.runtime.streams import CopyEngine, active_engine

COMPILERS = ("aot_eager", "inductor")
MAX_JOINT_ROUNDS = 2  # joint re-plans of a graph-broken model; each costs a trace of every region
MAX_EAGER_REPLANS = 3  # re-plans for what eager code holds beside the regions (it may keep growing)


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
    site: Any = None  # where Dynamo compiled it from (``compiling_site``: its code object, and
    # the module it runs for): one per region an iteration runs, which a newer plan replaces
    pending_bytes: int = 0  # saves of earlier regions (before a graph break) it planned around
    minimum_bytes: int | None = None  # its smallest peak, where it could not fit the budget
    saves_cap_bytes: int | None = None  # the most its forward may save, planned jointly
    replaced: bool = False  # a newer plan of its code replaces it (joint or resident re-plan)
    measured_forward_bytes: int | None = None  # device peak of its forward's latest measured run
    measured_backward_bytes: int | None = None  # ... and of its backward's
    measured_runs: int = 0  # runs of its modules measured so far
    measured_by: str = ""  # "allocator" or "ops" (see memfit.runtime.region_peak.run_measured)
    forward_values: tuple = field(default=(), repr=False)  # its forward's inputs and outputs,
    # weakly: those still alive when its backward runs are measured with it (the loop holds them)
    hardware: Hardware | None = None  # the profile it was planned with
    bound: Timeline | None = None  # the timeline its plan was checked with: outputs held to the
    # step's end, tangents resident from its start (``predicted`` once a backward has shown more)
    trainable_bytes: int = 0  # bytes of its parameters that get gradients
    later_gradient_bytes: int = 0  # gradients of other regions' parameters during its backward
    output_names: tuple[str | None, ...] = ()  # its graph's tensor of each user-visible output
    output_tangents: tuple[str | None, ...] = ()  # each output's tangent, if not a loss's seed
    output_storages: tuple = field(default=(), repr=False)  # weakly, of its latest forward
    saved_storages: tuple = field(default=(), repr=False)  # weakly, what its forwards saved
    backward_input_names: tuple[str, ...] = ()  # its backward module's placeholders, in order
    observed: tuple | None = None  # what the loop held and passed at its latest backward
    eager_forward_bytes: int = 0  # most bytes eager code held at its measured forwards' start
    eager_backward_bytes: int = 0  # ... and at its measured backwards' start (the loop's loss)
    planned_eager_bytes: int = 0  # eager code's bytes its plan counts, alive over all of it
    freed_output_bytes: int | None = None  # its outputs freed by its backward's start (fewest)
    eager_read: bool = False  # eager code's bytes were read at a measured backward's start
    warned_over: bool = False  # said that a measured run of its plan exceeded budget and prediction

    @property
    def predicted_peak_bytes(self) -> int:
        """The whole device's predicted peak while this region runs."""
        return self.predicted.peak_bytes + self.outside_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.baseline.peak_bytes + self.outside_bytes

    @property
    def measured_peak_bytes(self) -> int | None:
        """The whole device's measured peak over the latest measured forward and backward."""
        measured = [b for b in (self.measured_forward_bytes, self.measured_backward_bytes)
                    if b is not None]
        return max(measured) if measured else None


class Backend:
    """A ``torch.compile`` backend whose partitioner is memfit's planner. Build with
    ``memfit.backend``; ``regions`` lists what it planned, ``report()`` shows it."""

    def __init__(self, budget: Budget | None, strategy: str, hardware: Hardware | str | None,
                 compiler: str, optimizer: torch.optim.Optimizer | None,
                 model: torch.nn.Module | None, params: Mapping[str, Any],
                 measure_runs: int = 2) -> None:
        self.budget = budget
        self.strategy = strategy
        self.hardware_spec = hardware
        self.compiler = compiler
        self.optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer else []
        self.model = model
        self.params = dict(params)
        self.regions: list[Region] = []
        self.replans = 0  # plans made again because more stayed resident than planned for
        self.measure_runs = measure_runs  # forward+backward runs measured per region
        self.warn_over_prediction = True  # off where a closed loop re-plans (memfit.compile)
        self.saves_caps: dict[Any, int] = {}  # site -> most bytes its forward may save
        self.joint_rounds = 0  # times the regions were planned again jointly
        self.joint_failed = False  # planning jointly could not make a region fit (said once)
        self.eager_codes: list[str] = []  # code Dynamo stopped compiling (its recompile limit)
        self.eager_held: dict[Any, int] = {}  # site -> eager code's bytes its plan counts
        self.eager_replans = 0  # times regions were planned again for what eager code held
        self.eager_gave_up = False  # eager code held more each time: no longer planned for
        self._eager_watch: EagerWatch | None = None  # on a CPU, over the measured iterations
        self.device: torch.device | None = None  # of the latest region compiled
        self._parameters: list[torch.Tensor] | None = None  # the model's and optimizers'
        self._resident_counted: tuple[Any, int] | None = None  # (what it depends on, bytes)
        watch_recompile_limit(self)
        # set by memfit.compile's Step: its options, and the closed loop's tighter budget
        self.linearize = False
        self.fixed_plan: Plan | None = None
        self.budget_override: Budget | None = None
        self.what_ifs = False  # memfit.plan explains its plan: the plans at the budget x0.9, x1.1
        self.scope_prefix = ""  # where the model sits in the compiled module (Step's "model.")
        # the buffers this machine's kernels allocate inside one op (memfit/graph/temporaries.py):
        # counted for a step that runs here; memfit.plan for another device's profile leaves
        # this CPU's oneDNN scratch out
        self.kernel_temporaries = True
        # set by memfit.plan (memfit.compiler.traced): trace the step as the profile's device runs it
        # (memfit.graph.target), with the target's autocast dtype; never for a step that runs
        self.retarget = False
        self.autocast: torch.dtype | None = None

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list) -> Any:
        device = device_of(example_inputs)
        site = compiling_site()
        first = len(self.regions)
        compiled = self.compile_region(graph_module, example_inputs, device, site)
        if len(self.regions) == first:  # no joint graph (an inference region): nothing planned
            return compiled
        return plan_again_when_stale(self, graph_module, device, site, compiled,
                                     self.regions[first:])

    def compile_region(self, graph_module: fx.GraphModule, example_inputs: list,
                       device: torch.device, site: Any) -> Any:
        """The region compiled with memfit as its partitioner (``plan_region``): by Dynamo's
        call, and again by ``memfit.compiler.replanning`` to plan it anew, from the same graph."""
        self._parameters = self._resident_counted = None  # count what is resident afresh
        self.device = device
        with self._target(device):
            return self._compile_region(graph_module, example_inputs, device, site)

    def _target(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The capture personality of a planning-only trace (``memfit.graph.target``)."""
        if not self.retarget:
            return contextlib.nullcontext()
        return retargeted(resolve_hardware(self.hardware_spec, device), device, self.autocast)

    def _compile_region(self, graph_module: fx.GraphModule, example_inputs: list,
                        device: torch.device, site: Any) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        engine = CopyEngine(device)
        if self.compiler == "inductor":
            from memfit.graph.inductor import compile_with_inductor

            if device.type != "cpu" and self.budget is not None:
                warnings.warn(
                    f"memfit: compiler='inductor' on {device.type} is experimental: inductor may "
                    "fuse a reader of a swapped-in tensor into a kernel before the wait for its "
                    "copy (checked on the CPU only, where copies are synchronous); use "
                    "compiler='aot_eager' for plans with swaps", BudgetWarning, stacklevel=2)

            return compile_with_inductor(graph_module, example_inputs,
                                         self._partition(device, site), engine,
                                         _inductor_runner(engine, self))
        compile_module = _runner(engine, self)
        with eager_lstm_kernels():  # nn.LSTM traced as eager runs it (memfit.graph.rnn)
            return aot_autograd(fw_compiler=compile_module, bw_compiler=compile_module,
                                partition_fn=self._partition(device, site),
                                decompositions=DECOMPOSE,
                                keep_inference_input_mutations=True)(graph_module, example_inputs)

    def _partition(self, device: torch.device, site: Any):
        def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None, **_):
            with host_code():  # planning is memfit's code, not the target's step
                return self.plan_region(joint, device, num_fwd_outputs,
                                        static_lifetime_input_indices, site)

        return partition

    def plan_region(self, joint: fx.GraphModule, device: torch.device, num_fwd_outputs: int,
                    static_lifetime_input_indices: list[int] | None, site: Any = None
                    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Plan one region's joint graph and split the rewritten program into its two modules;
        ``site`` is where Dynamo compiled the region from (see ``Region.site``).

        Raises:
            BudgetError: if no plan of the strategy fits, before anything runs.
        """
        measured = self.hardware_spec is None and device.type not in ("cpu", "meta")
        hardware = agree_on_hardware(resolve_hardware(self.hardware_spec, device), measured)
        elide_clones(joint)
        drop_unread_running_statistics(joint)
        record_scopes(joint, self.scope_prefix)
        size_lstm_buffers(joint.graph, num_fwd_outputs)
        captured = as_captured(joint, num_fwd_outputs, static_lifetime_input_indices)
        index = len(self.regions)
        owners: dict = {}
        captured, graph = analyzed(captured, hardware, f"region {index}", self.linearize,
                                   kernel_temporaries=self.kernel_temporaries,
                                   owners=owners)
        inside = sum(binding_bytes(node) for node, binding in
                     zip(joint.graph.find_nodes(op="placeholder"), captured.inputs, strict=True)
                     if binding.kind == "parameter")
        trainable = trainable_parameter_bytes(joint, num_fwd_outputs, captured.inputs)
        later = self._later_gradient_bytes(device, trainable)
        eager = self.eager_held.get(site, 0)  # seen held by eager code beside it
        resident = resident_bytes(self.model, self.optimizers, device)
        gathered = fsdp_in_flight_bytes(self.model, device)  # FSDP2's all-gathered parameters
        # regions whose forward ran and whose backward has not hold their saved values meanwhile
        # (a model with graph breaks: the later region plans around the earlier one's saves)
        pending = sum(region.saved_bytes * region.open_forwards for region in self.regions)
        # the rank holding most (uneven shards) plans for every rank (memfit.runtime.ranks)
        later, eager, resident, pending, gathered = agree_max(
            [later, eager, resident, pending, gathered])
        graph = with_later_gradients(graph, later)
        # the region's parameters are among the resident or, under FSDP2, the gathered bytes
        outside = max(0, resident + gathered - inside) + pending + eager

        def lower(plan: Plan) -> tuple[fx.GraphModule, fx.GraphModule, int]:
            forward, backward = split(rewrite(captured.graph_module, graph, plan),
                                      num_fwd_outputs, static_lifetime_input_indices)
            return forward, backward, saved_device_bytes(forward, num_fwd_outputs)

        try:
            planned, budget_bytes, minimum = self._choose(graph, hardware, outside, pending,
                                                          eager)
        except BudgetError as error:
            raise_if_any_failed(error)  # on every rank, so that none waits in a collective
        raise_if_any_failed(None)
        made, predicted = planned.plan, planned.predicted
        forward, backward, saved = lower(made)
        cap = self.saves_caps.get(site)
        if cap is None and minimum is None and budget_bytes is not None:
            cap = self._units_ahead_cap(site, budget_bytes - outside, predicted.peak_bytes - saved)
        if cap is not None and budget_bytes is not None and saved > cap:
            made, (forward, backward, saved) = self._save_at_most(cap, graph, hardware, outside,
                                                                  budget_bytes, lower)
            predicted = simulate(graph, made, hardware)
        made, from_rank_0 = agree_on_plan(made)
        if from_rank_0:  # this rank chose otherwise from the same numbers: rank 0's plan runs
            forward, backward, saved = lower(made)
            predicted = simulate(graph, made, hardware)
        forward.meta[REGION_KEY] = backward.meta[REGION_KEY] = index
        self.regions.append(Region(index, graph, made, planned.baseline, predicted,
                                   budget_bytes, outside, forward, backward, resident, saved,
                                   site=site, pending_bytes=pending, minimum_bytes=minimum,
                                   saves_cap_bytes=cap, hardware=hardware, bound=predicted,
                                   trainable_bytes=trainable, later_gradient_bytes=later,
                                   output_names=output_tensor_names(joint, num_fwd_outputs,
                                                                    owners),
                                   output_tangents=output_tangents(joint, num_fwd_outputs),
                                   planned_eager_bytes=eager))
        return forward, backward

    def _later_gradient_bytes(self, device: torch.device, trainable: int) -> int:
        """Gradients that exist while this region's backward runs though its graph does not
        make them: those of the model's other trainable parameters, except the parameters of
        regions whose forward ran before this one in this iteration (still open: their backward
        comes after this one's). Parameters of regions later in the forward and of eager code
        after a graph break get their ``.grad`` first. Gradients that exist already (kept across
        micro-batches) are resident, counted in ``outside``."""
        if self.model is None:
            return 0
        local = [local_tensor(p).untyped_storage() for p in self.model.parameters()
                 if p.requires_grad and p.grad is None and p.device == device]
        without_grad = {StorageWeakRef(storage): storage.nbytes() for storage in local}
        earlier = sum(region.trainable_bytes for region in self.regions
                      if region.open_forwards and not region.replaced)
        return max(0, sum(without_grad.values()) - trainable - earlier)

    def _choose(self, graph: CostGraph, hardware: Hardware, outside: int, pending: int,
                eager: int = 0) -> tuple[Planned, int | None, int | None]:
        """The strategy's plan under the budget, the whole-device budget, and the region's
        smallest peak where it only misses the budget because of ``pending`` saves of earlier
        regions (``None`` where it fits). ``eager``: bytes eager code holds beside it, named in
        the error where no plan fits."""
        budget = self.budget_override or self.budget
        try:
            planned = plan_step(graph, hardware, budget, self.strategy, self.params, outside,
                                self.fixed_plan, self.what_ifs)
        except BudgetError as error:
            if not pending:
                raise with_eager_note(error, eager) from None
            planned = self._over_budget(graph, hardware, error, pending, outside)
            return planned, error.budget_bytes, error.minimum_bytes
        return planned, planned.budget.device_bytes, None

    def _over_budget(self, graph: CostGraph, hardware: Hardware, error: BudgetError,
                     pending: int, outside: int) -> Planned:
        """Plan a region that only misses the budget because earlier regions (before a graph
        break) still hold their saves: at its smallest peak, with a warning, so training goes on
        exactly; after this iteration the regions are planned again jointly (``graph_breaks``)."""
        again = ("memfit plans the regions again jointly after this iteration"
                 if self.joint_rounds < MAX_JOINT_ROUNDS else
                 "planning the regions jointly did not make it fit")
        warnings.warn(
            f"memfit: a compiled region cannot fit {format_bytes(error.budget_bytes)} while the "
            f"regions before it (a graph break) hold {format_bytes(pending)} of saved values; it "
            f"runs at its smallest peak, {format_bytes(error.minimum_bytes)}, and {again}. "
            "Remove the graph break (torch._dynamo.explain(model)(...) shows it) or raise the "
            "budget.", BudgetWarning, stacklevel=2)
        return plan_step(graph, hardware, Budget(bytes=error.minimum_bytes), self.strategy,
                         self.params, outside)

    def _units_ahead_cap(self, site: Any, room_bytes: int, transient_bytes: int) -> int | None:
        """The most an FSDP2 unit's region may save so that the units after it in this iteration
        fit beside its saves (``units_ahead_cap``); ``None`` for other regions. Without it the
        first units, planned before the later ones exist, kept what the last could not fit
        beside (GPT-2, 4 blocks, 2 ranks, at 0.5: 18,577,732 B at 15,698,588 B in the first
        iteration). Every rank counts the same units and open regions."""
        units = [id(unit) for unit in fsdp_unit_modules(self.model)]
        open_owners = {region.site[1] for region in self.regions
                       if region.open_forwards and isinstance(region.site, tuple)}
        ahead = regions_ahead(units, site, open_owners) if units else None
        return None if ahead is None else units_ahead_cap(room_bytes, transient_bytes, ahead)

    def _save_at_most(self, cap_bytes: int, graph: CostGraph, hardware: Hardware, outside: int,
                      budget_bytes: int, lower: Any) -> tuple[Plan, Any]:
        """A plan of this region whose forward saves at most ``cap_bytes`` (``save_at_most``)."""
        def plan_at(at_bytes: int) -> Plan:
            return plan_step(graph, hardware, Budget(bytes=at_bytes), self.strategy, self.params,
                             outside).plan

        return save_at_most(plan_at, lower, cap_bytes, budget_bytes)

    # ---- planning the regions of a graph-broken model jointly -----------------------------------

    def iteration_closed(self) -> None:
        """After a backward: once no region is open (the iteration's backward is done), plan
        again the regions whose plans left no room for what eager code held beside them
        (``make_room_for_eager``); if a region could not fit because of earlier regions' saves,
        cap those saves and plan every region again, so the next iteration fits (see
        ``memfit.compiler.graph_breaks``)."""
        current = latest_regions(self.regions)
        if any(region.open_forwards for region in current):
            return
        agree_on_eager_bytes(current)
        grown = self.make_room_for_eager(current)
        if self.joint_failed:
            return
        short = [region for region in current if region.minimum_bytes is not None]
        if not short:
            return
        caps = saves_caps(current, grown)
        if self.joint_rounds >= MAX_JOINT_ROUNDS or all(
                self.saves_caps.get(site) == cap for site, cap in caps.items()):
            self._joint_failed(short[0])  # nothing new to plan for: no caps, or the same again
            return
        self.joint_rounds += 1
        self.saves_caps.update(caps)
        self.replan_regions()

    def _joint_failed(self, short: Region) -> None:
        """Say once that planning jointly cannot make ``short`` fit: it keeps running at its
        smallest peak, over the budget, on every iteration."""
        self.joint_failed = True
        alone = (short.minimum_bytes or 0) - short.pending_bytes
        why = (f"it needs {format_bytes(alone)} even without the saves of the regions before its "
               "graph break" if alone > (short.budget_bytes or 0) else
               f"the regions before its graph break cannot save less than the "
               f"{format_bytes(short.pending_bytes)} it ran beside")
        warnings.warn(
            f"memfit: planning the regions jointly cannot fit region {short.index} in "
            f"{format_bytes(short.budget_bytes or 0)}: {why}; every iteration runs over the "
            "budget. Raise the budget or remove the graph break (torch._dynamo.explain(model)"
            "(...) shows it).", BudgetWarning, stacklevel=2)

    def replan_regions(self) -> None:
        """Have every current region planned again before its next run (each region's callable,
        ``memfit.compiler.replanning``, does it without Dynamo tracing anything again)."""
        for region in latest_regions(self.regions):
            region.replaced = True

    # ---- memory eager code holds while a region runs ---------------------------------------------

    def make_room_for_eager(self, current: list[Region]) -> dict[int, int]:
        """Have the regions whose plans left no room for the bytes eager code was seen to hold
        at their start planned again with them (``memfit.compiler.replanning.eager_room_needed``); after
        ``MAX_EAGER_REPLANS`` rounds, say once that eager code keeps holding more. A region
        already at its smallest peak beside earlier regions' saves is not planned again for
        them (the same plan would come back): its next plan, joint or not, counts them.

        Returns:
            region index -> the bytes its next plan counts beyond this one's (joint planning
            leaves the regions before a graph break that much less room).
        """
        if not self.watching_eager():
            watch = self.eager_watch()
            if watch is not None:
                watch.recording = False  # off the stack after the next step or model call
        count_eager_in_prediction(current)
        needed = eager_room_needed(current)
        if not needed or self.eager_gave_up:
            return {}
        if self.eager_replans >= MAX_EAGER_REPLANS:
            self.eager_gave_up = True
            warnings.warn(
                f"memfit: eager code outside the compiled regions held more after each of "
                f"{MAX_EAGER_REPLANS} re-plans (a list of losses that keeps their buffers?); it "
                "is no longer planned for, so the budget may not hold. Keep `loss.item()` rather "
                "than the loss, or compute the loss inside the model.", BudgetWarning,
                stacklevel=2)
            return {}
        for region, held in needed:
            self.eager_held[region.site] = held  # its site's next plan counts them
        fitting = [region for region, _ in needed if region.minimum_bytes is None]
        if fitting:  # a short region runs at its smallest peak: only joint planning helps it
            self.eager_replans += 1
            for region in fitting:
                region.replaced = True
        return {region.index: held - region.planned_eager_bytes for region, held in needed}

    def watching_eager(self) -> bool:
        """Whether what eager code holds is still watched: over the iterations whose region
        runs are measured (from the first call on, ``watch_first_call``), until planning for it
        gave up. Without a budget too: nothing is planned again, but a region's predicted peak
        is the whole device's, and the loop's loss and target are on the device beside it
        (``count_eager_in_prediction``)."""
        return (not self.eager_gave_up and self.measure_runs > 0
                and (not self.regions or any(
                    region.measured_runs < 2 * self.measure_runs
                    for region in latest_regions(self.regions))))

    def eager_watch(self) -> EagerWatch | None:
        """This thread's ``EagerWatch`` (a CPU's), if one is on."""
        watch = self._eager_watch
        return watch if watch is not None and watch.thread == threading.get_ident() else None

    def watch_eager(self) -> None:
        """After the compiled model returns on a CPU, while runs are measured: watch the eager
        code that follows (the loop's loss and its backward, the optimizer, code at the graph
        breaks of the next call) until runs are no longer measured. ``memfit.fit``'s module
        calls it around the model's call: a mode pushed or popped inside Dynamo's compiled call
        is undone by its dispatch-key guard when the call returns."""
        device = self.device
        if device is None or device.type != "cpu" or not self.watching_eager():
            return
        if self._eager_watch is None:
            self._eager_watch = EagerWatch(device)
        watch = self.eager_watch()
        if watch is not None:
            watch.recording = True
            watch.start()

    def watch_first_call(self, model: torch.nn.Module) -> None:
        """Before the compiled model's first call, on a CPU: watch it already, so that what eager
        code makes in the first forward (code at graph breaks: an embedding before FSDP2's first
        block, the blocks' inputs that their backward reads) is read at the regions' runs of the
        first iteration, and the plans made after it count it (measured on GPT-2 under FSDP2,
        2 ranks: without it, the last block's plan after the first iteration counted 68,872 B
        of eager code where 505,344 B were held at its forward's start, and the second and third
        iterations ran 45,756 B over the budget, 15,844,312 B at 15,798,556 B)."""
        if self.regions or self.device is not None:
            return
        device = next((local_tensor(p).device for p in model.parameters()), None)
        if device is not None and device.type == "cpu":
            self.device = device
            self.watch_eager()

    def end_eager_watch(self) -> None:
        """Before the compiled model's call: the watch off the mode stack and dropped once no
        run is measured any more."""
        watch = self.eager_watch()
        if watch is None or self.watching_eager():
            return
        watch.stop()
        if not watch.on_stack():
            self._eager_watch = None

    def eager_watch_off(self) -> contextlib.AbstractContextManager:
        """No watch on the mode stack inside the block (memfit's own tracing of a region, which
        Dynamo does not do for it), balanced, so Dynamo's guard sees the stack it saved."""
        from torch.utils._python_dispatch import _pop_mode_temporarily

        watch = self.eager_watch()
        if watch is None or not watch.on_stack():
            return contextlib.nullcontext()
        return _pop_mode_temporarily()

    def recompile_limit_hit(self, where: str) -> None:
        """Dynamo stopped compiling ``where`` for this backend (its recompile limit): that code
        now runs eagerly, outside any plan; say so once."""
        if self.eager_codes:
            return
        self.eager_codes.append(where)
        warnings.warn(
            f"memfit: Dynamo hit its recompile limit on {where}; that code now runs eagerly, "
            "outside any plan, so the budget no longer holds. Raise "
            "torch._dynamo.config.recompile_limit or remove what makes it recompile "
            '(TORCH_LOGS="recompiles" shows why).', BudgetWarning, stacklevel=2)

    # ---- re-planning when more stays resident ---------------------------------------------------

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state from now on (found by its first ``step``)."""
        if self.model is None or any(known is optimizer for known in self.optimizers):
            return
        mine = {id(parameter) for parameter in self.model.parameters()}
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            self.optimizers.append(optimizer)
            self._parameters = None

    def stale(self, device: torch.device, planned_bytes: int) -> bool:
        """Whether more bytes are resident now than a plan made for ``planned_bytes`` left room
        for: optimizer state that was not reserved, gradients kept across micro-batches. Only
        with a budget: without one, nothing can be over it."""
        if self.budget is None:
            return False
        return self._resident_now(device) > planned_bytes

    def _resident_now(self, device: torch.device) -> int:
        """``resident_bytes`` of the model and optimizers, counted again only when what can
        change between calls did: which parameters have a gradient, the optimizers' state
        entries and groups (counting walks every module and storage: ~0.9 ms per call for a
        2-layer BERT, which each region's run would pay). A new parameter or buffer shape is a
        new Dynamo trace, which compiles a region and counts afresh."""
        parameters = self._parameters
        if parameters is None:
            model = list(self.model.parameters()) if self.model is not None else []
            parameters = self._parameters = model + [p for optimizer in self.optimizers
                                                     for g in optimizer.param_groups
                                                     for p in g["params"]]
        key = (device, len(self.optimizers), tuple(p.grad is None for p in parameters),
               tuple((len(o.param_groups), len(o.state)) for o in self.optimizers))
        if self._resident_counted is None or self._resident_counted[0] != key:
            counted = resident_bytes(self.model, self.optimizers, device)
            self._resident_counted = (key, agree_max([counted])[0])  # as plan_region counts
        return self._resident_counted[1]

    def must_plan_again(self, regions: list[Region], device: torch.device) -> bool:
        """Whether the compiled region whose plans are ``regions`` is planned again before it
        runs: a newer plan was asked for (``replan_regions``), or more is resident than its plan
        left room for, which asks for a newer plan of every current region (``replans``)."""
        if any(region.replaced for region in regions):
            return True
        if not self.stale(device, min(region.resident_bytes for region in regions)):
            return False
        self.replans += 1
        self.replan_regions()
        for region in regions:  # a region of another shape of the same code is not "current"
            region.replaced = True
        return True

    def report(self) -> str:
        """Per compiled region: budget, unplanned, predicted and measured peak (and the gap),
        what was swapped and recomputed; then how often plans were remade, and which code ran
        outside any plan (``memfit.render.regions``)."""
        from memfit.render.regions import regions_report

        return regions_report(self)


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


def with_eager_note(error: BudgetError, eager_bytes: int) -> BudgetError:
    """``error``, saying that ``eager_bytes`` of the peak are eager code's (where any are)."""
    if not eager_bytes:
        return error
    note = (f"{format_bytes(eager_bytes)} of it is held by eager code outside the compiled "
            "regions while this one runs (the loss computed in the loop and its buffers, code at "
            "a graph break; memfit.report shows where): compute the loss inside the model, or "
            "raise the budget.")
    return BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant, error.strategy,
                       f"{error.note} {note}".strip(), host_bytes=error.host_bytes)


def binding_bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def _runner(engine: CopyEngine, planner: Backend):
    """AOTAutograd's module compiler for ``aot_eager``: the module's own generated code, boxed
    (it frees its inputs as it goes), run with the region's copy engine current; a region's
    forward opens it and its backward closes it (see ``Region.open_forwards``). The first
    ``planner.measure_runs`` runs of each region's modules are measured (``run_measured``)."""
    from torch.fx.graph import _BoxedCodeGen

    def compile_module(module: fx.GraphModule, example_inputs) -> Any:
        index = module.meta.get(REGION_KEY)
        region = planner.regions[index] if index is not None else None
        is_backward = any(node.meta.get("autograd_backward") for node in module.graph.nodes)
        if is_backward:
            _zeros_at_first_use(module.graph)
        if region is not None:  # a training region's module: eager runs under autograd
            run_rnn_layers_for_training(module.graph)
            if is_backward:
                region.backward_input_names = tuple(
                    node.name for node in module.graph.find_nodes(op="placeholder"))
        module.graph.set_codegen(_BoxedCodeGen())
        module.recompile()
        return _region_run(planner, region, is_backward, module.forward, engine)

    return compile_module


def _inductor_runner(engine: CopyEngine, planner: Backend):
    """What wraps each module inductor compiled for a region (``compile_with_inductor``): the
    same runs as ``aot_eager``'s (``_region_run``: measured first runs, the eager code beside
    them read and planned for, open forwards, the iteration closed), without re-simulating the
    plan with the loop's lifetimes (inductor's kernels are bounded by the plan, not predicted
    from them). Before, inductor regions ran none of it: a loss outside the model was never
    planned for (``examples.unet3d()``'s CPU ``mse_loss`` buffer: auto at 8,198,548 B measured
    8,508,468 B every iteration, 524,292 B above its prediction)."""

    def wrap(module: fx.GraphModule, compiled: Callable[[list], Any], is_backward: bool) -> Any:
        index = module.meta.get(REGION_KEY)
        region = planner.regions[index] if index is not None else None
        return _region_run(planner, region, is_backward, compiled, engine, follow_loop=False)

    return wrap


def _region_run(planner: Backend, region: Region | None, is_backward: bool,
                forward: Callable[[list], Any], engine: CopyEngine, follow_loop: bool = True):
    """``forward`` (a region's compiled forward or backward, boxed) run with the region's copy
    engine current and the eager watch paused; its first ``planner.measure_runs`` runs measured
    (``measure_region_run``); a forward opens the region and its backward closes it (see
    ``Region.open_forwards``), then ``planner.iteration_closed``. ``follow_loop``: re-simulate
    the plan with the outputs the loop held and the tangents it passed (``observe_loop``)."""

    def run(args: list) -> Any:
        given = (tangents_given(region, args)
                 if follow_loop and region is not None and is_backward else ())
        watch = planner.eager_watch()
        with active_engine(engine), watch.paused() if watch else contextlib.nullcontext():
            if region is not None and region.measured_runs < 2 * planner.measure_runs:
                result = measure_region_run(planner, region, forward, args, is_backward)
                if planner.warn_over_prediction:
                    _warn_if_over_its_prediction(region)
            else:
                result = forward(args)
        if region is not None:
            if not is_backward:
                remember_outputs(region, result)
            elif follow_loop:
                observe_loop(region, given)
            region.open_forwards += -1 if is_backward else 1
            region.open_forwards = max(region.open_forwards, 0)
            if is_backward:
                planner.iteration_closed()
        return result

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


OVER_PREDICTION_FRACTION = 0.01  # the memory model's stated accuracy (issue 12: within 1%)


def _warn_if_over_its_prediction(region: Region) -> None:
    """Say once when a measured run of ``region``'s plan, eager code's bytes set aside (a re-plan
    makes room for those), is over both its budget and its prediction by more than the model's
    accuracy: the plan does not do what the planner simulated, and no re-plan will fix that.

    Why: measured on GPT-2 (4 layers, width 128, batch 8) at 0.3 of eager's peak with
    ``compiler="inductor"``: auto's ``vdnn_dyn`` plan predicted 69.82 MiB and measured 193.57
    MiB against a 71.11 MiB budget (with aot_eager, and with ``vdnn_all`` under inductor, the
    plans measure within it). The step's gradients are right; its memory is not what was asked.
    """
    measured = region.measured_peak_bytes
    if region.warned_over or measured is None or region.budget_bytes is None:
        return
    own = measured - max(region.eager_forward_bytes, region.eager_backward_bytes)
    limit = (1 + OVER_PREDICTION_FRACTION) * region.predicted_peak_bytes
    if own <= region.budget_bytes or own <= limit:
        return
    region.warned_over = True
    warnings.warn(
        f"memfit: region {region.index} measured {format_bytes(measured)} against its budget "
        f"{format_bytes(region.budget_bytes)} and its predicted peak "
        f"{format_bytes(region.predicted_peak_bytes)} (strategy {region.plan.strategy}, "
        f"{region.plan.params.get('solver', '')}): this plan does not run as simulated. Try "
        "compiler='aot_eager' or another strategy; memfit.report(model) shows the gap.",
        BudgetWarning, stacklevel=3)


def _zeros_at_first_use(graph: fx.Graph) -> None:
    """Let a backward module take ``None`` for the gradient of an output nothing used: zeros of
    the traced layout are made where the gradient is first read.

    Autograd otherwise materializes these zeros before the backward starts (a Llama's unused
    key/value cache and logits: 256 KB at a peak that eager does not have, since in eager no one
    asks for them), and they live until the backward reads them, for a cached key or value in the
    last layer the backward reaches. ``memfit.compiler.fitted`` turns materialization off for its regions.
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
            model: torch.nn.Module | None = None, measure_runs: int = 2,
            **params: Any) -> Backend:
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
        measure_runs: how many forward and backward runs of each planned region are measured
            for ``report``'s measured column (the first ones after each plan; 2 covers the first
            iteration, whose optimizer state is only reserved, and one with it real). A measured
            run starts a profiler (on a CPU) or a dispatch mode, which costs time, so not every
            run is measured; 0 turns measuring off, a large number measures every run. The
            bytes eager code holds beside a region are read on these runs only.
        **params: the strategy's parameters.

    Raises:
        ValueError: for a malformed budget, an unknown strategy, parameter or compiler.
        BudgetError: when a region is compiled or planned again and no plan fits.

    Note:
        What is planned again, and when: before each run of a training region, if more device
        bytes are resident than its plan left room for, every current region is planned again
        from the graph Dynamo captured (``memfit.compiler.replanning``); Dynamo traces nothing again.
        "Resident" is what this backend knows of: ``model``'s parameters, gradients and buffers
        and ``optimizer``'s parameters, gradients and state. So used directly in
        ``torch.compile`` without ``model=`` and ``optimizer=``, nothing resident is counted:
        optimizer state and gradients kept across micro-batches are planned for by no one, and
        the budget covers the regions' own tensors only. With ``optimizer=`` but no ``model=``,
        its parameters' gradients and state count; an optimizer it was not given is not found
        (``memfit.fit`` finds it by its first ``step``). Graph-broken regions are planned
        jointly after the first iteration either way. Dynamo's own guards (a frozen layer, a
        new shape) trace and plan anew as ``torch.compile`` does. Bytes eager code holds while
        a region runs (a loss computed in the loop, code at a graph break) are read at its
        measured runs' start (``memfit.runtime.outside``: on CUDA from the allocator; on a CPU
        only under ``memfit.fit``, whose module watches the eager code) and a region whose plan
        had no room for them is planned again with them, before its next run.

    Example:
        >>> compiled = torch.compile(model, backend=memfit.backend(budget=0.5), dynamic=False)
    """
    from memfit.planning.strategies import resolve_budget_and_strategy

    if measure_runs < 0:
        raise ValueError(f"measure_runs must be 0 or more, got {measure_runs}")
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: use one of {COMPILERS}")
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    return Backend(parsed, chosen, hardware, compiler, optimizer, model, params, measure_runs)
