"""memfit.fit on real models in the user's loop (forward, ``loss.backward()``, AdamW step, two
iterations), auto at half of *eager's* measured iteration peak, or at auto's true minimum where
half does not fit.

Claims, per model:
- always: losses and weights after the loop bit for bit eager's (deterministic algorithms on);
- where ``BUDGET_HOLDS``: every iteration's measured peak (the first included, AdamW state
  included) within the budget. Where it does not, the cause is measured and named: CPU
  oneDNN convolutions allocate activation-sized scratch buffers inside the op
  (``memfit/graph/temporaries.py`` models 2D forward and backward and batch norm, so the CNN
  holds at auto's minimum; 3D and transposed convolutions' backward buffers, the U-Net's, are
  not modelled yet: ``python -m bench.kernel_survey unet3d`` lists them).
"""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]

BUDGET_HOLDS = {"llama": True, "t5": True, "cnn": True, "unet3d": False}
BUILDERS = {"llama": examples.llama, "t5": examples.t5, "cnn": examples.cnn,
            "unet3d": lambda: examples.unet3d(channels=(4, 8, 16), size=16)}


def train(example, model, runner=None, iterations: int = 2):
    optimizer = torch.optim.AdamW(model.parameters())
    runner = runner(model, optimizer) if runner else model
    inputs = example.inputs()
    losses, peaks = [], []
    for index in range(iterations):
        def iteration(index=index):
            torch.manual_seed(100 + index)
            loss = example.loss_fn(runner, *inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        measured = measure_allocator_peak(
            iteration, track=(list(model.parameters()), list(model.buffers()), optimizer.state,
                              inputs))
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fit_trains_real_models_as_eager(name):
    example = BUILDERS[name]()
    reference = copy.deepcopy(example.model)
    reference_losses, eager_peaks = train(example, reference)
    model = copy.deepcopy(example.model)
    budget = int(0.5 * max(eager_peaks))

    def fitted(model, optimizer, budget_bytes=budget):
        return memfit.fit(model, budget=budget_bytes, optimizer=optimizer)

    try:
        losses, peaks = train(example, model, fitted)
    except memfit.BudgetError as error:  # half does not fit: auto's minimum must
        assert error.minimum_bytes > budget
        budget = error.minimum_bytes
        model = copy.deepcopy(example.model)
        losses, peaks = train(example, model, lambda m, o: fitted(m, o, budget))
    for loss, expected in zip(losses, reference_losses, strict=True):
        assert torch.equal(loss, expected)
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected)
    for buffer, expected in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(buffer, expected)
    if BUDGET_HOLDS[name]:
        assert max(peaks) <= budget, (peaks, budget)
