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

import memfit
from bench.common import (
    compare_gradients,
    eager_step,
    gradients,
    median_time_s,
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
        torch._dynamo.reset()
        model = copy.deepcopy(example.model)
        fast = torch.compile(model, backend="aot_eager")

        def run() -> None:
            model.zero_grad(set_to_none=True)
            with torch._functorch.config.patch(activation_memory_budget=0.5):
                example.loss_fn(fast, *inputs).backward()

        return model, run

    def planned(**options):
        def build():
            model = copy.deepcopy(example.model)
            step = memfit.compile(model, example.loss_fn, measure=False, **options)

            def run() -> None:
                model.zero_grad(set_to_none=True)
                step(*inputs)

            return model, run

        return build

    return [
        ("eager", "tracker", eager),
        ("transformers gradient checkpointing, every block", "tracker", checkpointing),
        ('torch.compile(backend="aot_eager"), activation_memory_budget 0.5', "profiler",
         compiled),
        ('memfit strategy="keep"', "tracker", planned(strategy="keep")),
        ('memfit strategy="swap", budget 0.5', "tracker", planned(strategy="swap", budget=0.5)),
    ]


def _measure(name: str, peak_method: str, build: Callable, inputs: tuple,
             reference: dict | None) -> tuple[tuple, dict]:
    model, run = build()
    torch.manual_seed(SEED)
    run()  # warm-up: compiles, captures and plans; its gradients are the ones compared
    grads = gradients(model)
    same = "reference" if reference is None else compare_gradients(reference, grads)
    step_s = median_time_s(lambda: (torch.manual_seed(SEED), run()))
    if peak_method == "profiler":
        model.zero_grad(set_to_none=True)
        peak = profiled_peak_above_start(run)
    else:
        peak = tracked_peak_above_start(run, model, inputs)
    return (name, mib(peak), peak_method, ms(step_s), same), grads


def alternative_rows(example: examples.Example, batch: int,
                     log: Callable[[str], None]) -> list[tuple]:
    """One row per method; a method that fails gets a row saying why instead of a crash."""
    inputs = example.inputs(batch)
    rows, reference = [], None
    for name, peak_method, build in _methods(example, inputs):
        log(f"side by side: {name}")
        try:
            row, grads = _measure(name, peak_method, build, inputs, reference)
        except Exception as error:  # a bench must report a failing method, not stop
            message = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            rows.append((name, "failed", "-", "-", f"{type(error).__name__}: {message}"))
            continue
        reference = grads if reference is None else reference
        rows.append(row)
    return rows


ALTERNATIVE_HEADERS = ("method", "peak above start (measured)", "measured by",
                       "step time (median)", "gradients vs eager")
