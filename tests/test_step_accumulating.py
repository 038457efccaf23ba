"""A ``memfit.compile`` step without an optimizer accumulates gradients into ``.grad``: from
its second call on they are resident beside the step, and the step is planned again before it
runs, so every call is within the budget (the gradients kept from earlier calls counted in the
measured peak, as the allocator's events alone would miss them)."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]


def _peaks(model, run, inputs, calls: int = 3) -> list[int]:
    peaks = []
    for _ in range(calls):
        kept = [p.grad for p in model.parameters() if p.grad is not None]  # made before
        measured = measure_allocator_peak(lambda: run(*inputs),
                                          track=(list(model.parameters()), kept, inputs))
        peaks.append(measured.peak_bytes)
    return peaks


def test_every_call_of_a_step_without_an_optimizer_is_within_the_budget():
    example = examples.mlp(depth=12, width=128, batch_size=256)
    inputs = example.inputs()
    reference = examples.mlp(depth=12, width=128, batch_size=256).model
    eager = _peaks(reference, lambda x, y: example.loss_fn(reference, x, y).backward(), inputs)
    budget = int(0.8 * max(eager))
    step = memfit.compile(example.model, example.loss_fn, budget=budget)
    peaks = _peaks(example.model, step, inputs)
    print(f"eager {eager}, budget {budget:,} B, step {peaks}")
    for parameter, expected in zip(example.model.parameters(), reference.parameters(),
                                   strict=True):
        assert torch.equal(parameter.grad, expected.grad)  # three calls accumulated
    assert max(peaks) <= budget, (peaks, budget)
