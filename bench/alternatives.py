"""GPT-2 side by side, in one run: what a user could pick instead of memfit, and memfit.

Every method trains the same weights on the same batch with the same seed; gradients are compared
with eager's. Peaks are bytes above the start of the step: memfit's dispatch tracker for eager,
checkpointing and memfit (on a CPU it counts device bytes only, not memfit's host copies), and the
profiler's allocator events for torch.compile, whose code a dispatch mode would disable.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from bench.common import (
    compare_gradients,
    compiled_step,
    eager_step,
    gradients,
    median_time_s,
    memfit_step,
    mib,
    ms,
    profiled_peak_above_start,
    tracked_peak_above_start,
)
from memfit import examples

SEED = 0


def _methods(example: examples.Example, inputs: tuple) -> list[tuple[str, str, Callable]]:
    """(name, peak method, builder) per method; a builder returns (model, run) on a fresh copy."""

    def eager():
        model = copy.deepcopy(example.model)
        return model, eager_step(model, example.loss_fn, inputs)

    def checkpointing():
        model = copy.deepcopy(example.model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model, eager_step(model, example.loss_fn, inputs)

    def compiled():
        return compiled_step(example, inputs, 0.5)

    def planned(**options):
        return lambda: memfit_step(example, inputs, **options)[:2]

    return [
        ("eager", "tracker", eager),
        ("transformers gradient checkpointing, every block", "tracker", checkpointing),
        ('torch.compile(backend="aot_eager"), activation_memory_budget 0.5', "profiler",
         compiled),
        ('memfit strategy="keep"', "tracker", planned(strategy="keep")),
        ('memfit strategy="swap", budget 0.5', "tracker", planned(strategy="swap", budget=0.5)),
    ]


def _measure(name: str, peak_method: str, build: Callable, inputs: tuple,
             reference: tuple | None) -> tuple[tuple, tuple]:
    """One row, and (loss, gradients) of the warm-up step for the rows after it to compare."""
    model, run = build()
    torch.manual_seed(SEED)
    loss = run()  # warm-up: compiles, captures and plans; its loss and gradients are compared
    grads = gradients(model)
    if reference is None:
        same_loss = same = "reference"
    else:
        same_loss = "bitwise" if torch.equal(reference[0], loss) else f"differs ({loss.item():.6g})"
        same = compare_gradients(reference[1], grads)
    step_s = median_time_s(lambda: (torch.manual_seed(SEED), run()), repeats=5)
    if peak_method == "profiler":
        model.zero_grad(set_to_none=True)
        peak = profiled_peak_above_start(run)
    else:
        peak = tracked_peak_above_start(run, model, inputs)
    return (name, mib(peak), peak_method, ms(step_s), same_loss, same), (loss, grads)


def alternative_rows(example: examples.Example, batch: int,
                     log: Callable[[str], None]) -> list[tuple]:
    """One row per method; a method that fails gets a row saying why instead of a crash."""
    inputs = example.inputs(batch)
    rows, reference = [], None
    for name, peak_method, build in _methods(example, inputs):
        log(f"side by side: {name}")
        try:
            row, outcome = _measure(name, peak_method, build, inputs, reference)
        except Exception as error:  # a bench must report a failing method, not stop
            message = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            rows.append((name, "failed", "-", "-", "-", f"{type(error).__name__}: {message}"))
            continue
        reference = outcome if reference is None else reference  # eager's (loss, gradients)
        rows.append(row)
    return rows


ALTERNATIVE_HEADERS = ("method", "peak above start (measured)", "measured by",
                       "step time (median of 5)", "loss vs eager", "gradients vs eager")
