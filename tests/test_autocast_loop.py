"""A user's AdamW loop under ``torch.autocast`` (bf16 on the CPU), with gradient clipping.

Compiled autocast casts the backward's gradients where eager autocast does not, so plain
``torch.compile(backend="aot_eager")`` is already a few ulps from eager from the second step; the
reference for memfit under autocast is that compiled loop, bit for bit, and every iteration's
measured peak stays within the budget."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak


def _loop(model, optimizer, batch, iterations: int = 3):
    """Each iteration's loss and measured peak (gradients and optimizer state tracked)."""
    input_ids, labels = batch
    torch.manual_seed(1)

    def iteration():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    results = []
    for _ in range(iterations):
        measured = measure_allocator_peak(
            iteration, track=(list(model.parameters()), optimizer.state, input_ids, labels))
        results.append((measured.result, measured.peak_bytes))
    return results


@pytest.mark.slow
def test_a_bf16_autocast_loop_is_bitwise_torch_compiles_within_the_budget():
    torch.use_deterministic_algorithms(True)
    example = examples.gpt2(layers=2, width=64, heads=2, vocab=128, sequence=64)
    batch = example.inputs(8)
    runs = {}
    for method in ("eager", "torch.compile", "memfit"):
        model = copy.deepcopy(example.model)
        optimizer = torch.optim.AdamW(model.parameters())
        if method == "torch.compile":
            model.compile(backend="aot_eager")
        if method == "memfit":
            budget_bytes = int(0.6 * max(peak for _, peak in runs["eager"][1]))
            memfit.fit(model, budget=budget_bytes, optimizer=optimizer)
        runs[method] = (model, _loop(model, optimizer, batch))

    compiled_model, compiled = runs["torch.compile"]
    fitted_model, fitted = runs["memfit"]
    fitted_peaks = [peak for _, peak in fitted]
    assert max(fitted_peaks) <= budget_bytes, (fitted_peaks, budget_bytes)
    for (compiled_loss, _), (fitted_loss, _) in zip(compiled, fitted, strict=True):
        assert torch.equal(compiled_loss, fitted_loss)
    for compiled_weight, fitted_weight in zip(compiled_model.parameters(),
                                              fitted_model.parameters(), strict=True):
        assert torch.equal(compiled_weight, fitted_weight)
