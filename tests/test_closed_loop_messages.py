"""The closed loop's messages say sizes that exist: where the budget is below what stays beside
the step (parameters, gradients, optimizer state), it says so instead of naming a tighter
planning budget below zero (an empty batch at ``budget=1000`` named "a tighter -15.43 KiB")."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from memfit.compiler.closed_loop import Loop
from memfit.data.errors import BudgetWarning
from memfit.data.units import format_bytes


def _planned(budget_bytes: int, outside_bytes: int, predicted_bytes: int) -> SimpleNamespace:
    return SimpleNamespace(budget=SimpleNamespace(device_bytes=budget_bytes,
                                                  outside_bytes=outside_bytes),
                           predicted_peak_bytes=predicted_bytes)


def test_a_budget_below_the_resident_bytes_is_named_never_a_negative_size():
    def plan_for(budget_bytes):  # never reached: nothing below the resident bytes can fit
        raise AssertionError(budget_bytes)

    loop = Loop()
    measured = SimpleNamespace(peak_bytes=17_000, step_time_s=0.01)
    with pytest.warns(BudgetWarning) as caught:
        assert not loop.record(_planned(1000, 15_800, 16_000), measured, plan_for)
    message = str(caught[0].message)
    assert loop.settled
    assert "below what the model holds" in message and format_bytes(15_800) in message
    assert not re.search(r"-\d", message), message
