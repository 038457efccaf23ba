"""Checks of the arguments of ``memfit.fit``, ``memfit.backend`` and ``memfit.compile`` that the
budget and strategy check (``resolve_budget_and_strategy``) does not cover, made at the call
that received them, before torch traces anything: inside a ``torch.compile`` backend a mistake
would surface at the first step, wrapped in Dynamo's ``BackendCompilerFailed``. And for a
``BudgetError`` from a step, the user's own mistake in its inputs first (``the_users_error``).

Example:
    >>> check_hardware_and_optimizer("h999", None)
    Traceback (most recent call last):
    ValueError: unknown hardware profile 'h999': use one of [...]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware, get_hardware


def check_hardware_and_optimizer(hardware: Hardware | str | None, optimizer: Any) -> None:
    """Raise ``ValueError`` for a hardware profile that is neither ``None``, a ``Hardware`` nor a
    built-in profile's name (the message lists them), and for an ``optimizer`` that is not a
    ``torch.optim.Optimizer``."""
    if hardware is not None:
        if not isinstance(hardware, (str, Hardware)):
            raise ValueError(f"hardware= takes a profile name or a memfit.Hardware, not "
                             f"{type(hardware).__name__}")
        get_hardware(hardware)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer= takes the loop's torch.optim.Optimizer, not "
                         f"{type(optimizer).__name__} {optimizer!r}")


def check_optimizer_of(model: torch.nn.Module | None, optimizer: Any) -> None:
    """Raise ``ValueError`` for an ``optimizer`` that steps none of ``model``'s parameters (made
    for another model, or for the original of a ``copy.deepcopy``): its state would be reserved
    beside a model it never updates, and this model's would go uncounted. One that steps some of
    them is the loop's, whatever else it steps (a head trained beside the model, an embedding
    shared with another model: those parameters, gradients and state count as resident too), as
    is one of several optimizers that each step a part of the model."""
    from memfit.runtime.resident import holds_parameters_of

    if model is None or optimizer is None or holds_parameters_of(optimizer, model):
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    raise ValueError(
        f"optimizer= steps none of the model's parameters (its {count} tensors are another "
        f"model's, or those of the original of a copy): pass the optimizer made from this "
        f"model's parameters (torch.optim.{type(optimizer).__name__}(model.parameters()), "
        "after any copy.deepcopy), or leave optimizer= out and memfit finds the one that steps "
        "the model at its first step()")


def check_step(model: Any, loss_fn: Any) -> None:
    """Raise ``ValueError`` unless ``model`` is a ``torch.nn.Module`` and ``loss_fn`` a callable
    (``memfit.compile``, ``plan`` and ``max_batch_size`` take ``loss_fn(model, *inputs)``): a
    tensor passed where ``loss_fn`` goes is the usual slip."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model takes the torch.nn.Module trained, not {type(model).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn takes a callable loss_fn(model, *inputs) -> scalar loss, not "
                         f"{type(loss_fn).__name__}: pass it before the inputs")


def check_dynamic(dynamic: Any) -> None:
    """Raise ``ValueError`` for a ``dynamic=`` that is not ``None``, ``True`` or ``False``
    (``torch.compile`` would refuse it only at the first call)."""
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(f"dynamic= takes None (symbolic sizes once a shape changes), True or "
                         f"False, not {dynamic!r}")


def check_flags(**flags: Any) -> None:
    """Raise ``ValueError`` for a flag argument that is not a ``bool`` (``measure="no"`` is true)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}= takes True or False, not {value!r}")


def the_users_error(error: BaseException, run: Callable[[], Any], model: torch.nn.Module,
                    values: Any) -> BaseException:
    """The error to raise for ``error`` (memfit's, from a call on ``values``): where a
    ``BudgetError`` may stand for a mistake in the user's own inputs, that mistake first.

    A floating input of a dtype none of ``model``'s floating parameters has (a float64 batch
    into a float32 model, autocast off) fails in eager code, but the traced graph may convert
    it and plan it: then ``run()`` (the call, eagerly, without gradients) raises the user's own
    error, which is returned. An empty input (a dimension of size 0) is named in the
    ``BudgetError``'s note: its step holds no activations to plan.
    """
    if not isinstance(error, BudgetError):
        return error
    tensors = [leaf for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor)]
    if _foreign_float_dtype(tensors, model):
        try:
            with torch.no_grad():
                run()
        except Exception as own:  # noqa: BLE001 - whatever the user's code raises is theirs
            return own.with_traceback(None)
    empty = [tuple(tensor.shape) for tensor in tensors if tensor.numel() == 0]
    if not empty:
        return error
    note = (f"The batch is empty (an input of shape {empty[0]}): the step holds no activations "
            "to plan, only the model's own bytes.")
    return BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant, error.strategy,
                       f"{error.note} {note}".strip(), error.host_bytes)


def _foreign_float_dtype(tensors: list[torch.Tensor], model: torch.nn.Module) -> bool:
    own = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not own or any(torch.is_autocast_enabled(t.device.type) for t in tensors):
        return False
    return any(t.is_floating_point() and t.dtype not in own for t in tensors)
