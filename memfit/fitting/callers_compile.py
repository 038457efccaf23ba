"""A fitted model traced by a ``torch.compile`` of the caller's runs its own plan, never unplanned.

Dynamo traces a module's ``forward`` (through ``_call_impl`` and its hooks), never the
``_compiled_call_impl`` that ``memfit.fit`` installs. So ``torch.compile(fitted_model)``,
``fitted_model.compile()``, a compiled training step or ``Trainer(torch_compile=True)`` would
trace the model into the caller's graph and compile it with the caller's backend, with no plan
and no word. A fitted model carries a forward pre-hook that, traced by any compile other than
memfit's own (``own_trace``), calls a function Dynamo may not trace: the caller's graph breaks
at the model's call, which then runs eagerly, through memfit's plan. Where a Dynamo traced on
past that break, the function runs and raises ``CaptureError`` before the forward does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memfit.data.errors import CaptureError

_OWN_TRACES = [0]  # memfit's own compiles running now (FittedCall, memfit.compile, memfit.plan)


@contextlib.contextmanager
def own_trace() -> Iterator[None]:
    """Mark a compile memfit runs itself: a fitted model it traces runs as planned."""
    _OWN_TRACES[0] += 1
    try:
        yield
    finally:
        _OWN_TRACES[0] -= 1


def refuse_callers_compile(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of a fitted model: nothing when run eagerly or traced by memfit; traced
    by another compile, a graph break (``CaptureError`` should the function behind it run)."""
    if torch.compiler.is_compiling() and not _OWN_TRACES[0]:
        _raise_traced_by_callers_compile(type(module).__name__)


@torch._dynamo.disable
def _raise_traced_by_callers_compile(name: str) -> None:
    raise CaptureError(
        f"memfit: this fitted {name} was traced by a torch.compile of the caller's "
        "(torch.compile(model), model.compile(), a compiled training step, or a framework's "
        "torch_compile option), which would compile its forward without memfit's plan. memfit.fit "
        "compiles the model itself: call the fitted model outside any torch.compile, and choose "
        "the compiler with memfit.fit(model, ..., compiler=\"inductor\").")


def add_hook(module: torch.nn.Module) -> None:
    """Give ``module`` the refusing pre-hook once. A copy of a fitted model (``deepcopy``,
    ``pickle``) is installed before its state is set, and its hooks come with that state."""
    hooks = module.__dict__.get("_forward_pre_hooks")
    if hooks is not None and refuse_callers_compile not in hooks.values():
        module.register_forward_pre_hook(refuse_callers_compile)


def remove_hook(module: torch.nn.Module) -> None:
    """Take the refusing pre-hook off ``module`` (``memfit.unfit``)."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is refuse_callers_compile:
            del module._forward_pre_hooks[key]
