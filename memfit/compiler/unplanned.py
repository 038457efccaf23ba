"""Calls of a fitted model that ran outside its plans, said at that call; and the skip Dynamo
leaves on a fitted model's entry code when an exception escapes its trace, undone.

Dynamo can run a model's code eagerly, outside any plan, without an error: a code object past its
recompile limit, a frame it could not trace (it marks the code skipped for good), a dispatch mode
on the stack, a stance or flag that turns it off. The fitted model's call checks, after it
returns, that a training call ran at least one planned region, and that no code whose recompile
limit was hit ran eagerly in it; where one did, a ``BudgetWarning`` names the code and the cause,
and ``memfit.report`` lists the calls (``Backend.unplanned_calls``). The model's forward called
directly never reaches the fitted call: the optimizer's step of the gradients it made says so
(``stepped_without_a_call``).

When tracing meets an exception (a forward hook that raises, a Ctrl-C, a data check), Dynamo
gives up on the frame it was converting and marks its code skipped, so that every later call of
every model compiled through it runs eagerly. For a fitted model that frame is its entry code
(``torch.compile``'s wrapper of a module, shared by all compiled modules, or a unit's forward):
after an exception escapes a call, those codes are put back to Dynamo's default, so that the next
call is traced and planned again (``undo_entry_skips``).

Example:
    >>> before = call_started(planner)
    >>> result = compiled_call()
    >>> call_ended(planner, before, model, args)
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memfit.data.errors import BudgetWarning

if TYPE_CHECKING:
    from types import CodeType

Backend = Any  # memfit.compiler.backend.Backend, which imports this module (imports run one way)


@dataclass(frozen=True)
class CallStart:
    """What a fitted model's call is checked against when it returns."""

    forward_runs: int  # planned region forwards run before the call
    unsupported: frozenset[str]  # what Dynamo could not trace before the call
    failed_conversions: int  # frames Dynamo failed to convert before the call
    conversions: int  # frames Dynamo set out to convert before the call


def call_started(planner: Backend) -> CallStart:
    """Note what the call's end compares with; empties the codes run (``Backend.codes_run``)."""
    from torch._dynamo.utils import counters

    planner.codes_run.clear()
    return CallStart(planner.forward_runs, frozenset(counters["unimplemented"]),
                     _failed_conversions(), counters["frames"]["total"])


def traced_since(start: CallStart) -> bool:
    """Whether Dynamo traced a frame since ``start``."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"] > start.conversions


def conversion_failed(start: CallStart) -> bool:
    """Whether Dynamo failed to convert a frame since ``start``: it then marks that frame's code
    skipped (for this model, where its recompiles are its own), and runs it eagerly from then on."""
    return _failed_conversions() > start.failed_conversions


def _failed_conversions() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"] - counters["frames"]["ok"]


def call_ended(planner: Backend, start: CallStart, model: torch.nn.Module, inputs: Any) -> None:
    """After a call that returned: where it trained (gradients on, something requires them) and
    ran no planned region, or a code past its recompile limit ran eagerly in it, warn and count
    the call in ``planner.unplanned_calls``."""
    if not _trains(model, inputs):
        return
    if planner.forward_runs == start.forward_runs:
        _said(planner, _model_name(model), _cause(planner, start))
        return
    for code, cause in planner.limit_codes.items():
        if code not in planner.codes_run:
            _said(planner, _code_name(code), cause)


def stepped_without_a_call(planner: Backend, optimizer: torch.optim.Optimizer) -> None:
    """After a step of ``optimizer``: where it steps the model's parameters, no training call of
    the fitted model ran since its previous step (``Backend.training_calls``) and their
    gradients are not all zero, those gradients were made by the model's code run outside the
    fitted call, outside any plan (``model.forward(...)`` called directly runs the forward
    uncompiled, as it does under ``torch.compile``; a function the user compiled before fitting
    runs the graph Dynamo traced then, which does not guard hooks): warn at the step and count
    it."""
    model = planner.model
    calls = planner.training_calls
    before = planner.calls_at_step.get(optimizer, 0)
    planner.calls_at_step[optimizer] = calls
    if model is None or calls != before or not planner.steps_my_parameters(optimizer):
        return
    gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    if any(bool(gradient.any()) for gradient in gradients):
        _said(planner, f"{type(model).__name__}.forward",
              "the optimizer stepped gradients of its parameters that no call of the fitted "
              "model made since its previous step. model.forward(...) called directly runs "
              "the forward uncompiled, as under torch.compile: call model(...) instead. A "
              "torch.compile'd function of yours that traced the model before memfit.fit (a "
              "notebook cell run again) keeps running the graph it compiled then: call "
              "torch._dynamo.reset() after memfit.fit",
              stacklevel=5)


def _said(planner: Backend, where: str, cause: str, stacklevel: int = 4) -> None:
    """Warn that ``where`` ran outside any plan because of ``cause``; count it for the report."""
    key = f"{where}: {cause}"
    planner.unplanned_calls[key] = planner.unplanned_calls.get(key, 0) + 1
    warnings.warn(f"memfit: {where} ran eagerly, outside any plan, so the budget does not hold "
                  f"for this call: {cause}.", BudgetWarning, stacklevel=stacklevel)


def _trains(model: torch.nn.Module, inputs: Any) -> bool:
    """Whether the call builds an autograd graph through the model (what memfit plans)."""
    from torch.utils._pytree import tree_leaves

    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    return (any(parameter.requires_grad for parameter in model.parameters())
            or any(isinstance(leaf, torch.Tensor) and leaf.requires_grad
                   for leaf in tree_leaves(inputs)))


def _cause(planner: Backend, start: CallStart) -> str:
    """Why no planned region ran in a training call, as far as can be told."""
    from torch._dynamo.utils import counters

    if torch._dynamo.config.disable:
        return "torch._dynamo.config.disable is set"
    stance = torch._dynamo.eval_frame._stance.stance
    if stance != "default":
        return f"torch.compiler.set_stance({stance!r}) is in force"
    modes = dispatch_modes()
    if modes:
        return (f"a dispatch mode ({', '.join(modes)}) is on the stack, and Dynamo does not "
                "run compiled code under it; the next call without it runs the plan")
    if planner.limit_codes:
        return next(iter(planner.limit_codes.values()))
    new = [message for message in counters["unimplemented"] if message not in start.unsupported]
    if new:
        first = str(new[0]).strip().splitlines()[0]
        planner.skip_cause = (f"Dynamo could not trace it ({first}) and runs it eagerly; "
                              'TORCH_LOGS="graph_breaks" shows where' + _remedy(first))
    return planner.skip_cause or ("Dynamo ran it eagerly without saying why "
                                  '(TORCH_LOGS="recompiles,graph_breaks" shows it)')


def _remedy(cause: str) -> str:
    """What lets Dynamo trace code it gave up on for ``cause``, where a setting does."""
    if "dynamic shape operator" in cause.lower():  # nonzero, torch.where(mask): an MoE's routing
        return ("; an op whose output size depends on the data (torch.nonzero, "
                "torch.where(mask), a mixture of experts' routing) is traced with "
                "torch._dynamo.config.capture_dynamic_output_shape_ops = True, and memfit then "
                "plans its sizes at their largest")
    if "item()" in cause:  # a metric logged from the forward or a hook with .item()
        return ("; a Tensor.item() in the forward or a hook (a logged metric) is traced with "
                "torch._dynamo.config.capture_scalar_outputs = True, and memfit plans it; or "
                "log the value after the model's call")
    if "backwards hooks" in cause.lower():  # register_full_backward_hook on a module it calls
        return ("; a module's backward hook (register_full_backward_hook or "
                "register_full_backward_pre_hook, on it or a submodule) stops Dynamo for the "
                "whole call, as under torch.compile: remove the hook, or fit the submodules "
                "that have none (memfit.fit(model.block, ...))")
    return ""


def dispatch_modes() -> list[str]:
    """The dispatch modes on this thread's stack under which Dynamo does not compile: it runs
    the frame eagerly and marks its code skipped for later calls too, so a fitted model under
    one runs its module directly instead (``memfit.fitting.fitted``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [type(mode).__name__ for mode in _get_current_dispatch_mode_stack()
            if not mode.is_infra_mode() and not mode.ignore_compile_internals()]


def limit_cause(limit: int | None) -> str:
    """The cause said for a code past its recompile limit."""
    return (f"Dynamo hit its recompile limit ({limit} compiles of it for this model: new shapes, "
            "or a guard on a changing Python value) and runs it eagerly from now on. Raise "
            "torch._dynamo.config.recompile_limit or remove what makes it recompile "
            '(TORCH_LOGS="recompiles" shows why)')


def _model_name(model: torch.nn.Module) -> str:
    return _code_name(type(model).forward.__code__, f"{type(model).__name__}.forward")


def _code_name(code: CodeType, name: str | None = None) -> str:
    if code in entry_codes():
        return "the fitted model's forward"
    return f"{name or code.co_name} ({code.co_filename}:{code.co_firstlineno})"


@functools.cache
def entry_codes() -> frozenset[CodeType]:
    """The codes Dynamo converts to enter a fitted model: ``torch.compile``'s wrapper of a
    module (one code for every compiled module) and memfit's FSDP2 unit forward."""
    from torch._dynamo.external_utils import wrap_inline

    from memfit.compiler.unit_forward import unit_forward

    return frozenset({wrap_inline(len).__code__, unit_forward.__code__})


def undo_entry_skips() -> None:
    """Put the fitted models' entry codes back to Dynamo's default: after an exception escaped
    a trace, Dynamo marks the code it was converting skipped for every later call; from the
    default it looks up its compiled entries and traces anew where none fits, as before."""
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    default = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)
    for code in entry_codes():
        set_code_exec_strategy(code, default)
