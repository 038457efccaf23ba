"""memfit's own exceptions. Each message says what to do next."""

from __future__ import annotations

from memfit.core.units import format_bytes


class BudgetError(RuntimeError):
    """No plan of the chosen strategy fits the budget.

    Attributes:
        budget_bytes: the budget asked for.
        minimum_bytes: the smallest peak the strategy can reach on this graph.
        dominant: ``(tensor name, bytes)`` of the tensors live at that smallest peak, largest first.
        note: what else the user should know, e.g. which solver stopped on its work limit
            without a schedule (so "does not fit" is not proven for it).

    Planning with the same strategy at exactly ``minimum_bytes`` returns a plan that fits: the
    minimum is the peak of a plan the strategy built, never an estimate.
    """

    def __init__(self, budget_bytes: int, minimum_bytes: int, dominant=(), strategy: str = "",
                 note: str = ""):
        self.budget_bytes = int(budget_bytes)
        self.minimum_bytes = int(minimum_bytes)
        self.dominant = tuple(dominant)
        self.strategy = strategy
        self.note = note
        top = ", ".join(f"{name} ({format_bytes(size)})" for name, size in self.dominant[:5])
        by = f" with strategy {strategy!r}" if strategy else ""
        super().__init__(
            f"the step cannot fit {format_bytes(self.budget_bytes)}{by}: the smallest peak it can "
            f"reach is {format_bytes(self.minimum_bytes)}. Raise the budget to at least that, try "
            "another strategy, or shrink the batch."
            + (f" Largest tensors live at that peak: {top}." if top else "")
            + (f" {note}" if note else "")
        )


class CaptureError(RuntimeError):
    """The training step could not be captured as one forward+backward graph."""
