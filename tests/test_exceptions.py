"""A fitted model after an exception its loop caught (issue 29, part 1): a forward hook that
raises (a Ctrl-C, a data check), an error between the forward and the backward, in a backward
hook, in memfit's own planning or measuring. The next call runs its plan within the budget, the
report says what ran, and the training is eager's over the steps that completed."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.usefixtures("compiled_fresh"), pytest.mark.slow]


class Injected(Exception):
    """The exception a test injects (a data error the loop catches)."""


def mlp(depth: int = 4, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def batches(count: int = 4, size: int = 2048, width: int = 64) -> list:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, width, generator=generator),
             torch.randn(size, 1, generator=generator)) for _ in range(count)]


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
         between: Callable[[torch.Tensor], None] = lambda output: None) -> torch.Tensor:
    """One iteration of the user's loop; ``between`` runs on the model's output before the loss."""
    output = model(x)
    between(output)
    loss = nn.functional.mse_loss(output, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train_catching(model: nn.Module, optimizer: torch.optim.Optimizer, data: list,
                   before: Callable[[int], None] = lambda index: None,
                   between: Callable[[int, torch.Tensor], None] = lambda index, output: None):
    """The loop that catches a failed iteration and trains on: per iteration its loss and measured
    peak, ``None`` for one that raised. ``before(index)`` arms what fails in it."""
    losses, peaks = [], []
    for index, (x, y) in enumerate(data):
        before(index)
        parameters = list(optimizer.param_groups[0]["params"])
        try:
            measured = measure_allocator_peak(
                lambda x=x, y=y, index=index: step(model, optimizer, x, y,
                                                   lambda output: between(index, output)),
                track=(parameters, optimizer.state, x, y))
        except (KeyboardInterrupt, Injected, torch._dynamo.exc.BackendCompilerFailed):
            optimizer.zero_grad(set_to_none=True)
            losses.append(None)
            peaks.append(None)
            continue
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def eager_over(data: list, completed: list[int]):
    """An eager model trained on the steps that completed; its peak over all of them."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    losses, peaks = train_catching(model, optimizer, [data[index] for index in completed])
    return model, losses, max(peaks, default=0)


def fitted_at(fraction: float, data: list):
    """A fitted MLP at ``fraction`` of eager's measured peak, its optimizer and the budget."""
    _, _, eager_peak = eager_over(data, list(range(len(data))))
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    budget = int(fraction * eager_peak)
    return model, memfit.fit(model, budget=budget, optimizer=optimizer), optimizer, budget


def assert_trained_as_eager(model: nn.Module, losses: list, data: list) -> None:
    """Bitwise eager's losses and weights over the iterations that completed."""
    completed = [index for index, loss in enumerate(losses) if loss is not None]
    reference, reference_losses, _ = eager_over(data, completed)
    for loss, expected in zip([losses[index] for index in completed], reference_losses,
                              strict=True):
        assert torch.equal(loss, expected)
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected)


def budget_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, memfit.BudgetWarning)]


def test_a_forward_hook_interrupt_leaves_the_plan_in_force():
    """Iteration 2's forward hook raises KeyboardInterrupt while Dynamo traces it: Dynamo gives up
    on the model's entry code for good (before: every later iteration ran at eager's peak,
    20,098,124 B at a 15,073,593 B budget on a 6-layer MLP, no warning, the report unchanged).
    The fitted model is traced and planned again at its next call."""
    data = batches()
    model, fitted, optimizer, budget = fitted_at(0.75, data)
    armed = {"on": False}

    def interrupt(module, inputs, output):
        if armed["on"]:
            armed["on"] = False
            raise KeyboardInterrupt

    model[2].register_forward_hook(interrupt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, peaks = train_catching(fitted, optimizer, data,
                                       before=lambda index: armed.update(on=index == 2))
    assert losses[2] is None and all(loss is not None for loss in losses[3:])
    assert max(peak for peak in peaks if peak is not None) <= budget, (peaks, budget)
    assert budget_warnings(caught) == []
    planner = fitted._memfit_backend
    assert planner.unplanned_calls == {}
    assert any(region.replaced for region in planner.regions)  # the plans before the interrupt
    assert all(region.measured_runs for region in planner.regions if not region.replaced)
    assert "call(s)" not in memfit.report(fitted)
    assert_trained_as_eager(model, losses, data)


def test_an_error_between_forward_and_backward_closes_the_open_forward():
    """The loop raises after the model returned (a check of its output): the region's forward is
    open with no backward to come. Once the loop drops its graph it is closed, so no later plan
    or measurement counts those saves (before: ``open_forwards`` stayed 1 for good, and the
    iteration never closed again)."""
    data = batches()
    model, fitted, optimizer, budget = fitted_at(0.75, data)

    def check(index: int, output: torch.Tensor) -> None:
        if index == 1:
            raise Injected("a check of the output failed")

    losses, peaks = train_catching(fitted, optimizer, data, between=check)
    regions = fitted._memfit_backend.regions
    assert all(region.open_forwards == 0 for region in regions)
    assert losses[1] is None
    assert max(peak for peak in peaks if peak is not None) <= budget, (peaks, budget)
    assert_trained_as_eager(model, losses, data)


def test_a_backward_hook_error_closes_the_forward_and_the_next_iterations_fit():
    """A hook on the model's output raises inside ``loss.backward()``, before the region's
    backward: its forward is closed when the loop drops the graph."""
    data = batches()
    model, fitted, optimizer, budget = fitted_at(0.75, data)

    def hook_on(index: int, output: torch.Tensor) -> None:
        def fail(gradient):
            raise Injected("a backward hook failed")

        if index == 2:
            output.register_hook(fail)

    losses, peaks = train_catching(fitted, optimizer, data, between=hook_on)
    assert losses[2] is None
    assert all(region.open_forwards == 0 for region in fitted._memfit_backend.regions)
    assert max(peak for peak in peaks if peak is not None) <= budget, (peaks, budget)
    assert_trained_as_eager(model, losses, data)


def raising_once(monkeypatch, module, name: str, armed: dict) -> None:
    """``module.name`` raises ``Injected`` once, at its first call while ``armed["on"]``."""
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        if armed.get("on"):
            armed["on"] = False
            raise Injected(f"{name} failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("where", ["planning", "measuring"])
def test_an_error_in_memfits_own_planning_or_measuring_leaves_no_trace(monkeypatch, where):
    """memfit's planning (the first compile) or its first measured run raises: the call fails,
    leaves no half-made region behind, and the next call plans and runs within the budget.
    Parameters, gradients kept from a first micro-batch and optimizer state are as before it."""
    import memfit.compiler.backend as backend_module
    import memfit.compiler.region_peak as region_peak

    data = batches()
    model, fitted, optimizer, budget = fitted_at(0.75, data)
    armed: dict = {}
    if where == "planning":
        raising_once(monkeypatch, backend_module, "plan_step", armed)
    else:
        raising_once(monkeypatch, region_peak, "run_measured", armed)
    x, y = data[0]
    # model.forward runs eagerly (the fitted call is model.__call__): a first micro-batch's gradients
    nn.functional.mse_loss(model.forward(x), y).backward()
    before = [tensor.clone() for tensor in (*model.parameters(), *(p.grad for p in model.parameters()))]
    armed["on"] = True
    with pytest.raises((Injected, torch._dynamo.exc.BackendCompilerFailed)):
        nn.functional.mse_loss(fitted(x), y).backward()
    after = [*model.parameters(), *(p.grad for p in model.parameters())]
    assert all(torch.equal(old, new) for old, new in zip(before, after, strict=True))
    assert optimizer.state == {}
    regions = fitted._memfit_backend.regions
    if where == "planning":
        assert regions == []  # none half-made
    else:
        assert [region.measured_runs for region in regions] == [0]  # measured from the next
    optimizer.zero_grad(set_to_none=True)
    losses, peaks = train_catching(fitted, optimizer, data)
    assert max(peaks) <= budget, (peaks, budget)
    assert_trained_as_eager(model, losses, data)
