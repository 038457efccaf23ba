"""A loss computed in the loop whose own peak comes between the region's forward and backward:
a cross-entropy on large logits holds its log-softmax and, in its backward, the gradients of
both while the region's saves wait. No reading at a region's start sees that peak; the eager
watch's window does (``EagerWatch.open_window``), the iteration that ran without room for it
is warned about, and the next plan saves less (``gap_saves_cap``), so from then on the
measured peak is within the budget, training bit for bit eager's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from tests.test_replanning import _assert_same, _eager_loss_loop

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]

FRACTION = 0.93  # of eager's peak: above the region's smallest peak, below keep's


def _build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 1024))  # 1 MiB of logits at batch 256


def test_an_eager_loss_peak_between_forward_and_backward_is_warned_then_planned_for():
    generator = torch.Generator().manual_seed(1)
    inputs = (torch.randn(256, 128, generator=generator),
              torch.randint(0, 1024, (256,), generator=generator))
    loss_fn = nn.functional.cross_entropy
    reference = _build()
    reference_losses, eager_peaks = _eager_loss_loop(reference, None, inputs, iterations=4,
                                                     loss_fn=loss_fn)
    budget = int(FRACTION * max(eager_peaks))
    model, fitted = _build(), []
    with pytest.warns(memfit.BudgetWarning, match="between the forward and backward of region 0"):
        losses, peaks = _eager_loss_loop(model, lambda m, o: fitted.append(
            memfit.fit(m, budget=budget, optimizer=o)) or fitted[0], inputs, iterations=4,
            loss_fn=loss_fn)
    _assert_same(model, reference, losses, reference_losses)
    planner = fitted[0]._memfit_backend
    first, again = planner.regions
    logits = 256 * 1024 * 4
    print(f"budget {budget:,} B, eager {eager_peaks}, measured {peaks}, eager code's peak "
          f"between forward and backward {first.eager_gap_bytes:,} B")
    assert first.replaced and not again.replaced
    assert first.eager_gap_bytes >= 2 * logits  # the log-softmax and a gradient, at least
    assert again.planned_gap_bytes == first.eager_gap_bytes
    assert again.saved_bytes < first.saved_bytes  # room made by saving less
    assert max(peaks[1:]) <= budget, (peaks, budget)
