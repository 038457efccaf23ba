"""The backend's split program, predicted against the CPU allocator's measured peak."""

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak


def dropout_mlp(layers: int, width: int) -> nn.Module:
    """Dropout after every ReLU, the last one right before the output layer: the unplanned peak
    sits on that dropout's backward, whose CPU kernel allocates buffers of its own."""
    torch.manual_seed(0)
    blocks = [module for _ in range(layers)
              for module in (nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1))]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


@pytest.mark.parametrize("strategy, budget", [("keep", None), ("swap", 0.7)])
def test_predicted_region_peak_is_the_measured_one_with_dropout(strategy, budget):
    """Exact but for the scalar loss, which lives outside the region while backward runs."""
    model = dropout_mlp(layers=4, width=64)
    compiled = memfit.fit(model, budget=budget, strategy=strategy)
    inputs, targets = torch.randn(512, 64), torch.randn(512, 1)

    def iteration() -> torch.Tensor:
        loss = nn.functional.mse_loss(compiled(inputs), targets)
        loss.backward()
        return loss.detach()

    for _ in range(2):  # the first call compiles; the second runs what was compiled
        for parameter in model.parameters():
            parameter.grad = None
        measured = measure_allocator_peak(iteration, track=(list(model.parameters()), inputs, targets))
    region = compiled._memfit_backend.regions[0]
    loss_bytes = measured.result.nbytes
    assert 0 <= measured.peak_bytes - region.predicted_peak_bytes <= loss_bytes
