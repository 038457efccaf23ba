"""memfit.measure_peak measures what runs: a fitted model's planned iteration, compiled, within
its budget and below the unplanned peak; the model keeps its plan after it. A user's dispatch
mode around a fitted call runs that call eagerly with a BudgetWarning, and later calls keep
their plans (Dynamo, met under a mode, would skip the compiled frame for good)."""

import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak
from memfit.runtime.tracker import DeviceMemoryTracker
from tests.measured_peaks import tolerance_bytes


class _WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU())
                                    for _ in range(12)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


def _fitted_iteration():
    """A fitted model at 0.75 of eager's peak, its iteration, what is resident beside it, the
    budget and eager's peak (both measured by ``memfit.measure_peak``)."""
    torch.manual_seed(0)
    model, x = _WithLoss(), torch.randn(512, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    eager_bytes = memfit.measure_peak(lambda: model(x).backward(),
                                      track=(list(model.parameters()), x))
    model.zero_grad(set_to_none=True)
    budget_bytes = int(0.75 * eager_bytes)
    fitted = memfit.fit(model, budget=budget_bytes, optimizer=optimizer)

    def iteration() -> None:
        fitted(x).backward()
        optimizer.step()
        optimizer.zero_grad()

    def resident() -> tuple:
        return list(model.parameters()), optimizer.state, x

    return iteration, resident, budget_bytes, eager_bytes


def _within(peak_bytes: int, budget_bytes: int) -> bool:
    return peak_bytes <= budget_bytes + tolerance_bytes(budget_bytes)


@pytest.mark.slow
def test_measure_peak_of_a_planned_iteration_is_within_its_budget_and_keeps_the_plan():
    iteration, resident, budget_bytes, eager_bytes = _fitted_iteration()
    for _ in range(2):  # the measured first iterations
        iteration()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        measured_bytes = memfit.measure_peak(iteration, track=resident())
    assert _within(measured_bytes, budget_bytes), (measured_bytes, budget_bytes)
    assert measured_bytes < eager_bytes
    for _ in range(2):
        later_bytes = measure_allocator_peak(iteration, track=resident()).peak_bytes
        assert _within(later_bytes, budget_bytes), (later_bytes, budget_bytes)
        assert later_bytes < eager_bytes


@pytest.mark.slow
def test_a_users_dispatch_mode_runs_one_call_eagerly_and_says_so():
    iteration, resident, budget_bytes, eager_bytes = _fitted_iteration()
    iteration()
    with pytest.warns(memfit.BudgetWarning, match="dispatch mode"):
        with DeviceMemoryTracker("cpu") as tracker:
            iteration()
    assert tracker.peak_bytes > 0
    later_bytes = measure_allocator_peak(iteration, track=resident()).peak_bytes
    assert _within(later_bytes, budget_bytes), (later_bytes, budget_bytes)
    assert later_bytes < eager_bytes
