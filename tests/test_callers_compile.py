"""A fitted model inside a ``torch.compile`` of the user's: ``torch.compile(memfit.fit(model))``,
a compiled training step, ``memfit.fit(torch.compile(model))``. Dynamo traces a module's
forward, never the call ``memfit.fit`` installs, so without care the caller's compile traces the
model into its own graph with no plan. The fitted model's pre-hook breaks the caller's graph at
the model's call: the model runs its own plan, within the budget, training bit for bit eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.fitting.callers_compile import own_trace, refuse_callers_compile
from memfit.runtime.measure import measure_allocator_peak

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def _build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 1))


INPUTS = (torch.randn(256, 128, generator=torch.Generator().manual_seed(1)),
          torch.randn(256, 1, generator=torch.Generator().manual_seed(2)))


def _train(model: nn.Module, step_of, iterations: int = 2):
    """Losses and measured peaks of an SGD loop whose step ``step_of(model)`` returns the loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_of(model)
    losses, peaks = [], []
    for _ in range(iterations):
        def iteration():
            loss = step()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        measured = measure_allocator_peak(iteration, track=(list(model.parameters()), *INPUTS))
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def _loss(module):
    return nn.functional.mse_loss(module(INPUTS[0]), INPUTS[1])


def _compiled_model_step(fitted):
    compiled = torch.compile(fitted, backend="aot_eager")
    return lambda: _loss(compiled)


CALLERS = {
    "torch.compile(fitted)": _compiled_model_step,
    "a compiled step": lambda fitted: torch.compile(lambda: _loss(fitted), backend="aot_eager"),
    "memfit.fit(torch.compile(model))": None,  # fitted through the wrapper, called plain
}


@pytest.mark.slow
@pytest.mark.parametrize("caller", CALLERS)
def test_a_fitted_model_inside_the_callers_compile_runs_its_own_plan(caller):
    reference = _build()
    reference_losses, eager_peaks = _train(reference, lambda model: lambda: _loss(model))
    budget = int(0.8 * max(eager_peaks))
    model = _build()
    if CALLERS[caller] is None:
        fitted = memfit.fit(torch.compile(model), budget=budget)
        assert fitted is model  # the wrapped module, fitted

        def step_of(module):
            return lambda: _loss(fitted)
    else:
        def step_of(module):
            return CALLERS[caller](memfit.fit(module, budget=budget))
    losses, peaks = _train(model, step_of)
    assert all(map(torch.equal, losses, reference_losses))
    assert all(map(torch.equal, model.parameters(), reference.parameters()))
    regions = model._memfit_backend.regions
    print(f"{caller}: budget {budget:,} B, eager {eager_peaks}, measured {peaks}, "
          f"{len(regions)} region(s)")
    assert regions and all(region.budget_bytes == budget for region in regions)
    assert max(peaks) <= budget, (peaks, budget)


def test_the_hook_is_one_per_model_and_unfit_removes_it():
    model = memfit.fit(_build())
    copied = copy.deepcopy(model)
    memfit.fit(model)  # fitted anew: still one hook
    for fitted in (model, copied):
        hooks = list(fitted._forward_pre_hooks.values())
        assert hooks.count(refuse_callers_compile) == 1
    memfit.unfit(model)
    assert refuse_callers_compile not in model._forward_pre_hooks.values()


def test_traced_by_another_compile_past_the_break_it_refuses(monkeypatch):
    """Where a compile of the caller's traced on past the hook's graph break into the forward,
    the hook raises, naming the cause and what to do; memfit's own traces pass."""
    model = _build()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with own_trace():
        refuse_callers_compile(model, INPUTS[:1])
    with pytest.raises(memfit.CaptureError, match="torch.compile of the caller's.*compiler="):
        refuse_callers_compile(model, INPUTS[:1])


def test_a_step_compiled_before_the_fit_says_how_to_run_the_plan():
    """A notebook: a cell compiled and ran the training step, the next fits the model and runs
    it again. Dynamo keeps running the graph it traced before the fit (it does not guard the
    hook memfit adds), so no plan runs; the warning at the optimizer's step says to reset
    Dynamo, after which the step's graph breaks at the model's call and memfit's plan runs."""
    import warnings

    model = _build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = INPUTS

    def train_step() -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step = torch.compile(train_step, backend="aot_eager")
    step()
    fitted = memfit.fit(model, budget="1GB", optimizer=optimizer)
    with pytest.warns(memfit.BudgetWarning, match=r"torch\._dynamo\.reset\(\) after memfit\.fit"):
        step()
    assert not fitted._memfit_backend.regions
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        step()
    assert fitted._memfit_backend.regions
