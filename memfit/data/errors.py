"""memfit's own exceptions. Each message says what to do next."""

from __future__ import annotations

from memfit.data.units import format_bytes


class BudgetError(RuntimeError):
    """No plan of the chosen strategy fits the budget.

    Attributes:
        budget_bytes: the budget asked for.
        minimum_bytes: the smallest peak the strategy can reach on this graph.
        dominant: ``(tensor name, bytes)`` of the tensors live at that smallest peak, largest first.
        note: what else the user should know, e.g. which solver stopped on its work limit
            without a schedule (so "does not fit" is not proven for it).
        host_bytes: the host memory limit (``Hardware.host_bytes``) that stopped the strategy
            from swapping more, ``None`` where it did not matter.

    Planning with the same strategy at exactly ``minimum_bytes`` returns a plan that fits: the
    minimum is the peak of a plan the strategy built, never an estimate. With ``host_bytes`` set
    it is the smallest peak the strategy reaches without swapping more than the host holds.
    """

    def __init__(self, budget_bytes: int, minimum_bytes: int, dominant=(), strategy: str = "",
                 note: str = "", host_bytes: int | None = None):
        self.budget_bytes = int(budget_bytes)
        self.minimum_bytes = int(minimum_bytes)
        self.dominant = tuple(dominant)
        self.strategy = strategy
        self.note = note
        self.host_bytes = host_bytes
        top = ", ".join(f"{name} ({format_bytes(size)})" for name, size in self.dominant[:5])
        by = f" with strategy {strategy!r}" if strategy else ""
        super().__init__(
            f"the step cannot fit {format_bytes(self.budget_bytes)}{by}: the smallest peak it can "
            f"reach is {format_bytes(self.minimum_bytes)}. Raise the budget to at least that, try "
            "another strategy, or shrink the batch."
            + (f" Largest tensors live at that peak: {top}." if top else "")
            + (f" {note}" if note else "")
            + (_host_advice(host_bytes) if host_bytes is not None else "")
        )


def _host_advice(host_bytes: int) -> str:
    """What to do when the host limit, not the device, stopped the swaps."""
    return (f" Swaps were limited by the hardware profile's host_bytes "
            f"({format_bytes(host_bytes)} of host memory): where the host has more, raise it "
            "with hardware.with_(host_bytes=...); else recompute instead (strategy "
            "'optimal-recompute' or 'checkpoint').")


class CaptureError(RuntimeError):
    """The training step could not be captured as one forward+backward graph."""


class PlanError(ValueError):
    """A plan that cannot be executed on its graph (a swap-in after its consumer, say), or was
    made for another graph or hardware (``Plan.check_for``)."""


class BudgetWarning(UserWarning):
    """A step runs over the budget: a measured peak re-planning could not bring back under, or a
    region planned at its smallest peak because earlier regions still hold their saves."""
