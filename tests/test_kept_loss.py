"""A loop keeps its loss into the next iteration (``last = loss``, ``losses.append(loss)``, or
just ``loss = model(...)``, which rebinds only once the call returns): the loss the model
returns is alive beside the next iteration's regions, and every plan counts it from the first.
So fitting at exactly a ``BudgetError``'s ``minimum_bytes`` runs every iteration within it, but for
what a list of losses adds each iteration (the loop's own bytes)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak


class _Regression(nn.Module):
    """Tanh layers with the loss computed inside, as ``labels=`` does."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                      for _ in range(depth)])

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), target)


def _loop(model, optimizer, keep: str, iterations: int = 4):
    """Losses and measured peaks of an AdamW loop that keeps its loss as ``keep`` says."""
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(512, 128, generator=generator),
                torch.randn(512, 128, generator=generator)) for _ in range(iterations)]
    kept: list[torch.Tensor] = []
    peaks = []
    for x, target in batches:
        def iteration(x=x, target=target):
            loss = model(x, target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        measured = measure_allocator_peak(
            iteration, track=(list(model.parameters()), optimizer.state, x, target, kept))
        if keep == "list":
            kept.append(measured.result)
        else:
            kept[:] = [measured.result]
        peaks.append(measured.peak_bytes)
    return [loss.detach() for loss in kept], peaks


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["last", "list"])
def test_fitting_at_the_stated_minimum_runs_every_iteration_of_a_loop_keeping_its_loss(keep):
    torch.use_deterministic_algorithms(True)
    reference = _Regression()
    reference_losses, eager_peaks = _loop(reference, torch.optim.AdamW(reference.parameters()),
                                          keep)
    model = _Regression()
    optimizer = torch.optim.AdamW(model.parameters())
    refused = memfit.fit(model, budget=int(0.4 * max(eager_peaks)), optimizer=optimizer)
    with pytest.raises(memfit.BudgetError) as error:
        _loop(refused, optimizer, keep, iterations=1)
    minimum_bytes = error.value.minimum_bytes
    assert all(p.grad is None for p in model.parameters())  # refused before anything ran

    fitted = memfit.fit(model, budget=minimum_bytes, optimizer=optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, peaks = _loop(fitted, optimizer, keep)
    said = [str(w.message) for w in caught if issubclass(w.category, memfit.BudgetWarning)]
    assert not said, said
    # one kept loss is planned for; a list keeps one more each iteration, the loop's own bytes
    loss_bytes = losses[0].untyped_storage().nbytes()
    beyond = [max(0, index - 1) * loss_bytes if keep == "list" else 0
              for index in range(len(peaks))]
    assert all(peak - extra <= minimum_bytes for peak, extra in zip(peaks, beyond, strict=True)), (
        peaks, minimum_bytes)
    assert all(torch.equal(mine, theirs)
               for mine, theirs in zip(losses, reference_losses, strict=True))
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
