"""What a refusal says about eager code's bytes beside the region (``with_eager_note``)."""

from __future__ import annotations

from memfit.data.errors import BudgetError
from memfit.planning.step import with_eager_note

MIB = 1 << 20


def _refusal(budget_bytes: int, minimum_bytes: int) -> BudgetError:
    return BudgetError(budget_bytes, minimum_bytes, (), "auto")


def test_the_previous_iterations_scalar_loss_is_not_named_as_a_cause():
    """Every loop holds its last loss (4 bytes) while the next iteration runs; a refusal 3 MiB
    short does not point at eager code for it (it did: "4 B of it is held by eager code ...
    compute the loss inside the model")."""
    error = with_eager_note(_refusal(201 * MIB, 204 * MIB), 4)
    assert "eager code" not in str(error)
    assert error.minimum_bytes == 204 * MIB


def test_eager_bytes_are_named_where_the_step_would_fit_without_them_or_they_are_a_share():
    short_by_them = with_eager_note(_refusal(10 * MIB, 10 * MIB + 100), 64 * 1024)
    a_share = with_eager_note(_refusal(100 * MIB, 200 * MIB), 3 * MIB)
    for error in (short_by_them, a_share):
        assert "held by eager code" in str(error), error
