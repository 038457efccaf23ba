"""Fault injection as a property (issue 29, part 7): a loop of 5 iterations of a fitted MLP, with
an exception injected at random points (a forward hook, a backward hook, the optimizer's step,
memfit's planning, memfit's measuring) and caught by the loop. Every iteration that completes is
within the budget, measured; the final weights are bitwise those of eager running the same
sequence of completed steps."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import memfit
import memfit.compiler.backend as backend_module
import memfit.compiler.region_peak as region_peak
from tests.test_exceptions import Injected, batches, eager_over, mlp, train_catching

FAULTS = ("none", "forward", "backward", "step", "planning", "measuring")
ITERATIONS = 5


@functools.cache
def budget_bytes() -> int:
    """0.75 of eager's measured peak over the loop's batches."""
    return int(0.75 * eager_over(batches(ITERATIONS), list(range(ITERATIONS)))[2])


def armed_once(armed: dict, fault: str, raised: BaseException) -> None:
    """Raise ``raised`` where ``armed["fault"] == fault``, once."""
    if armed.get("fault") == fault:
        armed["fault"] = None
        raise raised


def injecting(monkeypatch, armed: dict, module, name: str, fault: str) -> None:
    """``module.name`` raises ``Injected`` at its first call while ``fault`` is armed."""
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        armed_once(armed, fault, Injected(f"{name} failed"))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.slow
@settings(max_examples=1, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(faults=["planning", "none", "forward", "backward", "measuring"])
@example(faults=["none", "step", "measuring", "none", "none"])
@given(faults=st.lists(st.sampled_from(FAULTS), min_size=ITERATIONS, max_size=ITERATIONS))
def test_faults_anywhere_leave_every_completed_iteration_in_budget_and_eager(monkeypatch, faults):
    torch.use_deterministic_algorithms(True)
    data = batches(ITERATIONS)
    budget = budget_bytes()
    torch._dynamo.reset()
    armed: dict = {}
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    forward = {"armed": False}  # its own flag: Dynamo traces the hook and guards on it

    def interrupt(module, inputs, output):
        if forward["armed"]:
            forward["armed"] = False
            raise KeyboardInterrupt

    model[2].register_forward_hook(interrupt)
    optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: armed_once(armed, "step", Injected("step failed")))
    injecting(monkeypatch, armed, backend_module, "plan_step", "planning")
    injecting(monkeypatch, armed, region_peak, "run_measured", "measuring")

    def backward_hook(index: int, output: torch.Tensor) -> None:
        if armed.get("fault") == "backward":
            output.register_hook(lambda gradient: armed_once(armed, "backward",
                                                             Injected("backward hook")))

    def arm(fault: str) -> None:
        armed["fault"] = fault
        forward["armed"] = fault == "forward"

    losses, peaks = train_catching(fitted, optimizer, data,
                                   before=lambda index: arm(faults[index]),
                                   between=backward_hook)
    completed = [index for index, loss in enumerate(losses) if loss is not None]
    for index in range(ITERATIONS):  # planning or measuring may find nothing to fail
        if faults[index] in ("forward", "backward", "step") or (index, faults[index]) == (
                0, "planning"):
            assert index not in completed, (faults, losses)
    assert all(peaks[index] <= budget for index in completed), (faults, peaks, budget)
    reference, reference_losses, _ = eager_over(data, completed)
    for index, expected in zip(completed, reference_losses, strict=True):
        assert torch.equal(losses[index], expected), (faults, index)
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected), faults
    torch._dynamo.reset()
