"""max_batch_size: the batch whose step fits a budget at the highest predicted throughput (or the
largest that fits), found by planning on meta tensors.

Each tried batch is captured from meta inputs (shapes and dtypes, no data) and planned; it fits
when the strategy finds a plan under the budget. The search grows the batch until one does not
fit, then closes the bracket: the largest batch that fits. Past the largest batch that fits
unplanned, a bigger batch buys its memory with recomputation and copies, so its samples/s can
fall; the search then plans a geometric set of smaller batches (and a refinement around the best)
and returns the fastest, with the whole frontier. With a real device the answer is checked by one
measured step.

Example:
    >>> found = memfit.max_batch_size(model, loss_fn, make_inputs, budget="80GiB",
    ...                               hardware="h100-pcie")
    >>> found.batch_size, found.predicted_throughput, found.verified
    >>> print(found)  # the frontier: batch, peak, step time, samples/s, host bytes swapped
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from memfit.api import Step
from memfit.compiler.step_graph import resolve_hardware
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.data.units import Budget, format_bytes
from memfit.fitting.arguments import (
    check_flags,
    check_hardware_and_optimizer,
    check_optimizer_of,
    check_step,
)
from memfit.fitting.cluster import FsdpBlock, resolve_sharding
from memfit.fitting.symbolic_batch import SymbolicBatch, trace_batch
from memfit.fitting.traced import PlanOptions, trace_plan, whole_step
from memfit.model.sharding import DEFAULT_BUCKET_BYTES, Sharding
from memfit.planning.batches import (
    FrontierPoint,
    PlannedBatch,
    Trial,
    bracket_largest,
    search_fastest,
    whole_bytes,
)
from memfit.planning.step import Planned
from memfit.planning.strategies import resolve_budget_and_strategy

__all__ = ["Trial", "FrontierPoint", "BatchSearch", "max_batch_size"]

OBJECTIVES = ("throughput", "largest")


@dataclass(frozen=True)
class BatchSearch:
    """What ``max_batch_size`` found.

    Args:
        batch_size: the chosen batch: the fastest that fits (``objective="throughput"``) or the
            largest (``objective="largest"``).
        plan: its plan.
        budget_bytes: the budget, whole device.
        predicted_peak_bytes: the planned step's predicted peak, whole device.
        predicted_step_time_s: its predicted step time on ``hardware``.
        hardware: the profile planned for.
        tried: every batch tried, in order.
        verified: the measured timeline of one real step at ``batch_size`` (``None``: not run).
        note: what the caller should know (the search hit ``max_batch``, verification stepped
            down), or ``""``.
        frontier: every batch that fit as planned, by batch: the trade-off between batch,
            peak, step time and host memory.
        objective: what chose ``batch_size``: ``"throughput"`` or ``"largest"``.
        largest_batch_size: the largest batch that fit as planned (0: not recorded).
        traces: how many times the step was traced (each a Dynamo trace and AOTAutograd);
            with one symbolic trace, the other batches are priced on it.
    """

    batch_size: int
    plan: Plan
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_time_s: float
    hardware: str
    tried: tuple[Trial, ...]
    verified: Timeline | None = None
    note: str = ""
    frontier: tuple[FrontierPoint, ...] = ()
    objective: str = "throughput"
    largest_batch_size: int = 0
    traces: int = 0

    @property
    def predicted_throughput(self) -> float:
        """Samples per second at ``batch_size``, predicted."""
        return self.batch_size / self.predicted_step_time_s if self.predicted_step_time_s else 0.0

    def __str__(self) -> str:
        from memfit.data.tables import table

        rows = [(t.batch_size, t.how, _outcome(t), format_bytes(t.peak_bytes),
                 format_bytes(t.host_bytes)) for t in self.tried]
        chosen = "fastest batch" if self.objective == "throughput" else "largest batch"
        lines = [
            f"{chosen}: {self.batch_size} under {format_bytes(self.budget_bytes)} "
            f"(strategy {self.plan.strategy!r}, hardware {self.hardware}): predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)}, step "
            f"{self.predicted_step_time_s * 1e3:.2f} ms, {self.predicted_throughput:.1f} samples/s",
        ]
        if self.frontier:
            lines += ["frontier (every batch that fit as planned; peaks and step times predicted):",
                      self._frontier_table()]
        lines += ["tried:", table(("batch", "how", "outcome", "peak", "host"), rows)]
        if self.verified is not None:
            lines.append(f"verified: one measured step peaked at "
                         f"{format_bytes(self.verified.peak_bytes)}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _frontier_table(self) -> str:
        from memfit.data.tables import table

        best = max(point.samples_per_s for point in self.frontier)
        rows = [(p.batch_size, format_bytes(p.peak_bytes), f"{p.step_time_s * 1e3:.3f} ms",
                 f"{p.samples_per_s:.1f}", f"{p.samples_per_s / best:.1%}" if best else "-",
                 format_bytes(p.host_bytes), "<-" if p.batch_size == self.batch_size else "")
                for p in self.frontier]
        return table(("batch", "peak", "step", "samples/s", "of best", "host", "chosen"), rows)


def _outcome(trial: Trial) -> str:
    """``fits``, ``over`` (the device budget) or ``over, host-limited`` (it would have fit by
    swapping more than the profile's host_bytes)."""
    if trial.fits:
        return "fits"
    return "over, host-limited" if trial.host_limited else "over"


def max_batch_size(model: torch.nn.Module, loss_fn: Callable,
                   make_inputs: Callable[[int], tuple[torch.Tensor, ...]],
                   budget: str | int, hardware: Hardware | str | None = None,
                   strategy: str | None = None, *, objective: str = "throughput",
                   max_batch: int = 1 << 16, verify: bool | None = None,
                   linearize: bool = False, autocast: torch.dtype | None = None,
                   world_size: int = 1, sharding: str = "none",
                   fsdp_block: FsdpBlock = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   optimizer: torch.optim.Optimizer | None = None,
                   symbolic: bool = True, **params: Any) -> BatchSearch:
    """The batch whose training step fits ``budget`` at the highest predicted throughput (or
    the largest that fits), planned without running it.

    Args:
        model: the module (its parameters may be on the meta device when ``verify`` is off,
            if its loss still reaches them there: transformers' GPT-2 does not, and capture
            refuses it; build such a model on the CPU and let the inputs be meta).
        loss_fn: ``loss_fn(model, *inputs) -> scalar tensor``.
        make_inputs: ``make_inputs(batch_size) -> inputs``; called under the meta device, so it
            allocates nothing unless it names a device itself (then its tensors become meta).
        budget: the whole device's bytes: parameters, gradients and inputs included, as in
            ``compile``. Fractions are not accepted: they depend on the batch.
        hardware: the profile to plan for (``"h100-pcie"``); default: that of the parameters'
            device. Throughput is predicted for it; its ``host_bytes`` limits what a plan
            swaps (the strategies plan within it: a batch fits only where they can).
        strategy: default ``"auto"``.
        objective: ``"throughput"`` (default): the fitting batch with the most predicted
            samples/s, which costs a few more plans (a geometric set below the largest fitting
            batch, then a refinement around the best); ``"largest"``: the largest fitting batch,
            however much recomputation and swapping it takes.
        max_batch: the largest batch tried (default 65536).
        verify: run one measured step at the found batch and step down while it does not fit.
            Default: when the parameters are on a real device (the CPU counts) of the profile's
            device type (a CPU step says nothing of a GPU's). It runs the step for real and
            then restores ``.grad`` and buffers as they were.
        linearize: as in ``compile``.
        autocast: as in ``memfit.plan``: the target's autocast dtype (``torch.bfloat16``,
            ``torch.float16``), its step captured as that device runs it.
        world_size, sharding, fsdp_block, bucket_bytes, optimizer: as in ``memfit.plan``: the
            batch is then one rank's, planned as one rank of that job holds it (``budget`` is
            one rank's device). A sharded search plans only (``verify`` must be off).
        symbolic: trace the step once with its batch dimension symbolic and price every batch
            on that trace (default); ``False``: trace every batch on its own. Batch 1, a batch
            that a guard on the batch excludes, and the chosen batch are traced on their own
            (the chosen batch's plan is the one a compile at that batch runs, and checks the
            symbolic price: where the two peaks differ, the search is done again a trace per
            batch, with a warning). Where the step cannot be traced with a symbolic batch (a
            size specialized, a size derived from the batch crossing a graph break), each batch
            is traced on its own; ``note`` says why.
        **params: the strategy's parameters.

    Raises:
        BudgetError: when even batch 1 cannot fit (its message names the smallest peak, and
            the profile's ``host_bytes`` where that limit stopped the swaps).
        ValueError: for a fractional budget, an unknown objective, a ``symbolic`` that is not
            a bool, or bad strategy parameters.

    Note:
        Bisection assumes that a batch that fits means every smaller one fits, which holds for
        the peak of a step but can be broken by a heuristic strategy's plan choices; ``tried``
        lists what was planned.
    """
    check_step(model, loss_fn)
    if not callable(make_inputs):
        raise ValueError(f"make_inputs takes a callable make_inputs(batch_size) -> tuple of "
                         f"input tensors, not {type(make_inputs).__name__}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a whole number of samples, 1 or more, got "
                         f"{max_batch!r}")
    check_flags(linearize=linearize)
    check_hardware_and_optimizer(hardware, optimizer)
    check_optimizer_of(model, optimizer)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}: "
                         "'throughput' for the fastest batch, 'largest' for the largest")
    if not isinstance(symbolic, bool):
        raise ValueError(f"symbolic must be True (one trace with a symbolic batch) or False (a "
                         f"trace per batch), got {symbolic!r}")
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    if parsed is None or parsed.bytes is None:
        raise ValueError(f"max_batch_size needs a budget in bytes ('80GiB'), not {budget!r}: "
                         "a fraction of the unplanned peak changes with the batch")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    resolved = resolve_hardware(hardware, device)
    spread = resolve_sharding(model, sharding, world_size, fsdp_block, bucket_bytes)
    if spread.active and verify:
        raise ValueError("a sharded plan (world_size > 1) cannot be verified on this machine: "
                         "pass verify=False, or measure one rank under torchrun")
    setup = _Setup(spread, optimizer, autocast)
    with _progress() as progress:
        planner = BatchPlanner(model, loss_fn, make_inputs, parsed, chosen, resolved, params,
                               linearize, setup, symbolic)
        found = _search(planner, objective, max_batch, verify, device, spread, progress)
        if planner.mismatch:  # the symbolic pricing missed the chosen batch's own trace
            planner.symbolic_off(planner.mismatch)
            found = _search(planner, objective, max_batch, verify, device, spread, progress)
        return found


def _progress() -> Any:
    """A progress bar of the batches planned (on a terminal only: each is a whole trace)."""
    from tqdm import tqdm

    return tqdm(desc="memfit max_batch_size: batches planned", unit="batch", disable=None,
                leave=False)


def _search(planner: BatchPlanner, objective, max_batch, verify, device, spread, progress
            ) -> BatchSearch:
    """``max_batch_size``'s search once its arguments are checked: bracket the largest batch
    that fits, then the fastest, then confirm it by its own trace and verify it."""
    tried: list[Trial] = []
    fitting: dict[int, PlannedBatch] = {}  # every batch planned to fit: the frontier
    budget_bytes = planner.budget.bytes

    def attempt(batch: int) -> PlannedBatch | None:
        if batch in fitting:
            return fitting[batch]
        try:
            planned = planner.plan(batch)
        except BudgetError as error:  # host_bytes named: swapping more would have fit
            tried.append(Trial(batch, False, "planned", error.minimum_bytes,
                               host_limited=error.host_bytes is not None))
            progress.update(1)
            progress.set_postfix_str(f"batch {batch} does not fit")
            return None
        tried.append(Trial(batch, True, "planned", whole_bytes(planned), planned.host_bytes))
        progress.update(1)
        progress.set_postfix_str(f"batch {batch} fits")
        fitting[batch] = planned
        return planned

    largest = bracket_largest(attempt, tried, budget_bytes, max_batch)
    if largest is None:
        planner.plan(1, traced=True)
        raise AssertionError("batch 1 fit on a second try")  # the first try raised BudgetError
    note = f"max_batch={max_batch} fits; raise max_batch to look further" \
        if largest.batch_size == max_batch else ""
    best = largest if objective == "largest" else search_fastest(attempt, largest, fitting)
    best = fitting[best.batch_size] = planner.confirmed(best)
    if planner.mismatch:
        return _found(planner, best, tried, fitting, objective, largest, None, note)
    verified = None
    default_verify = device.type == planner.hardware.device_type and not spread.active
    if verify if verify is not None else default_verify:
        best, verified, stepped = _verify(planner, best, attempt, tried)
        best = fitting[best.batch_size] = planner.confirmed(best)
        note = " ".join(filter(None, (note, stepped)))
    return _found(planner, best, tried, fitting, objective, largest, verified, note)


def _found(planner: BatchPlanner, best: PlannedBatch, tried: list[Trial],
           fitting: dict[int, PlannedBatch], objective: str, largest: PlannedBatch,
           verified: Timeline | None, note: str) -> BatchSearch:
    frontier = tuple(fitting[batch].point() for batch in sorted(fitting))
    note = " ".join(filter(None, (note, planner.how())))
    return BatchSearch(best.batch_size, best.plan, best.budget_bytes, whole_bytes(best),
                       best.predicted.step_time_s, planner.hardware.name, tuple(tried), verified,
                       note, frontier, objective, largest.batch_size, planner.traces)


def meta_inputs(make_inputs: Callable[[int], tuple[torch.Tensor, ...]],
                batch: int) -> tuple[torch.Tensor, ...]:
    """``make_inputs(batch)`` as meta tensors: made under the meta device, so nothing is filled."""
    with torch.device("meta"):
        inputs = make_inputs(batch)
    return tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)


class _Setup(NamedTuple):
    """What every batch of a search is planned with besides the batch: one rank's sharding,
    the optimizer whose state is resident and the target's autocast dtype."""

    sharding: Sharding | None = None
    optimizer: torch.optim.Optimizer | None = None
    autocast: torch.dtype | None = None


def _plan_batch(model, loss_fn, make_inputs, batch, budget, strategy, hardware, params,
                linearize, setup: _Setup | None = None) -> PlannedBatch:
    """Plan ``batch`` from meta inputs, as ``compile`` would plan it (nothing runs)."""
    setup = setup or _Setup()
    planned = trace_plan(model, loss_fn, meta_inputs(make_inputs, batch), budget, strategy,
                         hardware, params, linearize, autocast=setup.autocast,
                         sharding=setup.sharding, optimizer=setup.optimizer)
    return _planned_batch(batch, planned)


def _planned_batch(batch: int, planned: Planned) -> PlannedBatch:
    assert planned.budget.device_bytes is not None
    return PlannedBatch(batch, planned.plan, planned.predicted, planned.budget.device_bytes,
                        planned.budget.outside_bytes, planned.predicted.host_peak_bytes)


class BatchPlanner:
    """Plans the batches of one search: each on the one trace with a symbolic batch where that
    trace serves it (``memfit.fitting.symbolic_batch``), else by a trace of its own.

    ``confirmed`` plans the chosen batch by its own trace; where its peak differs from the
    symbolic pricing, ``mismatch`` says so and the search is done again a trace per batch."""

    def __init__(self, model, loss_fn, make_inputs, budget: Budget, strategy: str,
                 hardware: Hardware, params, linearize: bool, setup: _Setup,
                 symbolic: bool) -> None:
        self.model, self.loss_fn, self.make_inputs = model, loss_fn, make_inputs
        self.budget, self.strategy, self.hardware = budget, strategy, hardware
        self.params, self.linearize, self.setup = params, linearize, setup
        self.traced: SymbolicBatch | str | None = None if symbolic else \
            "symbolic=False: each batch traced on its own"
        self.traces = 0  # Dynamo traces made
        self.priced: set[int] = set()  # batches priced on the symbolic trace
        self.checked: set[int] = set()  # of them, those planned again by their own trace
        self.mismatch = ""

    def plan(self, batch: int, traced: bool = False) -> PlannedBatch:
        """``batch`` planned: on the symbolic trace where it serves (and not ``traced``)."""
        if not traced and batch > 1:
            symbolic = self._symbolic()
            if isinstance(symbolic, SymbolicBatch) and not symbolic.serves(batch):
                planned = _planned_batch(batch, whole_step(symbolic.plan(batch, self.budget)))
                self.priced.add(batch)
                return planned
        self.traces += 1
        return _plan_batch(self.model, self.loss_fn, self.make_inputs, batch, self.budget,
                           self.strategy, self.hardware, self.params, self.linearize,
                           self.setup)

    def _symbolic(self) -> SymbolicBatch | str:
        if self.traced is None:
            self.traces += 1
            options = PlanOptions(self.strategy, self.hardware, self.params, self.linearize,
                                  False, self.setup.autocast, self.setup.sharding,
                                  self.setup.optimizer)
            traced = trace_batch(self.model, self.loss_fn, self.make_inputs, meta_inputs,
                                 options)
            self.traced = traced if isinstance(traced, SymbolicBatch) else \
                f"{traced}: each batch traced on its own"
        return self.traced

    def confirmed(self, planned: PlannedBatch) -> PlannedBatch:
        """``planned``, planned by its own trace where it was priced on the symbolic one (the
        plan a compile at that batch runs); ``mismatch`` set where the peaks differ."""
        if planned.batch_size not in self.priced or planned.batch_size in self.checked:
            return planned
        try:
            own = self.plan(planned.batch_size, traced=True)
        except BudgetError as error:
            own, peak = None, error.minimum_bytes
        else:
            peak = whole_bytes(own)
        if own is None or peak != whole_bytes(planned):
            self.mismatch = (f"batch {planned.batch_size}'s own trace peaks at "
                             f"{format_bytes(peak)}, its symbolic pricing at "
                             f"{format_bytes(whole_bytes(planned))}")
            return planned
        self.checked.add(planned.batch_size)
        return own

    def symbolic_off(self, reason: str) -> None:
        """Trace each batch on its own from here on, for ``reason``."""
        warnings.warn(f"memfit max_batch_size: {reason}; searching again with a trace per "
                      "batch", stacklevel=3)
        self.traced, self.mismatch = f"{reason}: each batch traced on its own", ""
        self.priced, self.checked = set(), set()

    def how(self) -> str:
        """Why each batch was traced on its own, for ``BatchSearch.note`` (``""``: batches
        were priced on the one symbolic trace, or none past batch 1 was planned)."""
        if isinstance(self.traced, str):
            return f"{self.traced} ({self.traces} traces)"
        return ""


def _verify(planner: BatchPlanner, best: PlannedBatch, attempt, tried: list[Trial],
            tries: int = 4) -> tuple[PlannedBatch, Timeline | None, str]:
    """Measure one real step at ``best``; while it runs over, step down (1, 2, 4, ... smaller)."""
    found = best.batch_size
    step_down = 1
    for _ in range(tries):
        measured = _measure_step(planner.model, planner.loss_fn, planner.make_inputs, best,
                                 planner.strategy, planner.hardware, planner.params,
                                 planner.linearize)
        fits = measured.peak_bytes <= best.budget_bytes
        tried.append(Trial(best.batch_size, fits, "measured", measured.peak_bytes))
        if fits:
            stepped = "" if best.batch_size == found else (
                f"planning found {found}, but its measured step ran over the budget; "
                f"{best.batch_size} is the largest batch whose measured step fits")
            return best, measured, stepped
        smaller = None
        while smaller is None and best.batch_size - step_down >= 1:
            smaller = attempt(best.batch_size - step_down)
            step_down *= 2
        if smaller is None:
            break
        best = smaller
    return best, None, (f"no measured step fit the budget (tried down to batch "
                        f"{best.batch_size}); the planned answer is unverified")


def _measure_step(model, loss_fn, make_inputs, planned: PlannedBatch, strategy, hardware, params,
                  linearize) -> Timeline:
    """One real step at ``planned.batch_size``; ``.grad`` and buffers are restored afterwards."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    grads = {p: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
             for p in model.parameters()}
    buffers = {b: b.detach().to("cpu", copy=True) for b in model.buffers()}
    step = Step(model, loss_fn, Budget(bytes=planned.budget_bytes), strategy, hardware, True,
                params, linearize)
    try:
        inputs = tuple(t.to(device) for t in make_inputs(planned.batch_size))
        step.closed_loop = False  # one step, judged here
        step(*inputs)
        del inputs
        assert step.measured is not None
        return step.measured
    finally:
        with torch.no_grad():
            for parameter, grad in grads.items():
                if grad is None:
                    parameter.grad = None
                elif parameter.grad is not None:
                    parameter.grad.copy_(grad)
            for buffer, value in buffers.items():
                buffer.copy_(value)

