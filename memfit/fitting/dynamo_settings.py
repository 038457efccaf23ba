"""The Dynamo settings a fitted model's call is compiled under, so that all of it is compiled with
memfit's backend and planned: entries and a recompile limit of its own (``own_recompiles``),
sizes marked dynamic once a shape changes (``dynamic_on_change``), the hooks it was compiled
with (``HookWatch``), its RNNs traced where memfit
traces them as eager runs them (``traces_rnns``, ``rnn_traced``), a DDP model's forward compiled
as one graph (``whole_ddp_graph``), and each FSDP2 unit's forward compiled with the backend
(``units_compiled``).

Example:
    >>> with rnn_traced(traces_rnns(model, "aot_eager")), whole_ddp_graph():
    ...     compiled(*args)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memfit.compiler.unit_forward import unit_forward
from memfit.data.errors import BudgetWarning


def own_recompiles() -> dict[str, Any]:
    """``torch.compile``'s option that gives each compiled call its own entries and recompile
    limit (torch 2.13 on): otherwise every model of one class shares one code object, so one
    model's recompiles count against every other's limit, and one past it runs all eagerly."""
    import inspect

    return ({"isolate_recompiles": True}
            if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {})


def dynamic_on_change(before: tuple | None, arguments: Any) -> tuple:
    """The shapes of the call's tensors; where one differs from the last call's, that dimension
    and the first (the batch) of every tensor are marked maybe-dynamic, so that Dynamo's one
    trace with symbolic sizes also serves a smaller last batch (and a changing length also
    a changing batch), instead of tracing again when the next dimension changes."""
    from torch.utils._pytree import tree_leaves

    tensors = [leaf for leaf in tree_leaves(arguments) if isinstance(leaf, torch.Tensor)]
    shapes = tuple(tuple(tensor.shape) for tensor in tensors)
    if before is None or before == shapes or len(before) != len(shapes):
        return shapes
    for tensor, shape, previous in zip(tensors, shapes, before, strict=True):
        changed = {dim for dim, (a, b) in enumerate(zip(shape, previous, strict=False)) if a != b}
        for dim in changed | ({0} if shape and shape[0] > 1 else set()):
            if dim < len(shape):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return shapes


def rnn_traced(traced: bool) -> contextlib.AbstractContextManager:
    """While the model runs, Dynamo traces its RNNs where ``traces_rnns`` said so; the flag is
    put back after."""
    return torch._dynamo.config.patch(allow_rnn=True) if traced else contextlib.nullcontext()


class HookWatch:
    """Whether the hooks on a model's modules (forward and backward) or the global module hooks
    changed since the last call it saw: Dynamo does not guard on hooks
    (``skip_nnmodule_hook_guards``) and runs those it first traced, so a hook registered or
    removed later (a logging hook, pruning's pre-hook) is what a fitted model compiles anew for,
    as eager would run it. Per call it reads the handle counter (a hook registered anywhere
    moves it) and the hook count of the dictionaries found last (a removal lowers it); only
    when either moved are the model's dictionaries walked again and their handles summed
    (handle ids are never reused, so any change moves the sum)."""

    def __init__(self) -> None:
        self.dictionaries: list[dict] = []
        self.handles_made = -1
        self.count = -1
        self.handle_sum: int | None = None

    def changed(self, model: torch.nn.Module) -> bool:
        """Whether the hooks differ from those at the last call (``False`` at the first)."""
        from torch.nn.modules import module as modules
        from torch.utils.hooks import RemovableHandle

        made = RemovableHandle.next_id
        if made == self.handles_made and sum(map(len, self.dictionaries)) == self.count:
            return False
        self.dictionaries = [modules._global_forward_pre_hooks, modules._global_forward_hooks,
                             modules._global_backward_pre_hooks, modules._global_backward_hooks]
        for module in model.modules():
            self.dictionaries += (module._forward_pre_hooks, module._forward_hooks,
                                  module._backward_pre_hooks, module._backward_hooks)
        handle_sum = sum(map(sum, self.dictionaries))
        changed = self.handle_sum is not None and handle_sum != self.handle_sum
        self.handles_made, self.handle_sum = made, handle_sum
        self.count = sum(map(len, self.dictionaries))
        return changed


def has_ddp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is or holds a ``DistributedDataParallel`` (whose forward Dynamo
    compiles in its ``optimize_ddp`` mode: ``whole_ddp_graph``)."""
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(module, DistributedDataParallel) for module in model.modules())


def whole_ddp_graph() -> contextlib.AbstractContextManager:
    """While the fitted model runs, Dynamo compiles a ``DistributedDataParallel`` forward as one
    graph: its default ``optimize_ddp`` mode (``DDPOptimizer``) splits the graph into a region
    per gradient bucket, compiled one after another, so each would be planned before the
    regions after it exist and the first iteration could exceed the budget. One region is
    planned whole from the first call; DDP's all-reduces then start once its backward has
    produced every gradient (as with ``optimize_ddp=False``). A mode the user chose is kept."""
    if torch._dynamo.config.optimize_ddp not in (True, "ddp_optimizer"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(optimize_ddp=False)


def traces_rnns(model: torch.nn.Module, compiler: str) -> bool:
    """Whether Dynamo should trace ``model``'s RNN modules (it skips the frames that call one
    otherwise, and they run eagerly, outside any plan): with ``aot_eager`` on a CPU, where memfit
    traces ``nn.LSTM`` as eager runs it (``memfit.tracing.rnn``), and not for a model with an
    ``nn.GRU``, whose traced gradients are not eager's bit for bit. Warns where RNNs stay
    outside the plans.
    """
    rnns = [module for module in model.modules() if isinstance(module, torch.nn.RNNBase)]
    if not rnns or torch._dynamo.config.allow_rnn:  # none, or the user lets Dynamo trace them
        return False
    on_cpu = all(p.device.type == "cpu" for rnn in rnns for p in rnn.parameters())
    has_gru = any(isinstance(rnn, torch.nn.GRU) for rnn in rnns)
    if compiler == "aot_eager" and on_cpu and not has_gru:
        return True
    if compiler != "aot_eager":
        why = "memfit traces RNNs with compiler='aot_eager' only"
    elif not on_cpu:
        why = "memfit traces RNNs on a CPU only: cuDNN's RNN kernels are not checked"
    else:
        why = "nn.GRU traced is not bit for bit eager's"
    kinds = sorted({type(rnn).__name__ for rnn in rnns})
    warnings.warn(f"memfit: the model's {', '.join(kinds)} run eagerly, outside any plan ({why}); "
                  "Dynamo skips the code that calls them, so that memory is not planned and a "
                  "measured peak may exceed the budget", BudgetWarning, stacklevel=3)
    return False


def compiled_unit_forwards(module: torch.nn.Module, backend: Callable
                           ) -> list[tuple[torch.nn.Module, Callable]]:
    """Each FSDP2 unit of ``module`` whose ``forward`` Dynamo would not compile, with that
    forward compiled with ``backend`` (``units_compiled`` puts it in place)."""
    from torch._dynamo import trace_rules

    from memfit.runtime.resident import fsdp_unit_modules

    return [(unit, functools.partial(torch.compile(unit_forward, backend=backend, dynamic=False,
                                                   **own_recompiles()), unit))
            for unit in fsdp_unit_modules(module)
            # not one with a forward of its own (the user's), nor one Dynamo compiles itself
            if "forward" not in unit.__dict__ and trace_rules.check(type(unit).forward)]


@contextlib.contextmanager
def units_compiled(compiled: list[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """While the fitted model runs, each FSDP2 unit in ``compiled`` runs its forward compiled
    with memfit's backend (``compiled_unit_forwards``); the user's modules are as they were
    outside.

    Why: FSDP2's hooks are ``torch._dynamo.disable``d, so Dynamo breaks the graph at every
    unit's call and the unit runs from eager code; Dynamo then compiles the frames it meets
    inside, but not those of files it skips, such as ``torch.nn``'s containers and layers. A
    unit that is an ``nn.Sequential`` (MONAI's U-Net stages, a plain ``Sequential`` of blocks)
    would run its convolutions, norms and activations eagerly, outside any plan, holding
    activations no plan could drop: the step would peak at eager's peak whatever the budget.
    """
    for unit, forward in compiled:
        unit.forward = forward
    try:
        yield
    finally:
        for unit, _ in compiled:
            del unit.forward
