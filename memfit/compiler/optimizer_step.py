"""The optimizer's step, after the backward: the model's parameters, every gradient and the
optimizer state are alive, and the step allocates its own temporaries (``step_temporary_bytes``).
No plan of the activations lowers that peak, so a budget under it is refused at the first plan,
before anything runs, and said at a later one.

Example:
    >>> check_the_step_fits(planner, device, chosen.budget_bytes, at_step, first_plan=True)
"""

from __future__ import annotations

import warnings

import torch

from memfit.compiler.region import Planner
from memfit.data.errors import BudgetError, BudgetWarning
from memfit.data.units import format_bytes
from memfit.runtime.resident import missing_gradient_bytes, step_temporary_bytes


def step_peak_bytes(planner: Planner, device: torch.device, resident_bytes: int
                    ) -> tuple[int, int]:
    """The device bytes alive at the largest of the adopted optimizers' steps, and of those the
    step's own temporaries: ``resident_bytes`` (parameters, optimizer state reserved or made,
    other fitted models', the batch and eager code's bytes), the gradients of trainable
    parameters that have none yet, and the temporaries."""
    missing = missing_gradient_bytes(planner.model, device)
    temporaries = max((step_temporary_bytes(optimizer, device)
                       for optimizer in planner.optimizers), default=0)
    return resident_bytes + missing + temporaries, temporaries


def with_the_step(error: BudgetError, planner: Planner, device: torch.device,
                  resident_bytes: int) -> BudgetError:
    """``error`` (no plan of the activations fits), its smallest peak raised to the optimizer's
    step's where that is higher, so that a budget at its ``minimum_bytes`` fits the step too."""
    if not planner.optimizers:
        return error
    peak, temporaries = step_peak_bytes(planner, device, resident_bytes)
    if peak <= error.minimum_bytes:
        return error
    note = (f"At that budget the optimizer's step would not fit: it needs {format_bytes(peak)}, "
            f"its own temporaries ({format_bytes(temporaries)}) included.")
    raised = BudgetError(error.budget_bytes, peak, error.dominant, error.strategy,
                         f"{error.note} {note}".strip(), error.host_bytes)
    raised.__dict__.update({key: value for key, value in error.__dict__.items()
                            if key not in raised.__dict__})
    return raised


def check_the_step_fits(planner: Planner, device: torch.device, budget_bytes: int | None,
                        resident_bytes: int, first_plan: bool) -> None:
    """Refuse a budget the optimizer's step alone exceeds (``BudgetError``) at the model's
    first plan; at a later one (an optimizer found at its first step), say it once."""
    if budget_bytes is None or not planner.optimizers:
        return
    peak, temporaries = step_peak_bytes(planner, device, resident_bytes)
    if peak <= budget_bytes:
        return
    note = (f"The optimizer's step alone needs {format_bytes(peak)}: the parameters, their "
            f"gradients, the optimizer state and the batch ({format_bytes(peak - temporaries)}) "
            "and the "
            f"step's own temporaries ({format_bytes(temporaries)}); no plan of the activations "
            "lowers that. Raise the budget, or step with fewer temporaries: fused=True makes "
            "none, foreach=False one parameter's at a time.")
    if first_plan:
        raise BudgetError(budget_bytes, peak, strategy="", note=note)
    if not planner.step_over_said:
        planner.step_over_said = True
        warnings.warn(f"memfit: over the budget {format_bytes(budget_bytes)} at every optimizer "
                      f"step. {note}", BudgetWarning, stacklevel=2)
