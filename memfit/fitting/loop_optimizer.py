"""The loop's optimizer found for a fitted model's backend where ``memfit.fit`` was not given
``optimizer=``: the one that holds the model's parameters at its first call, else the first to
step them (a global post-step hook). The backend counts the state of each optimizer it adopts
(``Backend.adopt``): reserved before its first step, real after.

Example:
    >>> watch_optimizers(planner, BACKEND_KEY)  # at fit: adopted by its first step
    >>> adopt_existing_optimizers(planner)  # at the first call: the one made before training
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from memfit.compiler.backend import Backend


def adopt_existing_optimizers(planner: Backend) -> None:
    """Adopt the optimizer that exists at the model's first call and holds its parameters (a loop
    that made its optimizer before training and did not pass ``optimizer=``), so that the first
    plan reserves the state it allocates at its first step. Where several do, which one the loop
    steps is unknown: none is adopted before its first step (``watch_optimizers``). A wrapper
    (accelerate's ``AcceleratedOptimizer``, its ``optimizer`` one of them) stands for the one
    it wraps."""
    holding = [candidate for candidate in gc.get_objects()
               # ``type``: an ``isinstance`` may run a ``__class__`` property
               if issubclass(type(candidate), torch.optim.Optimizer)
               and planner.steps_my_parameters(candidate)]
    holding = [candidate for candidate in holding
               if not any(getattr(candidate, "optimizer", None) is inner for inner in holding)]
    if len(holding) == 1:
        planner.adopt(holding[0])


def watch_optimizers(planner: Backend, backend_key: str) -> None:
    """Find the loop's optimizer by its first step, when ``optimizer=`` was not given and it did
    not exist at the first call, so that its state counts from the next iteration on (a global
    post-step hook, held weakly); after a step, a step of gradients no fitted call made is said
    (``stepped_without_a_call``) by the backend the model holds under ``backend_key`` (not one
    fitted over since), and the watch of eager code leaves the mode stack once
    measuring has ended (``Backend.end_eager_watch``)."""
    import weakref

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from memfit.compiler.unplanned import stepped_without_a_call

    reference = weakref.ref(planner)

    def adopt(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found = reference()  # a dead backend leaves a hook that does nothing: torch iterates
        if found is not None:  # the hooks while calling them, so it cannot remove itself here
            found.adopt(optimizer)
            if found.model is not None and found.model.__dict__.get(backend_key) is found:
                stepped_without_a_call(found, optimizer)  # not a backend fitted over since
            found.end_eager_watch()  # off the stack once measuring ended (not inside a backward)

    # a step the loop compiles (``torch.compile(optimizer.step)``) runs the hook as Python, not
    # traced: it may take the eager watch off the mode stack, which a trace would only simulate
    register_optimizer_step_post_hook(torch._dynamo.disable(
        adopt, reason="memfit: its optimizer hook changes the dispatch mode stack"))
