"""Measuring the recomputation benchmark's methods: warm-up, peaks, interleaved step times.

Part of the recomputation section (``bench/recompute.py``; the methods are in
``bench/recompute_methods.py``). Peaks are the step's device bytes: parameters and inputs plus
the step's own peak above them, by memfit's dispatch tracker, or by the profiler's allocator
events for compiled code (a dispatch mode would disable it). Step times are medians of timed
steps run in turn (a, b, c, a, b, c, ...) after a warm-up, so that the load of a shared machine
falls on every method alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

import memfit
from bench.common import (
    compare_gradients,
    gradients,
    interleaved_medians_s,
    mib,
    profiled_peak_above_start,
)
from bench.recompute_methods import (
    BUDGET_FRACTIONS,
    COMPILE_BUDGETS,
    COPIED_FAMILIES,
    EAGER_BY_PROFILER,
    OPTIMAL,
    REPEATS,
    SEED,
    Method,
    ModelResult,
    RecomputeModel,
    Row,
    block_paths,
    block_recompute_s,
    copied_budget,
    methods,
    optimal_at,
    optimal_minimum_bytes,
)
from memfit.data.errors import BudgetError
from memfit.runtime.measure import measure_peak


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


def _warm_up_into(result: ModelResult, method: Method, log: Callable[[str], None]):
    """``_warm_up`` against ``result``'s reference gradients, logged, its row added to ``result``:
    how every measured method starts."""
    log(f"recompute {result.name}: {method.name}")
    row, model, run, step = _warm_up(method, result.reference_gradients)
    result.rows.append(row)
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
        row, model, run, step = _warm_up_into(result, method, log)
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
        row, model, run, _ = _warm_up_into(result, method, log)
        if run is None:
            continue
        row.peak_bytes = _profiled_peak(model, run, start_bytes)
        runs, rows = [eager_run, _seeded(run)], [row]
        eager_profiled = result.eager_peak_bytes["profiler"]
        if copy is not None and row.peak_bytes < eager_profiled:
            budget = row.peak_bytes - (eager_profiled - result.eager_peak_bytes["tracker"])
            optimal = copy(budget, method.name)
            optimal_row, optimal_model, optimal_run, _ = _warm_up_into(result, optimal, log)
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
