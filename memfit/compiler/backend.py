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
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from memfit.compiler import partitioner
from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.dropped_gradients import GradientsSeen
from memfit.compiler.eager_watching import EagerWatching
from memfit.compiler.graph_breaks import (
    compiling_site,
    graph_break_counts,
    graph_break_follows,
    graph_breaks_since,
    latest_regions,
    site_code,
    watch_recompile_limit,
)
from memfit.compiler.joint_planning import MAX_JOINT_ROUNDS, JointPlanning
from memfit.compiler.loop_lifetimes import planned_for_the_loop
from memfit.compiler.partners import partners_of
from memfit.compiler.region import Region, timed_planning
from memfit.compiler.region_run import (
    aot_eager_runner,
    inductor_runner,
    saved_tensors_not_donated,
)
from memfit.compiler.repeated_calls import call_site
from memfit.compiler.replanning import plan_again_when_stale
from memfit.compiler.shape_bound import InputSizes
from memfit.compiler.step_graph import resolve_hardware
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError, BudgetWarning
from memfit.data.hardware import Hardware
from memfit.data.units import Budget, format_bytes
from memfit.planning.step import (
    Planned,
    plan_step,
    short_even_alone,
    unplanned,
    with_eager_note,
)
from memfit.runtime.outside import EagerWatch
from memfit.runtime.ranks import agree_max, agree_on_hardware
from memfit.runtime.resident import (
    device_of,
    has_gradients,
    holds_parameters_of,
    reserved_state_bytes,
    resident_bytes,
)
from memfit.runtime.streams import CopyEngine
from memfit.tracing.capture import DECOMPOSE
from memfit.tracing.rnn import eager_lstm_kernels
from memfit.tracing.shapes import Bound
from memfit.tracing.target import host_code, retargeted

COMPILERS = ("aot_eager", "inductor")


class Backend(EagerWatching, JointPlanning):
    """A ``torch.compile`` backend whose partitioner is memfit's planner. Build with
    ``memfit.backend``; ``regions`` lists what it planned, ``report()`` shows it."""

    def __init__(self, options: BackendOptions, optimizer: torch.optim.Optimizer | None = None,
                 model: torch.nn.Module | None = None) -> None:
        self.options = options  # replaced only by choose_budget, at memfit.fit's first call
        self.graph_breaks_before = graph_break_counts()  # Dynamo's, before this backend
        # held weakly: an optimizer the loop drops (one made again each epoch) is freed with its
        # state, and no longer counted
        self._optimizers = [weakref.ref(optimizer)] if optimizer else []
        self.model = model
        self.regions: list[Region] = []
        self.replans = 0  # plans made again because more stayed resident than planned for
        self.budget_override: Budget | None = None  # a closed loop's lower one (override_budget)
        self.saves_caps: dict[Any, int] = {}  # site -> most bytes its forward may save
        # memfit.fit's backend: a first region followed by a graph break has the call traced on
        # fakes before it first runs, and the regions planned jointly (memfit.fitting.joint_first)
        self.joint_first_trace: Callable[[int], dict[Any, int]] | None = None  # trace_first_call
        self.joint_first_site: Any = None  # the first region's, until its first run
        self.joint_first_eager_bytes = 0  # eager code's bytes at its compile, for the trace
        self.joint_first_regions = 0  # regions the trace on fakes planned jointly
        self.joint_first_note = ""  # why they were not, where the trace failed
        self.joint_rounds = 0  # times the regions were planned again jointly
        self.joint_failed = False  # planning jointly could not make a region fit (said once)
        self.step_peak_bytes = 0  # the whole step's unplanned peak, once its regions are known
        self.break_sites: set[Any] = set()  # sites of regions a graph break follows
        self.provisional_now = False  # the region compiled now is planned provisionally
        self.replanned_beside_copies: set[Any] = set()  # sites, in this iteration
        self.copies_sites: set[Any] = set()  # sites planned for copies of their saves
        self.beside_evaluation: set[Any] = set()  # training sites short beside an evaluation's
        # saves, waiting for its plan under a cap (``evaluations_planned``)
        self.evaluations_capped: set[Any] = set()  # evaluation sites planned again for them
        self.copies_short_said = False  # no plan fit beside a region's copies (said once)
        self.eager_codes: list[str] = []  # code Dynamo stopped compiling (its recompile limit)
        self.limit_codes: dict[Any, str] = {}  # code object past its recompile limit -> cause
        self.forward_runs = 0  # planned region forwards run
        self.codes_run: set[Any] = set()  # codes whose planned region ran in the current call
        self.unplanned_calls: dict[str, int] = {}  # "code: cause" -> calls run outside a plan
        self.training_calls = 0  # calls of the fitted model with gradients on
        # each optimizer's ``training_calls`` at its last step (unplanned.stepped_without_a_call)
        self.calls_at_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.skip_cause = ""  # why Dynamo last ran the whole model eagerly, where it said
        self.gradients_seen: dict[int, GradientsSeen] = {}  # program -> what the loop does
        # with the gradients between its forward and backward (``Region.program``)
        self.program_now = 0  # the program being planned
        self.step_over_said = False  # said that the optimizer's step alone is over the budget
        self.eager_held: dict[Any, int] = {}  # site -> eager code's bytes its plan counts
        self.eager_gap: dict[Any, int] = {}  # site -> eager code's peak its saves leave room for
        self.gap_saves_limit: dict[Any, int] = {}  # site -> saves under a measured gap overrun
        self.eager_replans = 0  # times regions were planned again for what eager code held
        self.eager_gave_up = False  # eager code held more each time: no longer planned for
        self.eager_between_bytes = 0  # the device's most bytes between iterations, over budget
        self._eager_watch: EagerWatch | None = None  # on a CPU, over the measured iterations
        self._eager_now = 0  # eager code's bytes alive as the region compiled now is called
        self.device: torch.device | None = None  # of the latest region compiled
        self._hardware: dict[torch.device, Hardware] = {}  # device -> its profile (hardware_for)
        self.planning_s = 0.0  # seconds spent tracing and planning regions (all plans)
        self.bound_replans = 0  # plans made again for a shape past a dynamic region's bound
        # the optimizers' ids, and the model's and their parameters
        self._parameters: tuple[list[int], list[torch.Tensor]] | None = None
        self._resident_counted: tuple[Any, int] | None = None  # (what it depends on, bytes)
        watch_recompile_limit(self)
        self.budget_note = ""  # where the budget came from, when memfit chose it (report)
        self.cache_ignored: list[str] = []  # plan-cache files ignored, and why (report)
        self.retained_backward = False  # a backward kept its graph (retain_graph=True): every
        # plan made since keeps the saves a backward reads to its end (``with_retained_saves``)
        self.retained_replans = 0  # plans made again for it: over the budget with those saves

    @property
    def budget(self) -> Budget | None:
        """The whole-device budget the regions are planned under (``None``: no limit)."""
        return self.options.budget

    @property
    def strategy(self) -> str:
        """The strategy that plans each region."""
        return self.options.strategy

    @property
    def planning_budget(self) -> Budget | None:
        """The budget a region's plan is made for: a closed loop's tighter one, else ``budget``."""
        return self.budget_override or self.options.budget

    def choose_budget(self, budget: Budget | None, strategy: str, note: str) -> None:
        """Plan under ``budget`` with ``strategy`` from now on: the automatic budget
        ``memfit.fit`` chooses at its first call on CUDA, before any region is compiled;
        ``note`` says in the report where the number came from."""
        self.options = replace(self.options, budget=budget, strategy=strategy)
        self.budget_note = note

    def override_budget(self, budget: Budget | None) -> None:
        """Plan the next regions for ``budget`` (a closed loop's budget lowered by a measured
        excess, ``memfit.compiler.closed_loop``); ``None`` plans for ``budget`` again."""
        self.budget_override = budget

    def trace_first_call(self, trace: Callable[[int], dict[Any, int]] | None) -> None:
        """Have the call now starting traced on fakes by ``trace`` before its first region's
        first run (``memfit.fitting.joint_first``); ``None`` after the call, so that the
        trace, which holds the call's arguments, is dropped."""
        self.joint_first_trace = trace

    def first_call_traced(self, regions: int = 0, note: str = "") -> None:
        """Record what the trace on fakes of ``trace_first_call`` did: ``regions`` planned
        jointly, or, where it failed, ``note`` saying why (``memfit.report``)."""
        if note:
            self.joint_first_note = note
        else:
            self.joint_first_regions = regions

    def add_planning_time(self, seconds: float) -> None:
        """Count ``seconds`` of tracing and planning done for this backend's regions away from
        them (the trace on fakes of ``trace_first_call``) in ``planning_s``."""
        self.planning_s += seconds

    def hardware_for(self, device: torch.device) -> Hardware:
        """The profile every region on ``device`` is planned with: ``options.hardware``
        resolved at the first region there (``resolve_hardware``; a measured one agreed on
        across ranks, as every rank plans the same regions) and kept for the backend's life."""
        found = self._hardware.get(device)
        if found is None:
            spec = self.options.hardware
            measured = spec is None and device.type not in ("cpu", "meta")
            found = agree_on_hardware(resolve_hardware(spec, device), measured)
            self._hardware[device] = found
        return found

    def count_afresh(self, device: torch.device, eager_bytes: int) -> None:
        """Start planning a region on ``device`` beside ``eager_bytes`` of eager code: what is
        resident is counted again."""
        self._parameters = self._resident_counted = None
        self.device = device
        self._eager_now = eager_bytes

    def __reduce__(self) -> tuple:
        """A copy (``copy.deepcopy``, ``pickle``) of a fitted model's backend is the copy's own new
        backend (``memfit.fit`` sets ``BackendOptions.copy_as``): regions, plans and compiled
        code are never copied nor shared."""
        if self.options.copy_as is None:
            raise TypeError("a memfit backend holds compiled code and is not copied: copy the "
                            "model returned by memfit.fit (its copy plans afresh), or make a "
                            "new memfit.backend(...)")
        return self.options.copy_as

    def upper(self) -> str:
        """Raise at once where a framework reads the backend as a name (accelerate's
        ``TorchDynamoPlugin`` upper-cases ``TrainingArguments(torch_compile_backend=...)``)."""
        raise TypeError(
            "memfit.backend(...) is not a torch_compile_backend name: give the Trainer "
            "model=memfit.fit(model, budget=...) and leave torch_compile off (a compiled region "
            "then counts the model's parameters, gradients and optimizer state in the budget)")

    def __repr__(self) -> str:
        """What Dynamo's errors name as the backend that raised: memfit's, with its options."""
        budget = self.options.budget
        return (f"memfit (compiler {self.options.compiler!r}, strategy "
                f"{self.options.strategy!r}, budget {budget if budget is not None else 'none'})")

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list) -> Any:
        device = device_of(example_inputs)
        first = len(self.regions)
        sizes = InputSizes.of(graph_module)  # where a dynamic region's sizes are read
        bound = sizes.first_bound() if sizes else None
        site = call_site(self.regions, compiling_site(), bound)
        joint_first = (self.joint_first_trace is not None and not latest_regions(self.regions)
                       and self.budget is not None
                       and graph_break_follows(graph_module, example_inputs))
        try:
            compiled = self.compile_region(graph_module, example_inputs, device, site, bound)
        except BudgetError:  # at a maximum Dynamo's guards set: planned at the sizes seen
            if sizes is None or bound == sizes.seen_bound():
                raise
            bound = sizes.seen_bound()
            compiled = self.compile_region(graph_module, example_inputs, device, site, bound)
        if joint_first and len(self.regions) > first:  # traced on fakes before its first run
            self.joint_first_site, self.joint_first_eager_bytes = site, self._eager_now
        self.limit_codes.pop(site_code(site), None)  # compiled again: planned from here on
        if len(self.regions) == first:  # no joint graph (an inference region): nothing planned
            return compiled
        return plan_again_when_stale(self, graph_module, device, site, compiled,
                                     self.regions[first:], sizes)

    def compile_region(self, graph_module: fx.GraphModule, example_inputs: list,
                       device: torch.device, site: Any, bound: Bound | None = None,
                       eager_bytes: int | None = None) -> Any:
        """The region compiled with memfit as its partitioner (``plan_region``): by Dynamo's
        call, and again by ``memfit.compiler.replanning`` to plan it anew, from the same graph.
        ``bound``: each symbolic size at the value its plan is priced at (a dynamic region).
        ``eager_bytes``: what eager code holds beside it, where ``example_inputs`` are fakes
        that cannot tell (``None``: read beside ``example_inputs``)."""
        if eager_bytes is None:
            eager_bytes = self.eager_bytes_now(example_inputs)
        self.count_afresh(device, eager_bytes)  # alive at its start
        if graph_break_follows(graph_module, example_inputs):
            self.break_sites.add(site)
        budget = self.planning_budget
        self.provisional_now = (budget is not None and budget.fraction is not None
                                and not self.step_peak_bytes and site in self.break_sites)
        started = time.perf_counter()
        first = len(self.regions)
        self.program_now = id(graph_module)
        try:
            with self._target(device):
                compiled = self._compiled_as_gradients_go(graph_module, example_inputs, device,
                                                          site, bound)
            for region in self.regions[first:]:
                region.program = self.program_now
            self.evaluations_planned(self.regions[first:])
            return compiled
        except BaseException as error:
            if not getattr(error, "keeps_region", False):  # a planning-only trace's stop keeps it
                del self.regions[first:]  # planned, but its compile failed: it never runs
            raise
        finally:
            self.planning_s += time.perf_counter() - started

    def _compiled_as_gradients_go(self, graph_module: fx.GraphModule, example_inputs: list,
                                  device: torch.device, site: Any, bound: Bound | None) -> Any:
        """``_compile_region``; where no plan fits while the model's gradients exist and no
        backward of this code has shown what the loop does with them, planned again as if the
        loop drops them before the backward (``zero_grad()`` before ``backward()``, the order
        of PyTorch's examples), which its next backward checks: a loop that keeps them
        (accumulation) has it planned again counting them, and a measured run over the budget
        is said. Where that fails too, the first error stands. A new program of code whose
        earlier programs' backwards all showed the gradients kept (a micro-batch of another
        shape, traced again) is not planned on the guess: its error stands at once."""
        first = len(self.regions)
        try:
            return self._compile_region(graph_module, example_inputs, device, site, bound)
        except BudgetError:
            seen = self.gradients_seen.setdefault(self.program_now, GradientsSeen())
            if seen.drops is None and self._site_keeps_gradients(site):
                seen.drops = False
            if seen.drops is not None or not has_gradients(self.model):
                raise
            del self.regions[first:]
            seen.drops = True
            try:
                return self._compile_region(graph_module, example_inputs, device, site, bound)
            except BudgetError:
                seen.drops = None
                del self.regions[first:]
            raise

    def _site_keeps_gradients(self, site: Any) -> bool:
        """Whether the backwards of the other programs compiled from ``site`` showed what the
        loop does with the model's gradients, and every one showed them kept."""
        verdicts = {self.gradients_seen[region.program].drops for region in self.regions
                    if site is not None and region.site == site
                    and region.program != self.program_now
                    and region.program in self.gradients_seen}
        return verdicts == {False}

    def _target(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The capture personality of a planning-only trace (``memfit.tracing.target``)."""
        if not self.options.retarget:
            return contextlib.nullcontext()
        return retargeted(self.hardware_for(device), device, self.options.autocast)

    def _compile_region(self, graph_module: fx.GraphModule, example_inputs: list,
                        device: torch.device, site: Any, bound: Bound | None) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        engine = CopyEngine(device)
        if self.options.compiler == "inductor":
            from memfit.lowering.inductor import compile_with_inductor

            if device.type != "cpu" and self.budget is not None:
                warnings.warn(
                    f"memfit: compiler='inductor' on {device.type} is experimental: inductor may "
                    "fuse a reader of a swapped-in tensor into a kernel before the wait for its "
                    "copy (checked on the CPU only, where copies are synchronous); use "
                    "compiler='aot_eager' for plans with swaps", BudgetWarning, stacklevel=2)

            return compile_with_inductor(graph_module, example_inputs,
                                         self._partition(device, site, bound), engine,
                                         inductor_runner(engine, self))
        compile_module = aot_eager_runner(engine, self)
        # nn.LSTM traced as eager runs it (memfit.tracing.rnn); a retained graph's second backward
        with eager_lstm_kernels(), saved_tensors_not_donated():
            return aot_autograd(fw_compiler=compile_module, bw_compiler=compile_module,
                                partition_fn=self._partition(device, site, bound),
                                decompositions=DECOMPOSE,
                                keep_inference_input_mutations=True)(graph_module, example_inputs)

    def _partition(self, device: torch.device, site: Any, bound: Bound | None):
        def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None, **_):
            with host_code(), timed_planning(self):  # planning is memfit's code, not the step's
                return self.plan_region(joint, device, num_fwd_outputs,
                                        static_lifetime_input_indices, site, bound)

        return partition

    def plan_region(self, joint: fx.GraphModule, device: torch.device, num_fwd_outputs: int,
                    static_lifetime_input_indices: list[int] | None, site: Any = None,
                    bound: Bound | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Plan one region's joint graph and split the rewritten program into its two modules
        (``memfit.compiler.partitioner.plan_region``); ``site`` is where Dynamo compiled the
        region from (see ``Region.site``), ``bound`` the sizes a dynamic region is priced at.

        Raises:
            BudgetError: if no plan of the strategy fits, before anything runs.
        """
        return partitioner.plan_region(self, joint, device, num_fwd_outputs,
                                       static_lifetime_input_indices, site, bound)

    def _choose(self, graph: CostGraph, hardware: Hardware, outside: int, pending: int,
                eager: int = 0, own_open: int = 0, loop_graph: CostGraph | None = None
                ) -> tuple[Planned, int | None, int | None]:
        """The strategy's plan under the budget, the whole-device budget, and the region's
        smallest peak where it only misses the budget because of ``pending`` saves of earlier
        regions (``None`` where it fits). ``eager``: bytes eager code holds beside it, named in
        the error where no plan fits. Where no plan fits with every output held, ``loop_graph``
        (the step as a loop that keeps only its loss runs it, ``dropped_outputs_graph``) is
        planned instead; its ``Planned.graph`` is then ``loop_graph``, and where neither fits
        the error is the smaller minimum's. A region planned provisionally (``provisional_now``)
        is neither refused nor said over: ``_provisional``."""
        if self.provisional_now:
            return (*self._provisional(graph, hardware, outside), None)
        planned, error = self._plan_held_or_for_the_loop(graph, hardware, outside, loop_graph)
        if planned is not None:
            return planned, planned.budget.device_bytes, None
        assert error is not None
        try:
            breaks = graph_breaks_since(self.graph_breaks_before)
            if not pending:
                raise with_eager_note(error, eager, breaks) from None
            if error.minimum_bytes - pending > error.budget_bytes:
                raise short_even_alone(error, pending, eager, breaks) from None
            planned = self._over_budget(graph, hardware, error, pending, outside, own_open)
            return planned, error.budget_bytes, error.minimum_bytes
        finally:  # an error kept in this frame would hold, through its traceback, every frame
            del error  # of the step (the model's outputs in its caller's) until a gc

    def _plan_held_or_for_the_loop(self, graph: CostGraph, hardware: Hardware, outside: int,
                                   loop_graph: CostGraph | None,
                                   ) -> tuple[Planned | None, BudgetError | None]:
        """The strategy's plan with every output held; where none fits, ``loop_graph``'s; where
        neither does, the error with the smaller minimum (``planned_for_the_loop``)."""
        options = self.options
        try:
            return plan_step(graph, hardware, self._region_budget(graph, hardware, outside),
                             options.strategy, options.params, outside, options.fixed_plan,
                             options.what_ifs), None
        except BudgetError as held_error:
            if loop_graph is None or options.fixed_plan is not None:
                return None, held_error
            try:
                return planned_for_the_loop(loop_graph, hardware, held_error, options.strategy,
                                            options.params, outside, options.what_ifs), None
            except BudgetError as smaller:
                return None, smaller

    def _provisional(self, graph: CostGraph, hardware: Hardware, outside: int
                     ) -> tuple[Planned, int | None]:
        """A region a graph break follows, planned under a fraction before the step's unplanned
        peak is known, and the whole-device budget it fits (``None``: none). Its share of the
        fraction is of what is known so far (its own peak, for the first region), so it may be
        too small: the region is planned within it, at its smallest peak where none fits,
        without a refusal or a warning, and planned again where the step's peak, once known
        (``step_peak_found``), gives it another budget (``replans_provisional``): before its first
        run where ``memfit.fit`` traces the call on fakes, else after the first iteration
        (``JointPlanning.settle_provisional``)."""
        try:
            planned = plan_step(graph, hardware, self._region_budget(graph, hardware, outside),
                                self.strategy, self.options.params, outside)
        except BudgetError as error:
            return self._at_minimum(graph, hardware, error, outside), None
        return planned, planned.budget.device_bytes

    def replans_provisional(self, regions: list[Region]) -> bool:
        """Whether one of ``regions`` planned provisionally (``_provisional``) is planned again
        now that the step's peak is known: it was planned for another budget than that gives
        it, or for none. A provisional plan made for the budget it gets now stands, no longer
        provisional."""
        again = False
        for region in regions:
            if not region.provisional:
                continue
            assert region.hardware is not None  # every region records its profile
            now = self._region_budget(region.graph, region.hardware, region.outside_bytes)
            if region.budget_bytes is None or now is None or now.bytes != region.budget_bytes:
                again = True
            else:
                region.provisional = False
        return again

    def step_peak_found(self, peak_bytes: int) -> None:
        """The whole step's unplanned peak is known to be at least ``peak_bytes`` (its regions
        traced on fakes, or run once): a fraction budget is of it from now on."""
        self.step_peak_bytes = max(self.step_peak_bytes, peak_bytes)

    def _region_budget(self, graph: CostGraph, hardware: Hardware, outside: int
                       ) -> Budget | None:
        """The budget a region is planned for: ``planning_budget``, where a fraction is of the
        step's unplanned peak. A step of several regions (graph breaks) peaks in one of them, so
        the fraction is of the highest unplanned whole-device peak among this region's, the
        current regions' and the step's once known (``step_peak_bytes``, as ``memfit.plan``
        resolves it): of its own, a region that holds little (a first layer before a logger
        call, transformers' loss after one) would get a sliver of the device."""
        budget = self.planning_budget
        others = [region.baseline_peak_bytes for region in latest_regions(self.regions)]
        others += [self.step_peak_bytes] if self.step_peak_bytes else []
        if budget is None or budget.fraction is None or not others:
            return budget
        own = unplanned(graph, hardware).peak_bytes + outside
        return Budget(bytes=budget.to_bytes(max(own, *others)))

    def _over_budget(self, graph: CostGraph, hardware: Hardware, error: BudgetError,
                     pending: int, outside: int, own_open: int = 0) -> Planned:
        """Plan a region that only misses the budget because earlier regions (before a graph
        break), or its own earlier forwards (``own_open`` bytes of ``pending``: the model called
        again before its backward), still hold their saves: at its smallest peak, with a
        warning, so training goes on exactly; after this iteration the regions are planned again
        jointly (``memfit.compiler.joint_planning``). No warning where this iteration fits
        without the optimizer state the plan reserves but no step has made yet (an optimizer
        found at the first call: its state appears at its step, after the backward)."""
        if error.minimum_bytes - self.state_to_come_bytes() <= error.budget_bytes:
            return self._at_minimum(graph, hardware, error, outside)
        again = ("memfit plans the regions again jointly after this iteration"
                 if self.joint_rounds < MAX_JOINT_ROUNDS else
                 "planning the regions jointly did not make it fit")
        others = ("other compiled code's open forwards (the regions before a graph break, the "
                  "model's call earlier in the step with other arguments, or an evaluation run "
                  "with gradients on whose output the loop still holds, which memfit plans "
                  "again to save less before its next run)")
        holders = ("its own earlier forwards, whose backward has not run yet," if own_open >= pending
                   else f"{others} and its own earlier forwards" if own_open else others)
        fix = ("Raise the budget" if own_open >= pending else
               "Remove the graph break (torch._dynamo.explain(model)(...) shows it), evaluate "
               "under torch.no_grad(), or raise the budget")
        warnings.warn(
            f"memfit: a compiled region cannot fit {format_bytes(error.budget_bytes)} while "
            f"{holders} hold {format_bytes(pending)} of saved values; it runs at its smallest "
            f"peak, {format_bytes(error.minimum_bytes)}, and {again}. {fix}.", BudgetWarning,
            stacklevel=2)
        return self._at_minimum(graph, hardware, error, outside)

    def _at_minimum(self, graph: CostGraph, hardware: Hardware, error: BudgetError,
                    outside: int) -> Planned:
        """The region planned at its smallest peak (``error.minimum_bytes``)."""
        return plan_step(graph, hardware, Budget(bytes=error.minimum_bytes), self.strategy,
                         self.options.params, outside)

    # ---- code Dynamo runs: past its recompile limit, or a planned forward -----------------------

    def recompile_limit_hit(self, where: str, code: Any = None, limit: int | None = None
                            ) -> None:
        """Dynamo stopped compiling ``where`` (``code``) for this backend (its recompile limit):
        that code now runs eagerly, outside any plan. ``memfit.fit``'s module says so at each
        call it runs eagerly in (``memfit.compiler.unplanned``); else it is said once here."""
        from memfit.compiler.unplanned import limit_cause

        if code is not None:
            self.limit_codes[code] = limit_cause(limit)
        if where not in self.eager_codes:
            self.eager_codes.append(where)
        if self.options.checks_calls or len(self.eager_codes) > 1:
            return
        warnings.warn(
            f"memfit: Dynamo hit its recompile limit on {where}; that code now runs eagerly, "
            "outside any plan, so the budget no longer holds. Raise "
            "torch._dynamo.config.recompile_limit or remove what makes it recompile "
            '(TORCH_LOGS="recompiles" shows why).', BudgetWarning, stacklevel=2)

    def forward_ran(self, region: Region) -> None:
        """Count a planned forward of ``region`` run, in the current call of the model."""
        self.forward_runs += 1
        self.codes_run.add(site_code(region.site))

    # ---- re-planning when more stays resident ---------------------------------------------------

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state from now on (found at the model's first call or by its
        first ``step``) where it holds the model's parameters."""
        if any(known is optimizer for known in self.optimizers):
            return
        if self.steps_my_parameters(optimizer):
            self._optimizers = [*(weakref.ref(known) for known in self.optimizers),
                                weakref.ref(optimizer)]
            self._parameters = None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state counts as resident (``optimizer=`` and those adopted) that
        the loop still holds."""
        return [optimizer for optimizer in (reference() for reference in self._optimizers)
                if optimizer is not None]

    def steps_my_parameters(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds any of the model's parameters."""
        return self.model is not None and holds_parameters_of(optimizer, self.model)

    def state_to_come_bytes(self) -> int:
        """The state the adopted optimizers allocate at their first step, not yet made
        (``reserved_state_bytes``)."""
        if self.model is None:
            return 0
        device = device_of(self.model.parameters())
        return sum(reserved_state_bytes(optimizer, device) for optimizer in self.optimizers)

    def partners(self) -> list[tuple[Any, list]]:
        """The other fitted models in this loop, with their optimizers (``compiler.partners``):
        what they keep resident is counted as this model's own is."""
        return partners_of(self)

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
        entries and groups (counting walks every module and storage, which each region's run
        would pay otherwise). A new parameter or buffer shape is a
        new Dynamo trace, which compiles a region and counts afresh."""
        optimizers = self.optimizers
        if self._parameters is None or self._parameters[0] != [id(o) for o in optimizers]:
            model = list(self.model.parameters()) if self.model is not None else []
            self._parameters = ([id(o) for o in optimizers],
                                model + [p for optimizer in optimizers
                                         for g in optimizer.param_groups for p in g["params"]])
        parameters = self._parameters[1]
        partners = self.partners()
        key = (device, tuple(id(o) for o in optimizers), tuple(p.grad is None for p in parameters),
               tuple((len(o.param_groups), len(o.state)) for o in optimizers),
               tuple((id(model), tuple((len(o.param_groups), len(o.state)) for o in owned))
                     for model, owned in partners))
        if self._resident_counted is None or self._resident_counted[0] != key:
            counted = resident_bytes(self.model, optimizers, device, partners)
            self._resident_counted = (key, agree_max([counted])[0])  # as plan_region counts
        return self._resident_counted[1]

    def must_plan_again(self, regions: list[Region], device: torch.device,
                        args: Sequence = ()) -> bool:
        """Whether the compiled region whose plans are ``regions`` is planned again before it
        runs with ``args``: a newer plan was asked for (``replan_regions``), its own earlier
        forwards' saves are alive beside it (``beside_own_copies``), or more of other regions'
        than it counted (``beside_more_saves``), or more bytes of eager code's than its plan
        has room for (``beside_more_eager``), or more is resident than its plan left room for,
        which asks for a newer plan of every current region (``replans``)."""
        if self.joint_first_site is not None and regions[0].site == self.joint_first_site:
            self.joint_first_site = None
            if self._capped_jointly(regions):
                return True
        if (any(region.replaced for region in regions) or self.beside_own_copies(regions)
                or self.beside_more_saves(regions) or self.beside_more_eager(regions, args)):
            return True
        if not self.stale(device, min(region.resident_bytes for region in regions)):
            return False
        self.replans += 1
        self.replan_regions()
        for region in regions:  # a region of another shape of the same code is not "current"
            region.replaced = True
        return True

    def _capped_jointly(self, regions: list[Region]) -> bool:
        """Before the first run of a fitted model's first region, where a graph break follows
        it: trace the call on fakes, plan every region (``memfit.fitting.joint_first``), and
        take the caps on the earlier regions' saves; whether this region saves more than its
        cap, or was planned provisionally (``_provisional``), and is planned again before it
        runs."""
        trace, self.joint_first_trace = self.joint_first_trace, None
        if trace is None:
            return False
        device = self.device
        cuda = [device.index or 0] if device is not None and device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # a trace draws nothing, whatever it runs
            self.saves_caps.update(trace(self.joint_first_eager_bytes))
        cap = self.saves_caps.get(regions[0].site)
        provisional = self.step_peak_bytes and self.replans_provisional(regions)
        if not provisional and (cap is None or regions[-1].saved_bytes <= cap):
            return False
        for region in regions:
            region.replaced = True
        return True
