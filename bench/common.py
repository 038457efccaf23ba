"""Measuring helpers shared by the benchmark's sections: step times, peaks, gradient checks."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

from memfit.data.units import format_bytes
from memfit.runtime.measure import allocator_peak_above_start, measure_peak

REPEATS = 3  # timed runs per figure after one warm-up; the median is reported


def median_time_s(run: Callable[[], object], repeats: int = REPEATS,
                  synchronize: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``repeats`` calls of ``run`` (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def interleaved_medians_s(runs: list[Callable[[], object]], repeats: int = 5) -> list[float]:
    """Median wall time of each of ``runs``, timed in turn (a, b, a, b, ...).

    Note:
        On a shared machine the load changes within seconds; interleaving gives every run the
        same share of it, so their ratio means something even when the absolute times drift.
    """
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for index, run in enumerate(runs):
            started = time.perf_counter()
            run()
            times[index].append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def eager_step(model: torch.nn.Module, loss_fn: Callable,
               inputs: tuple) -> Callable[[], torch.Tensor]:
    """Plain PyTorch: ``loss_fn(model, *inputs).backward()`` with gradients cleared first."""

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, *inputs)
        loss.backward()
        return loss.detach()

    return run


def tracked_peak_above_start(run: Callable[[], object], model: torch.nn.Module,
                             inputs: tuple) -> int:
    """Device bytes ``run`` adds at its peak, by memfit's dispatch tracker (parameters and
    inputs registered as pre-existing). Compiled code does not run under it: see
    ``profiled_peak_above_start``."""
    model.zero_grad(set_to_none=True)
    return measure_peak(run, track=(list(model.parameters()), inputs)).above_start_bytes


def profiled_peak_above_start(run: Callable[[], object]) -> int:
    """Bytes ``run`` adds at its peak by the CPU allocator's own statistics (the profiler's
    ``[memory]`` events): how compiled runs are measured, since a dispatch mode disables them."""
    return allocator_peak_above_start(run)[1]


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}


def compare_gradients(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> str:
    """``bitwise`` if every gradient is ``torch.equal``, ``allclose`` if close, else ``differ``."""
    if reference.keys() != other.keys():
        return f"differ ({len(reference.keys() ^ other.keys())} gradients missing)"
    if all(torch.equal(reference[k], other[k]) for k in reference):
        return "bitwise"
    if all(torch.allclose(reference[k], other[k], rtol=1e-4, atol=1e-6) for k in reference):
        return "allclose"
    largest = max((reference[k] - other[k]).abs().max().item() for k in reference)
    return f"differ (max abs {largest:.2g})"


def mib(size_bytes: float) -> str:
    return format_bytes(size_bytes)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.3f} ms"


def compiled_step(example, inputs: tuple, budget: float) -> tuple[torch.nn.Module, Callable]:
    """A fresh copy under ``torch.compile(backend="aot_eager")`` with ``activation_memory_budget``.

    Returns ``(model, run)``; ``run()`` zeroes the gradients and does one step.

    Note:
        The budget is read when the joint graph is partitioned, at the first call, so this starts
        from ``torch._dynamo.reset()``: no graph compiled under another budget is reused.
    """
    torch._dynamo.reset()
    model = copy.deepcopy(example.model)
    compiled = torch.compile(model, backend="aot_eager")

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            loss = example.loss_fn(compiled, *inputs)
            loss.backward()
        return loss.detach()

    return model, run


def memfit_step(example, inputs: tuple, **options):
    """A fresh copy under ``memfit.compile`` with its tracker off (the bench measures from outside).

    Returns ``(model, run, step)``.
    """
    import memfit

    model = copy.deepcopy(example.model)
    step = memfit.compile(model, example.loss_fn, measure=False, **options)

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return step(*inputs).detach()

    return model, run, step
