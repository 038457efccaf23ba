"""The model's gradients between a forward and its backward: PyTorch's examples call
``optimizer.zero_grad()`` after the forward, so the previous step's gradients are alive over the
forward and gone before the backward makes new ones; an accumulating loop keeps them through it.
A plan counts them once either way (``memfit.compiler.dropped_gradients``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.data.errors import BudgetWarning
from memfit.runtime.measure import measure_allocator_peak

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 512), nn.LeakyReLU(0.2), nn.Linear(512, 512),
                         nn.LeakyReLU(0.2), nn.Linear(512, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(1024, 128, generator=torch.Generator().manual_seed(index)),
             torch.randn(1024, 1, generator=torch.Generator().manual_seed(index + 10)))
            for index in range(4)]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, accumulate: bool
           ) -> tuple[list[int], list[torch.Tensor]]:
    """Each iteration's measured peak and loss: zero_grad between the forward and the backward,
    or (``accumulate``) a step and zero_grad after every second backward."""
    peaks, losses = [], []
    def step(inputs: torch.Tensor, targets: torch.Tensor, stepping: bool) -> torch.Tensor:
        loss = F.mse_loss(model(inputs), targets)
        if not accumulate:
            optimizer.zero_grad()
        loss.backward()
        if stepping:
            optimizer.step()
            if accumulate:
                optimizer.zero_grad()
        return loss.detach()

    for iteration, (inputs, targets) in enumerate(_batches()):
        stepping = not accumulate or iteration % 2 == 1
        measured = measure_allocator_peak(step, inputs, targets, stepping,
                                          track=(list(model.parameters()), optimizer.state))
        peaks.append(measured.peak_bytes)
        losses.append(measured.result)
    return peaks, losses


@pytest.mark.parametrize("accumulate", [False, True], ids=["zero_grad-before-backward",
                                                           "accumulating"])
def test_gradients_the_loop_drops_before_the_backward_are_counted_once(accumulate):
    eager = _critic()
    eager_peaks, eager_losses = _train(eager, torch.optim.Adam(eager.parameters()), accumulate)
    budget = int(0.9 * max(eager_peaks))  # first plan's peak 0.87 of it, gradients counted once
    model = _critic()
    optimizer = torch.optim.Adam(model.parameters())
    memfit.fit(model, budget=budget, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        peaks, losses = _train(model, optimizer, accumulate)
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(losses, eager_losses,
                                                                  strict=True))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 512), nn.GELU(),
                                                  nn.Linear(512, 128)) for _ in range(4))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_a_micro_batch_of_another_shape_is_not_planned_on_the_guess_its_code_disproved():
    """Three micro-batches per step, the last smaller (Dynamo traces the forward again with
    symbolic sizes, then again past that bound: new programs of the same code). The first
    program's second call showed the gradients kept; a later program of the same code whose
    second call cannot fit beside them is refused before it runs. Before, it was planned on the
    guess that the loop drops them, ran 1.7 MiB over the budget and said so after."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(2048, 128, generator=generator),
             torch.randint(0, 10, (2048,), generator=generator)) for _ in range(2)]

    def iteration(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for rows in (slice(0, 900), slice(900, 1800), slice(1800, None)):
            loss = F.cross_entropy(model(x[rows]), y[rows]) * x[rows].shape[0] / x.shape[0]
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        return total

    def measured(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> int:
        return measure_allocator_peak(iteration, model, optimizer, *batch,
                                      track=(list(model.parameters()), optimizer.state,
                                             *batch)).peak_bytes

    eager = _Residual()
    eager_optimizer = torch.optim.AdamW(eager.parameters())
    budget = int(0.575 * max(measured(eager, eager_optimizer, batch) for batch in data))
    model = _Residual()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        assert measured(fitted, optimizer, data[0]) <= budget
        with pytest.raises(memfit.BudgetError, match="smallest peak it can reach") as refused:
            measured(fitted, optimizer, data[1])
    assert refused.value.minimum_bytes > budget
