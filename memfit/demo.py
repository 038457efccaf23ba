"""The main job: train GPT-2 a few steps unplanned, then under swap at half its peak, and compare.

Both runs start from the same weights (a deep copy), see the same batches and the same RNG seeds
(dropout included), and run with deterministic algorithms, so a correct rewrite gives bitwise
identical losses and gradients. The demo is also a smoke test: ``DemoResult.ok`` is false when the
gradients differ or the measured peak exceeds the budget, and the CLI exits non-zero then.

Example:
    >>> result = run_demo(DemoConfig.quick())
    >>> result.gradients_identical, result.within_budget
    (True, True)
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import memfit
from memfit import examples
from memfit.data.timeline import Timeline


@dataclass(frozen=True)
class DemoConfig:
    """The model and the run. Defaults take about a minute on a 2-core CPU.

    The GPT-2 is small in parameters (about 1 M) but long in sequence, so saved activations are
    most of the step's peak: the regime where swapping pays.
    """

    layers: int = 4
    width: int = 128
    heads: int = 4
    vocab: int = 256
    sequence: int = 256
    batch_size: int = 8
    steps: int = 4
    budget: float = 0.5  # a fraction of the unplanned peak
    learning_rate: float = 1e-3
    seed: int = 0
    hardware: str | None = None  # None: plan with the profile of the device at hand

    @staticmethod
    def quick(**changes) -> DemoConfig:
        """A smaller model and two steps: well under a minute, for CI."""
        return replace(DemoConfig(layers=2, width=64, heads=2, vocab=128, sequence=128,
                                  batch_size=4, steps=2), **changes)


@dataclass
class RunRecord:
    """What one run (unplanned or swap) produced."""

    name: str
    losses: list[torch.Tensor] = field(default_factory=list)
    first_gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    peaks_bytes: list[int] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    step: memfit.Step | None = None
    final_parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    measured_timeline: Timeline | None = None  # the last step's

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks_bytes)

    @property
    def median_step_time_s(self) -> float:
        """Median over the steps after the first (the first touches every buffer once more)."""
        return statistics.median(self.step_times_s[1:] or self.step_times_s)


@dataclass
class DemoResult:
    """Both runs and the comparisons the demo reports."""

    config: DemoConfig
    unplanned: RunRecord
    planned: RunRecord
    budget_bytes: int
    gradients_identical: bool
    losses_identical: bool
    weights_identical: bool
    unplanned_timeline: Timeline  # measured, last step
    unplanned_predicted_timeline: Timeline  # predicted, op by op
    planned_timeline: Timeline  # predicted
    planned_measured_timeline: Timeline  # measured, last step

    @property
    def within_budget(self) -> bool:
        return self.planned.peak_bytes <= self.budget_bytes

    @property
    def ok(self) -> bool:
        return self.gradients_identical and self.losses_identical and self.within_budget


def make_batches(config: DemoConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic token batches, one per step, from a seeded generator (labels = inputs)."""
    generator = torch.Generator().manual_seed(config.seed)
    batches = []
    for _ in range(config.steps):
        ids = torch.randint(0, config.vocab, (config.batch_size, config.sequence),
                            generator=generator)
        batches.append((ids, ids.clone()))
    return batches


def train(record: RunRecord, model: torch.nn.Module, step: memfit.Step,
          batches: list, config: DemoConfig, tick: Callable[[], None]) -> None:
    """AdamW over ``batches`` with ``step`` as forward+backward; fills ``record``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    seed = config.seed
    record.step = step
    for index, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)  # no gradients outside the step: same budget each step
        torch.manual_seed(seed + index)  # dropout draws the same numbers in both runs
        loss = step(*batch)
        measured = step.measured
        assert measured is not None
        record.losses.append(loss.detach().clone())
        record.peaks_bytes.append(measured.peak_bytes)
        record.step_times_s.append(measured.step_time_s)
        if index == 0:
            record.first_gradients = {name: p.grad.clone() for name, p in model.named_parameters()
                                      if p.grad is not None}
        optimizer.step()
        tick()
    record.measured_timeline = step.measured
    record.final_parameters = {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two name -> tensor maps (same names, ``torch.equal`` on each)."""
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def run_demo(config: DemoConfig, tick: Callable[[], None] = lambda: None) -> DemoResult:
    """Train unplanned, then under ``strategy="swap"`` at ``config.budget``; compare the two.

    Deterministic algorithms are on while it runs (and restored after), so that bitwise equality
    is a fair test of the rewrite rather than of kernel selection.

    Args:
        config: model size, steps and budget.
        tick: called after every step (a progress bar's ``update``).

    Raises:
        BudgetError: if swapping cannot reach the budget for this model (lower the budget less).
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _run_both(config, tick)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _run_both(config: DemoConfig, tick: Callable[[], None]) -> DemoResult:
    example = examples.gpt2(layers=config.layers, width=config.width, heads=config.heads,
                            vocab=config.vocab, sequence=config.sequence,
                            batch_size=config.batch_size, seed=config.seed)
    loss_fn, unplanned_model = example.loss_fn, example.model
    planned_model = copy.deepcopy(unplanned_model)  # the same initial weights for both runs
    del example
    batches = make_batches(config)
    unplanned = RunRecord("unplanned")
    train(unplanned, unplanned_model,
          memfit.compile(unplanned_model, loss_fn, strategy="keep", hardware=config.hardware),
          batches, config, tick)
    assert unplanned.step is not None
    unplanned_compiled = unplanned.step.compiled
    unplanned_predicted = _annotated(unplanned_compiled.predicted, unplanned_compiled.graph,
                                     unplanned)
    del unplanned_compiled
    unplanned.step = None  # its program, optimizer state and model go before the next run
    del unplanned_model
    gc.collect()
    planned = RunRecord("swap")
    train(planned, planned_model,
          memfit.compile(planned_model, loss_fn, budget=config.budget, strategy="swap",
                         hardware=config.hardware), batches, config, tick)
    assert planned.step is not None
    compiled = planned.step.compiled
    assert compiled.budget_bytes is not None
    return DemoResult(
        config=config, unplanned=unplanned, planned=planned, budget_bytes=compiled.budget_bytes,
        gradients_identical=_same(unplanned.first_gradients, planned.first_gradients),
        losses_identical=all(torch.equal(a, b) for a, b in
                             zip(unplanned.losses, planned.losses, strict=True)),
        weights_identical=_same(unplanned.final_parameters, planned.final_parameters),
        unplanned_timeline=_annotated(_last_measured(unplanned), compiled.graph, unplanned),
        unplanned_predicted_timeline=unplanned_predicted,
        planned_timeline=_annotated(compiled.predicted, compiled.graph, planned),
        planned_measured_timeline=_annotated(_last_measured(planned), compiled.graph, planned),
    )


def _last_measured(record: RunRecord) -> Timeline:
    assert record.measured_timeline is not None
    return record.measured_timeline


def _annotated(timeline: Timeline, graph, record: RunRecord) -> Timeline:
    """``timeline`` with its phase boundaries and the run's measured peaks and times in ``meta``.

    Note:
        Measured and predicted timelines label compute actions by fx node name, which the
        rewrite keeps, so one graph gives the phases of both.
    """
    from memfit.render.plot import with_phases

    timeline = with_phases(timeline, graph)
    return replace(timeline, meta={**timeline.meta, "run": record.name,
                                   "measured_peak_bytes": record.peak_bytes,
                                   "measured_step_times_s": record.step_times_s})


def write_outputs(result: DemoResult, out: Path) -> list[Path]:
    """``memory.png`` and the timelines as JSON in ``out``; returns the paths written.

    ``unplanned.json`` and ``swap-measured.json`` are measured (the last step's peak and time:
    compiled code is measured by the allocator as a whole), ``swap.json`` is the simulator's
    prediction for the swap plan, op by op.
    """
    from memfit.render.plot import memory_plot

    out.mkdir(parents=True, exist_ok=True)
    timelines = {"unplanned (predicted)": (result.unplanned_predicted_timeline,
                                           out / "unplanned-predicted.json"),
                 "unplanned (measured)": (result.unplanned_timeline, out / "unplanned.json"),
                 "swap (predicted)": (result.planned_timeline, out / "swap.json"),
                 "swap (measured)": (result.planned_measured_timeline,
                                     out / "swap-measured.json")}
    for timeline, path in timelines.values():
        timeline.save(path)
    png = memory_plot({name: timeline for name, (timeline, _) in timelines.items()},
                      out / "memory.png", budget_bytes=result.budget_bytes,
                      gantt="swap (predicted)",
                      title=f"GPT-2 training step: unplanned vs swap at budget "
                            f"{result.config.budget:g} of the peak")
    return [png, *(path for _, path in timelines.values())]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def demo_report(result: DemoResult, width: int = 100) -> str:
    """The table the demo prints: peaks, budget, step times, what was swapped, the verdicts."""
    from memfit.data.tables import fit_table, tally_lines
    from memfit.data.units import format_bytes
    from memfit.model.explain import tally

    planned_step = result.planned.step
    assert planned_step is not None
    compiled = planned_step.compiled
    predicted_peak = compiled.predicted.peak_bytes + compiled.outside_bytes
    counted = tally(compiled.graph, compiled.plan, compiled.predicted)
    rows = [
        ("unplanned (keep)", format_bytes(result.unplanned.peak_bytes),
         format_bytes(compiled.baseline.peak_bytes + compiled.outside_bytes), "-",
         _ms(result.unplanned.median_step_time_s), _ms(compiled.baseline.step_time_s),
         f"0 / {counted.saved}"),
        ("swap", format_bytes(result.planned.peak_bytes), format_bytes(predicted_peak),
         format_bytes(result.budget_bytes), _ms(result.planned.median_step_time_s),
         _ms(compiled.predicted.step_time_s), f"{counted.swapped} / {counted.saved}"),
    ]
    gap = (predicted_peak - result.planned.peak_bytes) / result.planned.peak_bytes
    config = result.config
    yes = {True: "yes", False: "NO"}
    lines = [
        f"GPT-2 ({config.layers} layers, width {config.width}, sequence {config.sequence}, "
        f"batch {config.batch_size}), {config.steps} AdamW steps each, "
        f"budget {config.budget:g} of the unplanned peak",
        fit_table(("run", "peak measured", "peak predicted", "budget",
                   "step time measured (median, 2..N)",
                   f"step time predicted ({compiled.plan.hardware})", "tensors swapped / saved"),
                  rows, width),
        f"measured peak within budget: {yes[result.within_budget]} "
        f"({result.planned.peak_bytes / result.unplanned.peak_bytes:.0%} of the unplanned peak)",
        f"gradients identical after step 1 (torch.equal, every parameter): "
        f"{yes[result.gradients_identical]}",
        f"losses identical at every step: {yes[result.losses_identical]}; weights identical after "
        f"step {config.steps}: {yes[result.weights_identical]}",
        f"prediction gap (swap peak, predicted vs measured): {gap:+.2%}",
        f"step times: predicted with the {compiled.plan.hardware!r} hardware profile, nominal "
        f"figures not measured on this machine (memfit.measure_hardware() measures it); measured "
        f"under memfit's allocator profiler (measure=True), beside whatever else uses the CPU",
        *tally_lines(counted, f"predicted on {compiled.plan.hardware}"),
    ]
    return "\n".join(lines)
