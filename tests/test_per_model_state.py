"""Plans, compiled entries and recompile limits belong to each fitted model (issue 29, part 2):
another model's recompile limit never switches a fitted model off, and any call that runs
outside a plan says so at that call (``BudgetWarning``, naming the code and the cause) and in
``memfit.report``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.runtime.measure import measure_allocator_peak

pytestmark = pytest.mark.usefixtures("compiled_fresh")


class Net(nn.Module):
    """A user's model class: every instance runs one ``forward`` code object."""

    def __init__(self, width: int = 64, depth: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def iteration(model, optimizer, x, y) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measured(model, parameters, optimizer, x, y) -> int:
    return measure_allocator_peak(lambda: iteration(model, optimizer, x, y),
                                  track=(parameters, optimizer.state, x, y)).peak_bytes


def budget_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, memfit.BudgetWarning)]


def past_its_limit(sizes: int = 4) -> tuple[nn.Module, list[str]]:
    """A first fitted ``Net`` trained on ``sizes`` batch sizes, past a recompile limit of 2 (each
    size is a compile: ``dynamic=False``), and the budget warnings it gave."""
    first = Net()
    optimizer = torch.optim.SGD(first.parameters(), lr=0.01)
    fitted = memfit.fit(first, optimizer=optimizer, dynamic=False)  # a compile per size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(sizes):
            size = 32 + 8 * index
            iteration(fitted, optimizer, torch.randn(size, 64), torch.randn(size, 1))
    return fitted, budget_warnings(caught)


@pytest.mark.slow
def test_another_models_recompile_limit_leaves_a_fitted_model_planned():
    """Before: the first model's recompile limit (shared by every model of its class) made a
    second one run every iteration eagerly, 3,753,484 B at a 2,252,090 B budget, with no warning
    and a report of "no region has been compiled yet". Now each fitted model has its own."""
    with torch._dynamo.config.patch(recompile_limit=2):
        first, said = past_its_limit()
        assert len(said) == 2 and all("recompile limit" in message for message in said)
        x, y = torch.randn(2048, 64), torch.randn(2048, 1)
        reference = Net()
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
        eager_peak = measured(reference, list(reference.parameters()), reference_optimizer, x, y)
        second = Net()
        optimizer = torch.optim.SGD(second.parameters(), lr=0.01)
        budget = int(0.75 * eager_peak)
        fitted = memfit.fit(second, budget=budget, optimizer=optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peaks = [measured(fitted, list(second.parameters()), optimizer, x, y)
                     for _ in range(3)]
    assert max(peaks) <= budget < eager_peak, (peaks, budget, eager_peak)
    assert budget_warnings(caught) == []
    assert fitted._memfit_backend.regions and "call(s)" not in memfit.report(fitted)
    assert "ran outside any plan: 2 call(s)" in memfit.report(first)
    for _ in range(2):  # the eager reference trains as many steps: bitwise eager's weights
        iteration(reference, reference_optimizer, x, y)
    for parameter, expected in zip(second.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected)


def test_a_budget_no_plan_fits_raises_beside_a_model_past_its_limit():
    """A 2-byte budget "ran" on a model whose class another model had taken past its limit."""
    with torch._dynamo.config.patch(recompile_limit=2):
        past_its_limit(sizes=3)
        fitted = memfit.fit(Net(), budget=2)
        with pytest.raises(memfit.BudgetError):
            fitted(torch.randn(32, 64)).sum().backward()


def test_each_call_past_its_limit_names_the_code_and_the_cause():
    with torch._dynamo.config.patch(recompile_limit=2):
        fitted, said = past_its_limit()
    assert len(said) == 2  # the 3rd and 4th sizes
    assert all("Net.forward" in message and "recompile limit" in message for message in said)
    assert "ran outside any plan: 2 call(s): Net.forward" in memfit.report(fitted)


class Watching(TorchDispatchMode):
    """A user's dispatch mode: Dynamo runs compiled code eagerly under it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_call_under_a_dispatch_mode_or_forced_eager_says_so():
    """Other causes of an unplanned call: a dispatch mode of the user's on the stack, and
    ``torch.compiler.set_stance("force_eager")``; an evaluation (no gradients) is not one."""
    fitted = memfit.fit(Net())
    x = torch.randn(32, 64)
    fitted(x).sum().backward()  # planned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Watching():
            fitted(x).sum().backward()
        with torch.compiler.set_stance("force_eager"):
            fitted(x).sum().backward()
        with torch.no_grad():
            fitted(x)
        fitted(x).sum().backward()  # planned again
    said = budget_warnings(caught)
    assert len(said) == 2, said
    assert "Watching" in said[0] and "force_eager" in said[1]
    assert memfit.report(fitted).count("call(s)") == 2
