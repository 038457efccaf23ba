"""A swap plan is never worse than keeping everything: keep is a swap plan with no swaps, so
``swap``'s smallest peak is at most the unplanned peak (``memfit plan --model mlp --budget 0.6
--strategy swap`` once named a smallest peak above it)."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import examples


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["h100-pcie", "cpu"])
def test_swaps_smallest_peak_is_at_most_the_unplanned_peak(hardware):
    example = examples.mlp(depth=6, width=64, batch_size=256)
    inputs = tuple(torch.empty_like(t, device="meta") for t in example.inputs())
    kept = memfit.plan(example.model, example.loss_fn, *inputs, strategy="keep",
                       hardware=hardware)
    unplanned = kept.explanation.baseline_peak_bytes
    with pytest.raises(memfit.BudgetError) as refused:
        memfit.plan(example.model, example.loss_fn, *inputs, budget=2, strategy="swap",
                    hardware=hardware)
    smallest = refused.value.minimum_bytes
    assert smallest <= unplanned, (smallest, unplanned)
    fitted = memfit.plan(example.model, example.loss_fn, *inputs, budget=smallest,
                         strategy="swap", hardware=hardware)
    assert fitted.explanation.peak_bytes <= min(smallest, unplanned)
