"""Recomputation on the CPU (issue #3): memory / step-time curves of every way to trade time for memory.

For each model, in one process, on one batch with one seed: eager; ``torch.utils.checkpoint``
around every block and around every other block; ``torch.compile(backend="aot_eager")`` under
``activation_memory_budget``; memfit's ``checkpoint`` modes and budgets; memfit ``keep`` and
``swap`` for reference; and the optimal schedule (``optimal-recompute``) at fractions of the
unplanned peak, then at the measured peak of every other recomputing method and at its own minimum,
with a computed verdict per model: does the optimal schedule sit on or below each other method?

Peaks are the step's device bytes: parameters and inputs plus the step's own peak above them, by
memfit's dispatch tracker, or by the profiler's allocator events for compiled code (a dispatch
mode would disable it). Step times are medians of timed steps run in turn (a, b, c, a, b, c, ...)
after a warm-up, so that the load of a shared machine falls on every method alike.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from bench.common import (
    compare_gradients,
    compiled_step,
    eager_step,
    gradients,
    interleaved_medians_s,
    memfit_step,
    mib,
    ms,
    profiled_peak_above_start,
)
from memfit import examples
from memfit.data.errors import BudgetError
from memfit.render.text import table
from memfit.runtime.measure import measure_peak

SEED = 0
BUDGET_FRACTIONS = (0.9, 0.7, 0.5, 0.3)  # of the unplanned peak, for memfit and optimal
COMPILE_BUDGETS = (0.9, 0.7, 0.5, 0.3)  # torch._functorch activation_memory_budget values
REPEATS = 3  # timed steps per method after the warm-up; the median is reported
OPTIMAL = "optimal-recompute"
EAGER_BY_PROFILER = "eager, peak by the profiler (compiled rows' 100%)"
SINGLE_THREAD_NOTE = (
    "Every method runs on one intra-op thread: on a 2-core machine shared with other jobs, two "
    "OpenMP threads competing with another process made single steps up to 10x slower at random "
    "(a 85 ms ResNet step took 6.7 s), which no median of 3 survives.")


@dataclass(frozen=True)
class RecomputeModel:
    """A model at its bench size and what a "block" is for it.

    Args:
        block_types: class names of the modules wrapped by ``torch.utils.checkpoint`` and named
            as memfit checkpoints; a match nested inside another match is not a block.
        block_description: the same in words, for the table's caption.
    """

    name: str
    build: Callable[[], examples.Example]
    batch_size: int
    block_types: tuple[str, ...]
    block_description: str


@dataclass
class Method:
    """One way to run the step: ``build()`` returns ``(model, run, memfit step or None)``."""

    family: str  # the plot's series
    name: str
    peak_method: str  # "tracker" or "profiler"
    build: Callable[[], tuple[nn.Module, Callable[[], torch.Tensor], memfit.Step | None]]
    compile_budget: float | None = None  # activation_memory_budget for compiled methods
    blocks: tuple[str, ...] = ()  # the blocks torch.utils.checkpoint wraps, to price its re-runs
    copies: str = ""  # for an optimal row at another method's peak: that method's name
    budget_bytes: int | None = None  # memfit's budget in bytes, where one was given in bytes


@dataclass
class Row:
    """What was measured for one method; ``note`` explains a failure instead of numbers."""

    family: str
    name: str
    peak_method: str
    peak_bytes: int | None = None  # parameters and inputs included
    step_time_s: float | None = None
    eager_step_time_s: float | None = None  # eager timed in the same interleaved group
    predicted_bytes: int | None = None
    predicted_recompute_s: float | None = None  # by memfit's cost model: the planner's objective
    solver: str = ""  # optimal-recompute's plan.params["solver"]
    copies: str = ""  # for an optimal row at another method's peak: that method's name
    budget_bytes: int | None = None
    gradients: str = "-"
    note: str = ""


@dataclass
class ModelResult:
    """The rows of one model, and the eager peaks each measuring method compares with."""

    name: str
    rows: list[Row] = field(default_factory=list)
    eager_peak_bytes: dict[str, int] = field(default_factory=dict)  # by peak method; "start":
    # the bytes of parameters and inputs, which the profiler does not see
    reference_gradients: dict[str, torch.Tensor] | None = None  # eager's
    graph_step: memfit.Step | None = None  # a memfit step that ran: its captured graph


def block_paths(model: nn.Module, block_types: Sequence[str]) -> list[str]:
    """Module paths of the blocks, in definition order, outermost matches only."""
    paths: list[str] = []
    for path, module in model.named_modules():
        inside = any(path.startswith(outer + ".") for outer in paths)
        if type(module).__name__ in block_types and not inside:
            paths.append(path)
    return paths


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block: what a user wraps by hand.

    Note:
        Non-reentrant, as the PyTorch docs recommend; it restores the RNG state for the
        recomputation, so dropout draws the same mask twice.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.checkpointed = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.checkpointed, *args, use_reentrant=False, **kwargs)


def wrap_blocks(model: nn.Module, paths: Sequence[str]) -> nn.Module:
    """Replace each module at ``paths`` with a ``Checkpointed`` wrapper, in place."""
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, Checkpointed(getattr(parent, child)))
    return model


def _eager_builder(example: examples.Example, inputs: tuple, paths: Sequence[str] = ()):
    """Eager PyTorch on a fresh copy, with ``torch.utils.checkpoint`` around ``paths``."""

    def build():
        model = wrap_blocks(copy.deepcopy(example.model), paths)
        config = getattr(model, "config", None)
        if paths and getattr(config, "use_cache", False):
            config.use_cache = False  # as transformers does under gradient checkpointing: a
            # key/value cache handed into a checkpointed block would be filled twice
        model.train()
        return model, eager_step(model, example.loss_fn, inputs), None

    return build


def _compiled_builder(example: examples.Example, inputs: tuple, budget: float):
    return lambda: (*compiled_step(example, inputs, budget), None)


def _memfit_builder(example: examples.Example, inputs: tuple, **options):
    return lambda: memfit_step(example, inputs, **options)


def methods(example: examples.Example, inputs: tuple, paths: Sequence[str],
            fractions: Sequence[float] = BUDGET_FRACTIONS,
            compile_budgets: Sequence[float] = COMPILE_BUDGETS) -> list[Method]:
    """Every method of the section, eager first (the reference the others compare with)."""
    found = [
        Method("eager", "eager", "tracker", _eager_builder(example, inputs)),
        Method("torch.utils.checkpoint", "torch.utils.checkpoint, every block", "tracker",
               _eager_builder(example, inputs, paths), blocks=tuple(paths)),
        Method("torch.utils.checkpoint", "torch.utils.checkpoint, every other block", "tracker",
               _eager_builder(example, inputs, paths[::2]), blocks=tuple(paths[::2])),
    ]
    found += [Method("torch.compile budget", f"torch.compile aot_eager, "
                     f"activation_memory_budget {budget}", "profiler",
                     _compiled_builder(example, inputs, budget), budget)
              for budget in compile_budgets]

    def planned(family: str, name: str, **options) -> Method:
        return Method(family, name, "tracker", _memfit_builder(example, inputs, **options))

    found += [
        planned("memfit checkpoint modes", 'memfit checkpoint "memory" (no budget: sqrt(n))',
                strategy="checkpoint", checkpoints="memory"),
        planned("memfit checkpoint modes", 'memfit checkpoint "speed"', strategy="checkpoint",
                checkpoints="speed"),
        planned("memfit checkpoint modes", "memfit checkpoint, the blocks' outputs",
                strategy="checkpoint", checkpoints=list(paths)),
    ]
    found += [planned("memfit checkpoint memory, budget", f'memfit checkpoint "memory", '
                      f"budget {fraction:.0%}", strategy="checkpoint", checkpoints="memory",
                      budget=fraction) for fraction in fractions]
    found += [planned("memfit keep / swap", 'memfit "keep"', strategy="keep"),
              planned("memfit keep / swap", 'memfit "swap", budget 50%', strategy="swap",
                      budget=0.5)]
    if OPTIMAL in memfit.strategy_names():
        found += [planned("optimal", f"memfit {OPTIMAL}, budget {fraction:.0%}",
                          strategy=OPTIMAL, budget=fraction) for fraction in fractions]
    return found


COPIED_FAMILIES = ("torch.utils.checkpoint", "memfit checkpoint modes", "torch.compile budget")


def optimal_at(example: examples.Example, inputs: tuple, budget_bytes: int, copies: str = "",
               peak_method: str = "tracker", **options) -> Method:
    """``optimal-recompute`` under a budget in bytes: at another method's peak, or at its minimum.

    Note:
        memfit's budget covers the whole device, parameters and inputs included (its graph's
        placeholders), as the rows' measured peaks do; bytes outside the graph (existing
        ``.grad``) come off it, and the bench's steps clear gradients first. So a tracker-measured
        peak is the budget that means the same thing.
    """
    name = (f"memfit {OPTIMAL} at the peak of {copies}" if copies
            else f"memfit {OPTIMAL} at its minimum")
    return Method("optimal", name, peak_method,
                  _memfit_builder(example, inputs, strategy=OPTIMAL, budget=int(budget_bytes),
                                  **options),
                  copies=copies, budget_bytes=int(budget_bytes))


def copied_budget(row: Row) -> int:
    """The budget that means ``row``'s measured peak in memfit's frame: its predicted peak when it
    is a memfit plan (the tracker can read a few KiB below memfit's count, e.g. ResNet's 7.14 MiB
    for a plan predicted at 7.17 MiB: a budget below a plan's own prediction would refuse the
    plan itself), else its tracker-measured peak (at or below memfit's frame, so not generous)."""
    assert row.peak_bytes is not None
    return row.predicted_bytes if row.predicted_bytes is not None else row.peak_bytes


def optimal_minimum_bytes(step: memfit.Step, inputs: tuple) -> int | None:
    """The least whole-step budget ``optimal-recompute`` fits on ``step``'s captured graph: the
    strategy's ``BudgetError.minimum_bytes`` for a 1-byte budget, plus the bytes outside the graph."""
    from memfit.api import resolve_hardware
    from memfit.planning.strategies import get_strategy

    compiled = step.compiled
    hardware = resolve_hardware(step.hardware_spec, inputs[0].device)
    try:
        get_strategy(OPTIMAL)(compiled.graph, hardware, 1)
    except BudgetError as error:
        return error.minimum_bytes + compiled.outside_bytes
    return None  # it fits one byte: nothing to report


def block_recompute_s(graph, blocks: Sequence[str]) -> float:
    """What ``torch.utils.checkpoint`` around ``blocks`` re-runs, priced by memfit's cost model:
    every forward op inside a block, once (non-reentrant checkpointing replays the whole block)."""
    inside = tuple(blocks)
    return sum(op.time_s for op in graph.ops if op.phase == "forward"
               and any(op.scope == b or op.scope.startswith(b + ".") for b in inside))


def _failure(error: Exception) -> str:
    """A row's note for a method that could not run: the budget error's minimum, or the error."""
    if isinstance(error, BudgetError):
        return (f"does not fit: budget {mib(error.budget_bytes)}, this mode's minimum "
                f"{mib(error.minimum_bytes)}")
    message = str(error).strip().splitlines()[0][:100] if str(error).strip() else ""
    return f"failed: {type(error).__name__}: {message}"


def _warm_up(method: Method, reference: dict | None):
    """Build and run ``method`` once (compile, capture and plan happen here); compare gradients.

    Returns:
        ``(row, model, run, memfit step or None)``; ``run`` is ``None`` when the method failed
        (the row says why).
    """
    row = Row(method.family, method.name, method.peak_method, copies=method.copies,
              budget_bytes=method.budget_bytes)
    try:
        model, run, step = method.build()
        torch.manual_seed(SEED)
        run()
    except Exception as error:  # a bench must report a failing method, not stop
        row.note = _failure(error)
        return row, None, None, None
    found = _unwrapped_gradients(model)
    row.gradients = "reference" if reference is None else compare_gradients(reference, found)
    if step is not None:
        row.predicted_bytes = step.predicted.peak_bytes + step.compiled.outside_bytes
        row.predicted_recompute_s = step.predicted.recompute_s
        row.solver = str(step.plan.params.get("solver", ""))
    return row, model, run, step


def _unwrapped_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by the parameter names of the unwrapped model (``Checkpointed`` adds a level)."""
    return {name.replace(".checkpointed.", "."): grad for name, grad in gradients(model).items()}


def _seeded(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``run`` after reseeding, so every timed step draws the same dropout masks."""

    def seeded() -> torch.Tensor:
        torch.manual_seed(SEED)
        return run()

    return seeded


def _tracked_peak(model: nn.Module, run: Callable, inputs: tuple) -> tuple[int, int]:
    """(peak bytes with parameters and inputs, bytes of parameters and inputs), by the tracker."""
    model.zero_grad(set_to_none=True)
    measured = measure_peak(run, track=(list(model.parameters()), inputs))
    return measured.peak_bytes, measured.start_bytes


def _prepare(result: ModelResult, methods_: list[Method], inputs: tuple,
             log: Callable[[str], None]) -> list[tuple[Row, nn.Module, Callable]]:
    """Warm up and measure the tracker peak of each method; the first that runs is the reference."""
    prepared = []
    for method in methods_:
        log(f"recompute {result.name}: {method.name}")
        row, model, run, step = _warm_up(method, result.reference_gradients)
        result.rows.append(row)
        if run is None:
            continue
        if result.reference_gradients is None:
            result.reference_gradients = _unwrapped_gradients(model)
        if step is not None and result.graph_step is None:
            result.graph_step = step
        row.peak_bytes, start_bytes = _tracked_peak(model, run, inputs)
        result.eager_peak_bytes.setdefault("tracker", row.peak_bytes)
        result.eager_peak_bytes.setdefault("start", start_bytes)
        prepared.append((row, model, _seeded(run)))
    return prepared


def _tracked_rows(result: ModelResult, tracked: list[Method], inputs: tuple, repeats: int,
                  log: Callable[[str], None],
                  copies: Callable[[ModelResult], list[Method]] = lambda result: [],
                  ) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """Warm up and measure the peak of every tracker-measured method, then of ``copies(result)``
    (the optimal rows at the peaks just measured), then time them all in turn.

    Returns:
        eager's model and run, for the compiled methods to be timed beside; its peak and the bytes of
        parameters and inputs land in ``result.eager_peak_bytes``.
    """
    timed = _prepare(result, tracked, inputs, log)
    graph = result.graph_step.graph if result.graph_step is not None else None
    for method in tracked:
        if method.blocks and graph is not None:
            (row,) = [r for r in result.rows if r.name == method.name]
            row.predicted_recompute_s = block_recompute_s(graph, method.blocks)
    timed += _prepare(result, copies(result), inputs, log)
    log(f"recompute {result.name}: timing {len(timed)} methods in turn")
    medians = interleaved_medians_s([run for _, _, run in timed], repeats=repeats)
    for (row, _, _), median in zip(timed, medians, strict=True):
        row.step_time_s, row.eager_step_time_s = median, medians[0]
    return timed[0][1], timed[0][2]


def _profiled_peak(model: nn.Module, run: Callable, start_bytes: int) -> int:
    """Peak bytes with parameters and inputs, by the profiler (compiled code runs under it)."""
    model.zero_grad(set_to_none=True)
    return start_bytes + profiled_peak_above_start(run)


def _compiled_rows(result: ModelResult, compiled: list[Method], eager_run: Callable,
                   eager_model: nn.Module, repeats: int, log: Callable[[str], None],
                   copy: Callable[[int, str], Method] | None = None) -> None:
    """Each compiled method alone (its own dynamo cache), timed in turn with eager; with ``copy``,
    and with ``copy(budget, name)`` (the optimal schedule) at its peak when that is below eager's.

    Note:
        The profiler sees bytes the tracker cannot (kernel workspaces: 3D convolution's im2col
        buffers), so a compiled row's peak is moved into memfit's (the tracker's) frame by eager's
        difference between the two before it becomes a budget, and the optimal row is measured
        by the profiler, like the row it copies.
    """
    start_bytes = result.eager_peak_bytes["start"]
    if compiled:
        peak_bytes = _profiled_peak(eager_model, eager_run, start_bytes)
        result.eager_peak_bytes["profiler"] = peak_bytes
        result.rows.append(Row("eager", EAGER_BY_PROFILER, "profiler", peak_bytes,
                               gradients="reference"))
    for method in compiled:
        log(f"recompute {result.name}: {method.name}")
        row, model, run, _ = _warm_up(method, result.reference_gradients)
        result.rows.append(row)
        if run is None:
            continue
        row.peak_bytes = _profiled_peak(model, run, start_bytes)
        runs, rows = [eager_run, _seeded(run)], [row]
        eager_profiled = result.eager_peak_bytes["profiler"]
        if copy is not None and row.peak_bytes < eager_profiled:
            budget = row.peak_bytes - (eager_profiled - result.eager_peak_bytes["tracker"])
            optimal = copy(budget, method.name)
            log(f"recompute {result.name}: {optimal.name}")
            optimal_row, optimal_model, optimal_run, _ = _warm_up(optimal,
                                                                  result.reference_gradients)
            result.rows.append(optimal_row)
            if optimal_run is not None:
                optimal_row.peak_bytes = _profiled_peak(optimal_model, optimal_run, start_bytes)
                runs.append(_seeded(optimal_run))
                rows.append(optimal_row)
        eager_s, *medians = interleaved_medians_s(runs, repeats)
        for timed_row, median in zip(rows, medians, strict=True):
            timed_row.step_time_s, timed_row.eager_step_time_s = median, eager_s
    torch._dynamo.reset()


def measure_model(bench: RecomputeModel, log: Callable[[str], None],
                  fractions: Sequence[float] = BUDGET_FRACTIONS,
                  compile_budgets: Sequence[float] = COMPILE_BUDGETS,
                  repeats: int = REPEATS, optimal_options: dict | None = None) -> ModelResult:
    """Every method's row for one model (eager's row first).

    Args:
        optimal_options: ``optimal-recompute`` parameters for the rows at other methods' peaks
            and at its minimum (the tests' tiny models ask for a short MILP time limit).
    """
    extra = dict(optimal_options or {})
    example = bench.build()
    inputs = example.inputs(bench.batch_size)
    paths = block_paths(example.model, bench.block_types)
    if not paths:
        raise ValueError(f"{bench.name}: no module of types {bench.block_types}")
    every = methods(example, inputs, paths, fractions, compile_budgets)
    result = ModelResult(bench.name)
    tracked = [m for m in every if m.peak_method == "tracker"]
    optimal = OPTIMAL in memfit.strategy_names()

    def copies(result: ModelResult) -> list[Method]:
        """The optimal schedule at each tracked alternative's peak, then at its own minimum."""
        if not optimal:
            return []
        found = [optimal_at(example, inputs, copied_budget(row), row.name, **extra)
                 for row in result.rows
                 if row.family in COPIED_FAMILIES and row.peak_bytes is not None]
        minimum = (optimal_minimum_bytes(result.graph_step, inputs)
                   if result.graph_step is not None else None)
        if minimum is not None:
            found.append(optimal_at(example, inputs, minimum, **extra))
        return found

    eager_model, eager_run = _tracked_rows(result, tracked, inputs, repeats, log, copies)
    compiled = [m for m in every if m.peak_method == "profiler"]
    copy = ((lambda budget, name: optimal_at(example, inputs, budget, name, "profiler", **extra))
            if optimal else None)
    _compiled_rows(result, compiled, eager_run, eager_model, repeats, log, copy)
    order = {m.name: index for index, m in enumerate(every)} | {EAGER_BY_PROFILER: 0.5}

    def position(row: Row) -> tuple:  # the methods, then the optimal rows in their copies' order
        if row.name in order:
            return (0, order[row.name])
        return (1, order[row.copies]) if row.copies else (2, 0)

    result.rows.sort(key=position)
    return result


RECOMPUTE_HEADERS = ("method", "measured peak", "% of eager", "measured by",
                     f"step time (median of {REPEATS})", "x eager", "memfit predicted peak",
                     "gradients vs eager")


def render_rows(result: ModelResult) -> list[tuple]:
    """Table rows; a method that did not run shows why in place of its peak."""
    rendered = []
    for row in result.rows:
        if row.peak_bytes is None:
            rendered.append((row.name, row.note, "-", row.peak_method, "-", "-", "-", "-"))
            continue
        eager_bytes = result.eager_peak_bytes.get(row.peak_method)
        share = f"{row.peak_bytes / eager_bytes:.0%}" if eager_bytes else "-"
        ratio = (f"{row.step_time_s / row.eager_step_time_s:.2f}x"
                 if row.step_time_s and row.eager_step_time_s else "-")
        predicted = mib(row.predicted_bytes) if row.predicted_bytes is not None else "-"
        step = ms(row.step_time_s) if row.step_time_s is not None else "-"
        rendered.append((row.name, mib(row.peak_bytes), share, row.peak_method, step, ratio,
                         predicted, row.gradients))
    return rendered


VERDICT_HEADERS = ("alternative", "its peak", "optimal's budget (memfit frame)", "optimal's peak",
                   "peak <=", "step time: alternative / optimal", "step time <=",
                   "predicted recompute: alternative / optimal", "recompute <=", "optimal's solver")


def _at_most(mine: float | None, theirs: float | None, slack: float = 0.0) -> str:
    if mine is None or theirs is None:
        return "-"
    return "yes" if mine <= theirs * (1 + slack) + 1e-12 else "**no**"


def verdict(result: ModelResult) -> tuple[list[tuple], list[str]]:
    """The optimal row at each alternative's peak against that alternative, computed.

    Returns:
        the verdict table's rows, and summary lines (counts of "yes", the minimum, the solvers).
    """
    by_name = {row.name: row for row in result.rows}
    rows, peaks, times, recomputes = [], [], [], []
    for optimal in (row for row in result.rows if row.copies):
        other = by_name[optimal.copies]
        budget = mib(optimal.budget_bytes) if optimal.budget_bytes is not None else "-"
        if optimal.peak_bytes is None:
            rows.append((other.name, mib(other.peak_bytes), budget, optimal.note, "**no**", "-",
                         "-", "-", "-", "-"))
            peaks.append("**no**")
            continue

        def pair(a: float | None, b: float | None, show: Callable[[float], str]) -> str:
            return f"{show(a) if a is not None else 'n/a'} / {show(b) if b is not None else 'n/a'}"

        peak_ok = _at_most(optimal.peak_bytes, other.peak_bytes)
        time_ok = _at_most(optimal.step_time_s, other.step_time_s)
        recompute_ok = _at_most(optimal.predicted_recompute_s, other.predicted_recompute_s)
        peaks.append(peak_ok)
        times.append(time_ok)
        recomputes.append(recompute_ok)
        rows.append((other.name, mib(other.peak_bytes), budget,
                     f"{mib(optimal.peak_bytes)} ({optimal.peak_method})", peak_ok,
                     pair(other.step_time_s, optimal.step_time_s, ms), time_ok,
                     pair(other.predicted_recompute_s, optimal.predicted_recompute_s, ms),
                     recompute_ok, optimal.solver or "-"))

    def count(found: list[str]) -> str:
        priced = [f for f in found if f != "-"]
        return f"{priced.count('yes')} of {len(priced)}"

    lines = [f"Verdict, computed from the rows above (the budget: the alternative's peak in "
             f"memfit's frame, its predicted peak where it is a memfit plan): at each of {len(peaks)} other methods' "
             f"measured peaks, the optimal schedule's measured peak is at or below it for "
             f"{count(peaks)}; its predicted recompute time (the planner's objective, memfit's "
             f"cost model) is at or below the alternative's for {count(recomputes)} (those "
             f"memfit can price: its own plans, and torch.utils.checkpoint as every forward op of "
             f"the wrapped blocks; torch.compile's partition is not priced); its measured step "
             f"time is at or below for {count(times)}. Step times are medians of {REPEATS} on a "
             f"shared 2-core CPU: differences of a few percent are noise."]
    minimum = [row for row in result.rows if row.family == "optimal" and not row.copies
               and row.name.endswith("at its minimum")]
    eager = result.eager_peak_bytes.get("tracker")
    for row in minimum:
        if row.peak_bytes is None:
            lines.append(f"At its own minimum ({mib(row.budget_bytes or 0)}): {row.note}.")
            continue
        share = f", {row.peak_bytes / eager:.0%} of eager" if eager else ""
        lines.append(f"At its own minimum, a budget of {mib(row.budget_bytes or 0)}: measured "
                     f"peak {mib(row.peak_bytes)}{share}, step time {ms(row.step_time_s or 0)}, "
                     f"predicted recompute {ms(row.predicted_recompute_s or 0)}, solver "
                     f"`{row.solver or '-'}`.")
    keep = by_name.get('memfit "keep"')
    if keep is not None and keep.step_time_s and keep.eager_step_time_s:
        lines.append(f'memfit "keep" (no recomputation, no swapping) ran at '
                     f"{keep.step_time_s / keep.eager_step_time_s:.2f}x eager's step time here: "
                     "memfit's executor overhead, which every memfit row pays on top of its "
                     "recomputation and torch.utils.checkpoint / torch.compile do not.")
    solvers = sorted({row.solver for row in result.rows if row.family == "optimal" and row.solver})
    lines.append("Solvers that won (`plan.params[\"solver\"]`) across this model's optimal rows: "
                 + (", ".join(f"`{name}`" for name in solvers) or "none") + ".")
    return rows, lines


RECOMPUTE_MODELS = (
    RecomputeModel("GPT-2 (6 layers, width 192, sequence 256, batch 4)",
                   lambda: examples.gpt2(layers=6, width=192, heads=4, vocab=256, sequence=256), 4,
                   ("GPT2Block",), "a transformer block `transformer.h.<i>` (6)"),
    RecomputeModel("ResNet-50-shaped (stage widths 32-256, 128x128 images, batch 4)",
                   lambda: examples.resnet50_shaped(widths=(32, 64, 128, 256), image=128), 4,
                   ("ResNetBottleNeckLayer",),
                   "a bottleneck layer `resnet.encoder.stages.<i>.layers.<j>` (16)"),
    RecomputeModel("3D U-Net (MONAI, channels 4-32, 48^3 volumes, batch 2)",
                   lambda: examples.unet3d(channels=(4, 8, 16, 32), size=48), 2,
                   ("ResidualUnit", "Convolution"),
                   "a MONAI `ResidualUnit` (4 down, 3 up) or an up-sampling `Convolution` "
                   "(3), outermost only"),
)


def recompute_section(log: Callable[[str], None], plot_path=None,
                      models: Sequence[RecomputeModel] = RECOMPUTE_MODELS) -> str:
    """The Markdown section of RESULTS.md; draws the curves to ``plot_path`` when given."""
    results, parts = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see SINGLE_THREAD_NOTE
    try:
        for bench in models:
            started = time.perf_counter()
            results.append(measure_model(bench, log))
            log(f"recompute {bench.name}: {time.perf_counter() - started:.0f} s")
    finally:
        torch.set_num_threads(threads)
    for bench, result in zip(models, results, strict=True):
        parts += [f"\n### {bench.name}\n", f"A block is {bench.block_description}.\n",
                  table(RECOMPUTE_HEADERS, render_rows(result))]
        verdict_rows, lines = verdict(result)
        if verdict_rows:
            parts += ["\n" + lines[0] + "\n", table(VERDICT_HEADERS, verdict_rows),
                      "\n" + " ".join(lines[1:]) + "\n"]
    if plot_path is not None:
        from bench.recompute_plot import plot

        plot(results, plot_path)
    if OPTIMAL not in memfit.strategy_names():
        log(f"recompute: strategy {OPTIMAL!r} is not available yet; no optimal rows")
    optimal = (f"The `{OPTIMAL}` rows plan the least recompute time that fits: Checkmate's MILP "
               "on graphs of up to 100 ops, a DP over separator blocks above (these models have "
               "hundreds to a thousand ops), and the checkpoint \"memory\" / \"speed\" plans "
               "priced beside it; the verdict names the solver that won. They run at the same "
               "fractions as memfit's budgets, then, after the other methods are measured, at "
               "the measured peak of each torch.utils.checkpoint row, each memfit checkpoint "
               "mode and each torch.compile row below eager, as a budget in bytes (memfit's "
               "budget, like the tracker's peak, counts parameters and inputs; a compiled row's "
               "profiler peak is first lowered by eager's profiler-minus-tracker difference, "
               "and the optimal row beside it is measured by the profiler and timed in the "
               "compiled row's group), and at its own minimum (the strategy's "
               "`BudgetError.minimum_bytes` for a 1-byte budget on the captured graph)." if
               OPTIMAL in memfit.strategy_names() else f"The optimal schedule (`{OPTIMAL}`) is "
               "not available in this build: no rows for it.")
    intro = [
        "## Recomputation: memory / step-time curves\n",
        "On this CPU, where recomputing costs real time. Per model, one process, one batch, one "
        "seed. Measured peak: the step's device bytes, parameters and inputs included, by "
        "memfit's dispatch tracker, or for torch.compile by the profiler's allocator events (a "
        "dispatch mode disables compiled code) plus the same parameter and input bytes; % of "
        "eager compares with eager measured the same way. Step time: the median of "
        f"{REPEATS} steps after a warm-up, the tracker's methods timed in turn (a, b, c, a, ...), "
        "each compiled method in turn with eager, so `x eager` compares within one group. "
        "Memfit budgets are fractions of the unplanned (predicted) peak; memfit runs with "
        "`measure=False`. " + SINGLE_THREAD_NOTE + " " + optimal,
        f"\n![memory / step-time curves]({Path(plot_path).name if plot_path else 'recompute.png'})"
        "\n",
    ]
    return "\n".join(intro + parts)
