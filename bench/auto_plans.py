"""The figures of the auto benchmark (``bench/auto.py`` renders them): every planner at each
fraction of the unplanned peak, auto's minimum, the largest batch in 80 GiB, planning times.

Everything is captured on meta inputs (the models' weights are real, on the CPU: a meta model
cannot be traced, see ``memfit.tracing.capture._fake_inputs``), so nothing of the size of an
activation is ever allocated; every step time is the simulator's. The graphs are the ones a
CUDA GPU runs in float32 (CUDA's attention kernels, ``memfit.tracing.target``); the bf16 graphs
and the goals restated on them are in ``bench/validation.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import memfit
from bench.common import ms
from memfit import examples
from memfit.api import analyzed
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware, get_hardware
from memfit.data.plan import Plan
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy
from memfit.search import meta_inputs
from memfit.tracing.capture import capture

PROFILES = ("h100-pcie", "gh200")
FRACTIONS = (0.9, 0.7, 0.5, 0.3)  # of the unplanned (keep) simulated peak
BATCH_BUDGET = "80GiB"
# the alternatives, each with the parameters auto itself uses for it (so auto can only tie or win)
ALTERNATIVES: tuple[tuple[str, str, Mapping[str, Any]], ...] = (
    ("swap-only", "swap", {}),
    ("recompute-only", "optimal-recompute", {"method": "segments"}),
    ("vDNN all", "vdnn_all", {}),
    ("vDNN conv", "vdnn_conv", {}),
    ("vDNN dyn", "vdnn_dyn", {}),
)
MILP = "MILP optimum"
MILP_MAX_OPS = 40  # solve_swap_milp's model has O(ops^2) binaries: tens of ops solve in seconds


@dataclass(frozen=True)
class AutoModel:
    """One model at the issue's size, built with real weights on the CPU (inputs are meta)."""

    name: str
    build: Callable[[], examples.Example]
    batch_size: int


GPT2_MEDIUM = AutoModel(
    "GPT-2 medium (24 layers, width 1024, sequence 1024)",
    lambda: examples.gpt2(layers=24, width=1024, heads=16, vocab=50257, sequence=1024), 16)
AUTO_MODELS = (
    GPT2_MEDIUM,
    AutoModel("ResNet-50 (224x224 images, 1000 classes)",
              lambda: examples.resnet50_shaped(widths=(256, 512, 1024, 2048), image=224,
                                               classes=1000), 64),
    AutoModel("3D U-Net (MONAI, channels 32-512, 128^3 volumes)",
              lambda: examples.unet3d(channels=(32, 64, 128, 256, 512), size=128), 4),
)
GPT2_SMALL = AutoModel("GPT-2 small (12 layers, width 768, sequence 1024)",
                       lambda: examples.gpt2(layers=12, width=768, heads=12, vocab=50257,
                                             sequence=1024), 8)


@dataclass(frozen=True)
class Outcome:
    """One planner at one budget: its simulated step time (``None``: does not fit)."""

    step_time_s: float | None
    planning_s: float
    solver: str = ""  # auto's pick; the MILP's status


@dataclass(frozen=True)
class BudgetRow:
    """Every planner at ``fraction`` of the unplanned peak."""

    fraction: float
    budget_bytes: int
    outcomes: Mapping[str, Outcome]  # "auto", the ALTERNATIVES' names, and MILP if it ran


@dataclass(frozen=True)
class LargestBatch:
    """What ``memfit.max_batch_size`` found for one strategy: the batch and its predicted
    throughput (a batch that fits only by recomputing heavily can be much slower per sample)."""

    batch_size: int
    samples_per_s: float


@dataclass(frozen=True)
class ProfileResult:
    """One model on one profile: the unplanned step, the rows, auto's smallest reachable peak."""

    profile: str
    ops: int
    keep_peak_bytes: int
    keep_step_s: float
    rows: tuple[BudgetRow, ...]
    minimum_bytes: int
    keep_largest: LargestBatch | None = None  # None: not searched
    auto_largest: LargestBatch | None = None


@dataclass
class ModelResult:
    name: str
    batch_size: int
    capture_s: float
    profiles: dict[str, ProfileResult] = field(default_factory=dict)


def plan_outcome(graph: CostGraph, hardware: Hardware, budget_bytes: int, strategy: str,
                 params: Mapping[str, Any] = {}) -> Outcome:
    """Plan with ``strategy``; a plan that raises ``BudgetError`` or simulates over the budget
    does not fit."""
    started = time.perf_counter()
    try:
        made = get_strategy(strategy)(graph, hardware, budget_bytes, **params)
    except BudgetError:
        return Outcome(None, time.perf_counter() - started)
    planning_s = time.perf_counter() - started
    timeline = simulate(graph, made, hardware, record_intervals=False)
    fits = timeline.peak_bytes <= budget_bytes
    return Outcome(timeline.step_time_s if fits else None, planning_s,
                   str(made.params.get("solver", "")))


def milp_outcome(graph: CostGraph, hardware: Hardware, budget_bytes: int) -> Outcome | None:
    """POET's swap + recompute MILP (``plan_swap_milp``) on graphs of up to ``MILP_MAX_OPS``
    ops; ``None`` above, where the model is too large to build, let alone solve."""
    if len(graph.ops) > MILP_MAX_OPS:
        return None
    from memfit.planning.strategies.milp_swap_plan import plan_swap_milp

    reference = plan_swap_milp(graph, hardware, budget_bytes)
    fits = reference.plan is not None and 0 <= reference.peak_bytes <= budget_bytes
    return Outcome(reference.simulated_step_time_s if fits else None,
                   reference.solution.solve_time_s, reference.solution.status)


def budget_rows(graph: CostGraph, hardware: Hardware, keep_peak_bytes: int,
                fractions: Sequence[float] = FRACTIONS) -> tuple[BudgetRow, ...]:
    """Auto, every alternative and (on small graphs) the MILP at each fraction of the peak."""
    rows = []
    for fraction in fractions:
        budget_bytes = int(fraction * keep_peak_bytes)
        outcomes = {"auto": plan_outcome(graph, hardware, budget_bytes, "auto")}
        for name, strategy, params in ALTERNATIVES:
            outcomes[name] = plan_outcome(graph, hardware, budget_bytes, strategy, params)
        milp = milp_outcome(graph, hardware, budget_bytes)
        if milp is not None:
            outcomes[MILP] = milp
        rows.append(BudgetRow(fraction, budget_bytes, outcomes))
    return tuple(rows)


def minimum_bytes(graph: CostGraph, hardware: Hardware) -> int:
    """The smallest peak auto reaches: ``BudgetError.minimum_bytes`` for a one-byte budget."""
    try:
        get_strategy("auto")(graph, hardware, 1)
    except BudgetError as error:
        return error.minimum_bytes
    return 1


def profile_result(graph: CostGraph, hardware: Hardware,
                   fractions: Sequence[float] = FRACTIONS) -> ProfileResult:
    """The unplanned step, every planner at each fraction, and auto's minimum, on one profile."""
    keep = simulate(graph, Plan("keep"), hardware, record_intervals=False)
    return ProfileResult(hardware.name, len(graph.ops), keep.peak_bytes, keep.step_time_s,
                         budget_rows(graph, hardware, keep.peak_bytes, fractions),
                         minimum_bytes(graph, hardware))


def overhead(outcome: Outcome | None, keep_step_s: float) -> float | None:
    """Step-time overhead over the unplanned step (0.05 is 5% slower); ``None``: no fit."""
    if outcome is None or outcome.step_time_s is None:
        return None
    return outcome.step_time_s / keep_step_s - 1


def auto_losses(row: BudgetRow) -> list[str]:
    """Where auto is slower than an alternative that fits, or fails where one fits: each is a
    bug, since auto plans every alternative with the same parameters among its candidates."""
    auto = row.outcomes["auto"].step_time_s
    losses = []
    for name, _, _ in ALTERNATIVES:
        theirs = row.outcomes[name].step_time_s
        if theirs is not None and (auto is None or auto > theirs * (1 + 1e-9)):
            mine = "does not fit" if auto is None else ms(auto)
            losses.append(f"{name} {ms(theirs)} vs auto {mine}")
    return losses


def measure_model(bench: AutoModel, example: examples.Example, log: Callable[[str], None],
                  profiles: Sequence[str] = PROFILES,
                  fractions: Sequence[float] = FRACTIONS) -> ModelResult:
    """Capture ``example`` (built by ``bench``) once on meta inputs as a CUDA GPU runs it in
    float32 (its attention kernels, ``memfit.tracing.target``; every profile here is a CUDA GPU),
    then analyze and plan it on every profile."""
    started = time.perf_counter()
    captured = capture(example.model, example.loss_fn,
                       *meta_inputs(example.make_inputs, bench.batch_size),
                       hardware=get_hardware(profiles[0]))
    result = ModelResult(bench.name, bench.batch_size, time.perf_counter() - started)
    for name in profiles:
        hardware = get_hardware(name)
        _, graph = analyzed(captured, hardware, type(example.model).__name__, False)
        result.profiles[name] = profile_result(graph, hardware, fractions)
        log(f"auto {bench.name} on {name}: {len(graph.ops)} ops planned")
    return result


def largest_batches(name: str, example: examples.Example, result: ModelResult,
                    log: Callable[[str], None], budget: str = BATCH_BUDGET,
                    max_batch: int = 1 << 16) -> None:
    """Fill in each profile's largest batch in ``budget`` with keep and with auto, planned on
    meta inputs, not run."""

    def search(strategy: str, profile: str) -> LargestBatch:
        started = time.perf_counter()
        try:
            found = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                                          budget=budget, hardware=profile, strategy=strategy,
                                          objective="largest", verify=False, max_batch=max_batch)
        except BudgetError:
            return LargestBatch(0, 0.0)
        log(f"auto {name}: {strategy} fits batch {found.batch_size} in {budget} on {profile} "
            f"({found.predicted_throughput:.1f} samples/s; {len(found.tried)} plans, "
            f"{time.perf_counter() - started:.0f} s)")
        return LargestBatch(found.batch_size, found.predicted_throughput)

    for profile, found in result.profiles.items():
        result.profiles[profile] = replace(found, keep_largest=search("keep", profile),
                                           auto_largest=search("auto", profile))


def planning_times(bench: AutoModel, profile: str = PROFILES[0],
                   fraction: float = 0.5) -> tuple[float, float, float]:
    """(capture + analysis, auto's plan call, the whole ``memfit.plan``) in wall seconds for
    ``bench`` at ``fraction`` of its peak. ``memfit.plan`` also explains the plan, which plans
    twice more (the what-if rows at the budget x0.9 and x1.1)."""
    example = bench.build()
    inputs = meta_inputs(example.make_inputs, bench.batch_size)
    hardware = get_hardware(profile)
    started = time.perf_counter()
    _, graph = analyzed(capture(example.model, example.loss_fn, *inputs, hardware=hardware),
                        hardware, type(example.model).__name__, False)
    capture_s = time.perf_counter() - started
    peak_bytes = simulate(graph, Plan("keep"), hardware, record_intervals=False).peak_bytes
    started = time.perf_counter()
    try:
        get_strategy("auto")(graph, hardware, int(fraction * peak_bytes))
    except BudgetError:
        pass
    auto_s = time.perf_counter() - started
    started = time.perf_counter()
    try:
        memfit.plan(example.model, example.loss_fn, *inputs, budget=fraction, hardware=profile)
    except BudgetError:
        pass
    return capture_s, auto_s, time.perf_counter() - started
