"""The closed loop: a measured step over the budget re-plans tighter for the next step.

On the CPU the planner's prediction is exact, so the discrepancy is injected for real: a custom
op whose real kernel returns its result in a storage larger than the tensor (as an
allocator that rounds up would), while its fake kernel, which tracing and the planner see, does
not. The allocator's events count what was allocated, so only the measurement sees the extra
bytes.
"""

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit import examples


@torch.library.custom_op("memfit_test::padded_relu", mutates_args=())
def padded_relu(x: torch.Tensor, padding: int) -> torch.Tensor:
    padded = torch.empty(padding * x.numel(), dtype=x.dtype, device=x.device)
    return padded[: x.numel()].view(x.shape).copy_(torch.relu(x))


@padded_relu.register_fake
def _(x, padding):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * (x > 0), None


padded_relu.register_autograd(_backward, setup_context=_setup)


class PaddedReLU(nn.Module):
    def __init__(self, padding):
        super().__init__()
        self.padding = padding

    def forward(self, x):
        return padded_relu(x, self.padding)


def padded_mlp(padded_layers=(6,), padding=2):
    """The 8-layer MLP with some ReLUs whose real output storage is ``padding`` times larger
    than the tensor the planner sees."""
    example = examples.mlp(depth=8, width=128, batch_size=512)
    relus = [i for i, m in enumerate(example.model) if isinstance(m, nn.ReLU)]
    for k in padded_layers:
        example.model[relus[k]] = PaddedReLU(padding)
    return example


@functools.cache
def unplanned_peak(padded_layers=(6,), padding=2):
    """The unplanned step's predicted and measured peaks (the measured one sees the padding)."""
    example = padded_mlp(padded_layers, padding)
    step = memfit.compile(example.model, example.loss_fn, strategy="keep")
    step(*example.inputs())
    return step.predicted.peak_bytes, step.measured.peak_bytes


def test_a_step_over_the_budget_replans_and_the_next_one_fits():
    example = padded_mlp()
    predicted, measured = unplanned_peak()
    assert measured > predicted  # the injected discrepancy is real: the fake kernel hides it
    budget = int(0.7 * predicted)
    eager = copy.deepcopy(example.model)
    step = memfit.compile(example.model, example.loss_fn, budget=budget, strategy="swap")
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        for _ in range(2):  # over, re-planned; fits
            inputs = example.inputs()
            loss = step(*inputs)
            reference = example.loss_fn(eager, *inputs)
            reference.backward()
            assert torch.equal(loss, reference.detach())
            for ours, theirs in zip(example.model.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)
            for model in (example.model, eager):
                model.zero_grad(set_to_none=True)
    rounds = step.rounds
    assert rounds[0].planning_budget_bytes == budget
    assert rounds[0].predicted_peak_bytes <= budget < rounds[0].measured_peak_bytes
    assert len(rounds) >= 2 and rounds[-1].planning_budget_bytes < budget
    assert rounds[-1].measured_peak_bytes <= budget  # the steps after the re-plan fit
    assert step.measured.peak_bytes <= budget
    text = step.report()
    assert "closed loop" in text and text.count("\n| 2 ") == 1


def test_without_measuring_there_is_no_loop():
    example = padded_mlp()
    predicted, _ = unplanned_peak()
    step = memfit.compile(example.model, example.loss_fn, budget=int(0.7 * predicted),
                          strategy="swap", measure=False)
    step(*example.inputs())
    first = step.compiled
    for _ in range(2):
        example.model.zero_grad(set_to_none=True)  # no gradients kept: nothing else re-plans
        step(*example.inputs())
    assert step.rounds == [] and step.compiled is first and step.regions == [first]


def test_a_budget_no_plan_can_reach_warns_by_how_much_and_keeps_running():
    example = padded_mlp(padded_layers=tuple(range(8)), padding=4)
    predicted, _ = unplanned_peak(tuple(range(8)), 4)
    step = memfit.compile(example.model, example.loss_fn, budget=int(0.6 * predicted),
                          strategy="swap")
    with pytest.warns(memfit.BudgetWarning, match=r"over the budget .* by "):
        for _ in range(memfit.api.CLOSED_LOOP.max_rounds):
            loss = step(*example.inputs())
            example.model.zero_grad(set_to_none=True)
            if step.loop.settled:
                break
    assert torch.isfinite(loss) and step.loop.settled
    assert step.rounds[0].measured_peak_bytes > step.budget_bytes
