"""A graph-broken model's regions planned jointly before its first iteration, on fake inputs
(``memfit.fitting.joint_first``): what the trace on fakes must leave as it was (buffers, the
random generator), and that a model without a graph break is not traced twice."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.data.errors import BudgetWarning
from tests.test_backend import (
    Broken,
    assert_same_training,
    batches,
    eager_reference,
    mlp,
    train,
)

pytestmark = pytest.mark.usefixtures("compiled_fresh")


class NormBroken(nn.Module):
    """Batch norm (running statistics, ``num_batches_tracked``) and dropout on both sides of a
    graph break."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = self.stack(last=False)
        self.second = self.stack(last=True)

    @staticmethod
    def stack(last: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1)]
        return nn.Sequential(*layers, *([nn.Linear(128, 1)] if last else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        torch._dynamo.graph_break()
        return self.second(hidden)


def _batches(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(2048, 128, generator=generator), torch.randn(2048, 1, generator=generator))
            for _ in range(count)]


@pytest.mark.slow
def test_the_trace_on_fakes_leaves_buffers_and_random_draws_as_eager_has_them():
    """The regions run on fakes with the real buffers before the first iteration: batch norm's
    ``num_batches_tracked`` must not count that run, and dropout must draw as eager does. After
    three AdamW iterations at 0.7 of eager's peak, the state dict (running statistics and counts
    included) and the losses equal eager's bit for bit, every peak within the budget."""
    data = _batches()
    reference = NormBroken()
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    reference_losses, eager_peaks = train(reference, reference_optimizer, data)
    model = NormBroken()
    optimizer = torch.optim.AdamW(model.parameters())
    budget = int(0.7 * max(eager_peaks))
    fitted = memfit.fit(model, budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        losses, peaks = train(fitted, optimizer, data)
    assert fitted._memfit_backend.joint_first_regions == 2
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses, strict=True))
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert int(model.first[1].num_batches_tracked) == len(data)
    assert max(peaks) <= budget, (peaks, budget)


def test_memfit_plan_leaves_the_models_buffers_as_they_were():
    """``memfit.plan`` traces the step on fakes with the model's real buffers: batch norm's
    count of batches stays what it was (it counted the planned step before)."""
    model = NormBroken()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    memfit.plan(model, lambda m, x: m(x).sum(), torch.randn(256, 128), budget=0.9)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_model_without_a_graph_break_is_traced_once():
    """One region, ended by its frame's return: no trace on fakes, one plan."""
    model = mlp(depth=2)
    fitted = memfit.fit(model, budget=None)
    fitted(torch.randn(64, 128)).sum().backward()
    planner = fitted._memfit_backend
    assert planner.joint_first_regions == 0 and not planner.joint_first_note
    assert len(planner.regions) == 1


@pytest.mark.slow
def test_a_ctrl_c_in_the_first_call_leaves_the_next_call_planned_jointly():
    """A ``KeyboardInterrupt`` from a forward hook in the first call (while the call is traced
    on fakes, or after): the loop catches it, and the next call is compiled anew and traced on
    fakes again, so its regions are planned jointly and every iteration fits, bitwise eager's."""
    data = batches(count=3, size=4096)
    reference, reference_losses, eager_peak = eager_reference(Broken, data)
    model = Broken()
    optimizer = torch.optim.AdamW(model.parameters())
    budget = int(0.76 * eager_peak)
    fitted = memfit.fit(model, budget=budget)
    interrupts = [KeyboardInterrupt()]

    def interrupt_once(module, inputs, output):
        if interrupts:
            raise interrupts.pop()

    hook = model.second.register_forward_hook(interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        fitted(data[0][0])
    assert all(parameter.grad is None for parameter in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        losses, peaks = train(fitted, optimizer, data)
    hook.remove()
    assert_same_training(model, reference, losses, reference_losses)
    planner = fitted._memfit_backend
    assert planner.joint_first_regions == 2 and planner.joint_rounds == 0
    assert max(peaks) <= budget, (peaks, budget)
