"""``memfit.fit``: a model fitted in place with memfit's backend, in the user's own loop.

``fit`` is ``model.compile(backend=memfit.backend(...), dynamic=None)`` plus what makes a
budget hold over a whole training run: the model itself passed to the backend, so that its
parameters, gradients and buffers count and its regions are planned again when more stays
resident than their plans left room for (``memfit.compiler.replanning``: optimizer state, gradients kept
across micro-batches), the loop's optimizer found by its first step, and memfit's own errors
raised whole instead of wrapped by Dynamo. The fitted model stays the model (its class, keys,
signature and attributes); ``unfit`` makes it plain again, ``report`` shows what was planned.

Example:
    >>> model = memfit.fit(model, budget=0.5, optimizer=optimizer)
    >>> loss = model(**batch).loss; loss.backward(); optimizer.step()
    >>> print(memfit.report(model))
"""

from __future__ import annotations

import contextlib
import functools
import gc
import traceback
import types
from dataclasses import dataclass, replace
from typing import Any

import torch

from memfit.compiler.backend import COMPILERS, Backend
from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import latest_regions
from memfit.compiler.partners import note_call, note_fitted
from memfit.data.hardware import Hardware
from memfit.fitting.callers_compile import add_hook, own_trace, remove_hook
from memfit.fitting.dynamo_settings import (
    HookWatch,
    compiled_unit_forwards,
    dynamic_on_change,
    has_ddp,
    own_recompiles,
    rnn_traced,
    traces_rnns,
    units_compiled,
    whole_ddp_graph,
)
from memfit.fitting.loop_optimizer import adopt_existing_optimizers, watch_optimizers


def fit(model: torch.nn.Module, budget: str | int | float | None = None,
        strategy: str | None = None, hardware: Hardware | str | None = None,
        compiler: str = "aot_eager", optimizer: torch.optim.Optimizer | None = None,
        dynamic: bool | None = None, **params: Any) -> torch.nn.Module:
    """``model`` fitted in place, so that each training iteration fits ``budget``, and returned:
    ``model.compile(backend=memfit.backend(...), dynamic=dynamic)`` with the model given to the
    backend.

    The fitted model is the model: its class, ``state_dict`` keys, parameters, ``forward``
    signature, attributes and hooks are its own, so checkpoints, ``transformers.Trainer`` and
    Lightning see a plain module. Only its call is compiled (as ``nn.Module.compile`` does);
    ``memfit.unfit(model)`` makes it plain again. Dynamo's guards decide when a region is traced
    and planned again (a frozen layer, a changed Python value). With ``dynamic=None`` (default) a
    region whose input shapes change is traced once more with symbolic sizes, and that plan,
    priced at the largest sizes (or the maximum declared with
    ``torch._dynamo.mark_dynamic(x, dim, max=...)``), serves every shape within them; a larger
    shape plans it once more (``docs/shapes.md``). ``dynamic=False`` plans each shape on its own.
    ``memfit.report(model)`` shows the plans.

    Args:
        budget: as ``memfit.backend``; ``None`` (with no ``strategy``) or ``"auto"``: on CUDA,
            the device's free memory at the first call less a margin (``device_budget``); on a
            CPU, no limit (``keep``).
        dynamic: ``None`` (default): symbolic sizes once a shape changes; ``False``: a plan per
            shape; ``True``: symbolic sizes from the first call (as ``torch.compile``).
        strategy, hardware, compiler, optimizer, params: as ``memfit.backend``.

    Note:
        Copies: ``copy.deepcopy(model)``, ``pickle`` and ``torch.save(model)`` give a fitted copy
        with a backend of its own, made from the same arguments less ``optimizer`` (the copy's
        optimizer is found by its first ``step``): it plans afresh at its first call, and shares
        no region, plan or compiled code with the original.

    Example:
        >>> model = memfit.fit(model, budget=0.5, optimizer=optimizer)
        >>> loss = model(**batch).loss; loss.backward(); optimizer.step()
        >>> torch.save(model.state_dict(), "model.pt")  # the plain model's keys
    """
    from memfit.fitting.arguments import check_dynamic
    from memfit.runtime.ranks import agreement_group

    check_dynamic(dynamic)
    model = _uncompiled(model)  # a torch.compile wrapper's module is fitted in its place
    unfit(model)  # a model fitted before is fitted anew
    fitted = FittedCall(model, FitArguments(budget, strategy, hardware, compiler,
                                            tuple(params.items()), dynamic), optimizer)
    agreement_group()  # in a distributed job: made here, where every rank calls fit, not mid-step
    fitted.traces_rnns = traces_rnns(model, compiler)
    fitted.install()
    return model


def unfit(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` plain again, returned: its call no longer compiled nor planned (its parameters,
    buffers and the user's hooks are untouched). A model that is not fitted is returned as it
    is."""
    module = _uncompiled(model)
    state = module.__dict__
    if isinstance(state.get(FITTED_KEY), FittedCall):
        remove_hook(module)
        for key in (FITTED_KEY, BACKEND_KEY, "_compiled_call_impl"):
            state.pop(key, None)  # the class's _compiled_call_impl, None, is seen again
    return model


@dataclass(frozen=True)
class FitArguments:
    """What ``memfit.fit`` was given, less the optimizer: what a copy of a fitted model is fitted
    with again."""

    budget: str | int | float | None
    strategy: str | None
    hardware: Hardware | str | None
    compiler: str
    params: tuple[tuple[str, Any], ...]
    dynamic: bool | None = None

    @property
    def automatic(self) -> bool:
        """Whether the budget is the device's free memory (``device_budget``)."""
        return self.budget == "auto" or (self.budget is None and self.strategy is None)


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wrapped, where ``model`` is such a wrapper; else
    ``model``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


FITTED_KEY = "_memfit_fitted"  # in a fitted model's __dict__: its FittedCall (kept by copies)
BACKEND_KEY = "_memfit_backend"  # its Backend, which memfit.report reads


class FittedCall:
    """A fitted model's call: the model's ``_compiled_call_impl``, which ``nn.Module.__call__``
    runs in place of ``_call_impl`` (as ``nn.Module.compile`` sets it), compiled with its memfit
    backend on the first call. Raises memfit's own errors whole: Dynamo wraps an error of a
    backend in ``BackendCompilerFailed``, while a ``BudgetError`` (with its ``minimum_bytes``)
    or a ``CaptureError`` is what the user can act on.

    A copy (``copy.deepcopy``, ``pickle``) is made anew for the copied model
    (``_fitted_copy``): none of this object's state is copied or shared.
    """

    def __init__(self, module: torch.nn.Module, arguments: FitArguments,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.module = module
        self.arguments = arguments
        self.backend = _planner(module, arguments, optimizer)
        note_fitted(self.backend)  # other fitted models count its resident bytes (partners)
        self.traces_rnns: bool | None = None  # read from the model at the first call if unset
        self.holds_ddp: bool | None = None  # whether it holds a DDP module (first call)
        self.unit_forwards: list | None = None  # FSDP2 units compiled (_compiled_units)
        self._compiled: Any = None  # the model's _call_impl compiled, made at the first call
        self.joint_first = False  # its regions may be planned jointly on fakes (joint_first)
        self.shapes: tuple | None = None  # the last call's input shapes (dynamic_on_change)
        self.device_fitted = False  # whether an automatic budget was read from the device
        self.hooks = HookWatch()  # the hooks it was compiled with

    def install(self) -> None:
        """Be the module's call, and its ``_memfit_backend`` the backend (``memfit.report``)."""
        state = self.module.__dict__  # not Module.__setattr__: a copy's state may not be set yet
        state["_compiled_call_impl"] = state[FITTED_KEY] = self
        state[BACKEND_KEY] = self.backend
        add_hook(self.module)  # a torch.compile of the caller's breaks here (callers_compile)

    def __reduce__(self) -> tuple:
        return _fitted_copy, (self.module, self.arguments)

    @torch._dynamo.disable  # never traced by a compile of the caller's (callers_compile)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import BackendCompilerFailed

        from memfit.compiler.unplanned import (
            call_ended,
            call_started,
            conversion_failed,
            dispatch_modes,
            traced_since,
        )
        from memfit.data.errors import BudgetError, CaptureError
        from memfit.fitting.arguments import the_users_error
        from memfit.model.schedule import PlanError

        planner = self.backend
        note_call(planner)
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            planner.training_calls += 1  # a step of its gradients follows (stepped_without_a_call)
        planner.end_eager_watch()
        planner.watch_first_call(self.module)
        under_a_mode = bool(dispatch_modes())  # Dynamo would run it eagerly, skipped for good
        # a hook registered or removed is traced as eager runs it; not a dispatch mode's
        # (FlopCounterMode's), under which the module runs directly
        if not under_a_mode and self.hooks.changed(self.module) and self._compiled is not None:
            self.compile_anew()
        if self._compiled is None:
            self._first_call(args, kwargs)
            if not planner.optimizers:
                adopt_existing_optimizers(planner)
        planner.note_call_arguments((args, kwargs))
        if self.arguments.dynamic is None:
            self.shapes = dynamic_on_change(self.shapes, (args, kwargs))
        start = call_started(planner)
        try:
            if under_a_mode:
                result = self.module._call_impl(*args, **kwargs)
            else:
                result = self._call_compiled(args, kwargs)
        except BaseException as failed:
            if conversion_failed(start):  # Dynamo gave up on a frame of this model
                self.compile_anew()
            inner = getattr(failed, "inner_exception", None)
            if (isinstance(failed, BackendCompilerFailed)
                    and isinstance(inner, (BudgetError, CaptureError, PlanError))):
                # the frames the error passed through (Dynamo's, the backend's) hold the call's
                # tensors; the error raised keeps this frame, and with it those, until a gc
                traceback.clear_frames(failed.__traceback__)
                raise the_users_error(inner, lambda: self.module._call_impl(*args, **kwargs),
                                      self.module, (args, kwargs)) from None
            raise
        call_ended(planner, start, self.module, (args, kwargs))
        if traced_since(start):
            # a trace leaves reference cycles (a traced exception's traceback and the closure of
            # Dynamo's handler) that hold the frames above it, this call's output among their
            # locals, until a collection; the loop would hold the logits through the backward
            gc.collect()
        planner.watch_eager()  # what the loop holds beside the regions (memfit.runtime.outside)
        return result

    def _call_compiled(self, args: tuple, kwargs: dict) -> Any:
        """The compiled call. Until a region is planned, its first region, where a graph break
        follows it, has the call traced on fakes before it first runs
        (``Backend._capped_jointly``, ``memfit.fitting.joint_first``)."""
        from memfit.fitting.joint_first import plan_regions_on_fakes

        planner = self.backend
        if self.joint_first and not latest_regions(planner.regions):  # none, or compiled anew
            planner.trace_first_call(functools.partial(
                plan_regions_on_fakes, planner, self._call_traced(), args, kwargs,
                self.arguments.dynamic))
        try:
            if self.holds_ddp is None:  # found once, as the FSDP2 units are
                self.holds_ddp = has_ddp(self.module)
            with (rnn_traced(bool(self.traces_rnns)),
                  whole_ddp_graph() if self.holds_ddp else contextlib.nullcontext(),
                  units_compiled(self._compiled_units()), own_trace()):
                return self._compiled(*args, **kwargs)
        finally:
            planner.trace_first_call(None)  # the trace holds the call's arguments

    def _compiled_units(self) -> list:
        """Each FSDP2 unit with its forward compiled with the backend
        (``compiled_unit_forwards``), found once: ``fully_shard`` comes before ``memfit.fit``."""
        if self.unit_forwards is None:
            self.unit_forwards = compiled_unit_forwards(self.module, self.backend)
        return self.unit_forwards

    def _first_call(self, args: tuple, kwargs: dict) -> None:
        """Compile the model's call, as ``torch.compile(model)`` does: Dynamo skips the frames of
        ``torch.nn``'s own modules, so one of those is called through a frame it traces. An
        automatic budget is read from the device now (``device_budget``)."""
        from memfit.fitting.device_budget import fit_device

        module = self.module
        if self.traces_rnns is None:  # a copy: its state was not there when it was made
            self.traces_rnns = traces_rnns(module, self.arguments.compiler)
        if self.arguments.automatic and not self.device_fitted:
            self.device_fitted = True  # read once: a compile anew keeps the budget it had
            fit_device(self.backend, _call_device(module, (args, kwargs)),
                       self.arguments.strategy, dict(self.arguments.params))
        self._compiled = torch.compile(self._call_traced(), backend=self.backend,
                                       dynamic=self.arguments.dynamic, **own_recompiles())
        self.joint_first = not (latest_regions(self.backend.regions) or _fsdp_units(module)
                                or _distributed())

    def _call_traced(self) -> Any:
        """What Dynamo traces for the model's call: its ``_call_impl``, through a frame Dynamo
        traces where the module is one of ``torch.nn``'s own (whose frames it skips)."""
        from torch._dynamo import external_utils, trace_rules

        module, call = self.module, self.module._call_impl
        if isinstance(module.forward, types.MethodType) and trace_rules.check(module.forward):
            call = external_utils.wrap_inline(call)
        return call

    def compile_anew(self) -> None:
        """Fresh compiled entries, traced and planned at the next call, in place of those an
        exception left: Dynamo marks the frame whose trace met an exception (a hook that raised,
        a Ctrl-C, a data check) skipped for good for this model's entries (``own_recompiles``),
        so every later call would run eagerly. The plans the next call makes replace these."""
        from memfit.compiler.unplanned import undo_entry_skips

        self._compiled = None
        self.shapes = None
        self.unit_forwards = None  # FSDP2 units: compiled anew too
        self.holds_ddp = None
        for region in self.backend.regions:
            region.replaced = True
        undo_entry_skips()  # without entries of its own (torch before 2.13): the shared skip


def _fitted_copy(module: torch.nn.Module, arguments: FitArguments) -> FittedCall:
    """The call of ``module``, a copy of a fitted model that ``copy.deepcopy`` or ``pickle`` is
    building: made once (its ``FittedCall`` and its ``Backend`` both ask for it), with a backend
    of its own, and installed in the copy's ``__dict__`` (``nn.Module.__getstate__`` leaves
    ``_compiled_call_impl`` out of what is copied)."""
    found = module.__dict__.get(FITTED_KEY)
    if not isinstance(found, FittedCall):
        found = FittedCall(module, arguments)
        found.install()
    return found


def _copied_backend(module: torch.nn.Module, arguments: FitArguments) -> Backend:
    """The backend of a fitted model's copy (``BackendOptions.copy_as``)."""
    return _fitted_copy(module, arguments).backend


def _planner(module: torch.nn.Module, arguments: FitArguments,
             optimizer: torch.optim.Optimizer | None) -> Backend:
    """The backend of a fitted ``module``: ``memfit.backend`` with the model, watching for the
    loop's optimizer; a copy of it is the copy's own (``_copied_backend``)."""
    budget = None if arguments.budget == "auto" else arguments.budget
    params = dict(arguments.params)
    measure_runs = params.pop("measure_runs", 2)  # memfit.backend's, given to memfit.fit
    options = backend_options(budget, arguments.strategy, arguments.hardware,
                              arguments.compiler, optimizer, module, measure_runs, params)
    planner = Backend(replace(options, copy_as=(_copied_backend, (module, arguments)),
                              checks_calls=True),  # each call that runs no plan: unplanned.py
                      optimizer, module)
    watch_optimizers(planner, BACKEND_KEY)
    return planner


def _call_device(module: torch.nn.Module, values: Any) -> torch.device:
    """The device the model runs on: its first parameter's, else its first tensor argument's."""
    from torch.utils._pytree import tree_leaves

    from memfit.runtime.resident import local_tensor

    for tensor in [*module.parameters(), *tree_leaves(values)]:
        if isinstance(tensor, torch.Tensor):
            return local_tensor(tensor).device
    return torch.device("cpu")


def _fsdp_units(module: torch.nn.Module) -> bool:
    """Whether ``module`` has FSDP2 units, which plan their first iteration their own way
    (``memfit.compiler.graph_breaks.first_iteration_cap``)."""
    from memfit.runtime.resident import fsdp_unit_modules

    return bool(fsdp_unit_modules(module))


def _distributed() -> bool:
    """Whether this process is one rank of several: each rank plans its regions with the others
    (collectives in ``plan_region``), which a trace on fakes that fails on one rank only would
    leave waiting; there the regions are planned one by one, then jointly after the first
    iteration."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def backend(budget: str | int | float | None = None, strategy: str | None = None,
            hardware: Hardware | str | None = None, compiler: str = "aot_eager",
            optimizer: torch.optim.Optimizer | None = None, *,
            model: torch.nn.Module | None = None, measure_runs: int = 2,
            **params: Any) -> Backend:
    """A ``torch.compile`` backend that plans every compiled region under ``budget``.

    Args:
        budget: device bytes of the whole iteration's peak (parameters, gradients, optimizer
            state, inputs, activations, temporaries): an int of bytes, a size string
            (``"20GiB"``) or a fraction in (0, 1] of the unplanned peak. ``None``: no limit.
        strategy: as ``memfit.compile`` (default ``"auto"`` with a budget, ``"keep"`` without).
        hardware: the profile for the cost model (default: ``cpu`` on a CPU, measured on a GPU).
        compiler: how the planned modules run: ``"aot_eager"`` (their generated Python code;
            gradients bit for bit eager's with deterministic algorithms on) or ``"inductor"``
            (inductor compiles them, fused kernels and all; memfit replaces only its
            partitioner, so results are ``torch.compile(model)``'s, see ``memfit.lowering.inductor``).
        optimizer: the optimizer of the loop, so that its state is reserved in the budget before
            its first ``step()`` creates it. Without it, state that exists when a region is
            planned still counts, but on the first iteration none exists yet. With ``model``, it
            must step some of the model's parameters; what else it steps (a head trained beside
            the model, an embedding shared with another model) counts as resident too.
        model: the model, so that its parameters outside a region count (``memfit.fit`` passes it).
        measure_runs: how many forward and backward runs of each planned region are measured
            for ``report``'s measured column (the first ones after each plan; 2 covers the first
            iteration, whose optimizer state is only reserved, and one with it real). A measured
            run starts a profiler (on a CPU) or a dispatch mode, which costs time, so not every
            run is measured; 0 turns measuring off, a large number measures every run. The
            bytes eager code holds beside a region are read on these runs only.
        **params: the strategy's parameters.

    Raises:
        ValueError: at this call, for a malformed budget, an unknown strategy, parameter,
            compiler or hardware profile, or an optimizer that is not one or that steps none of
            ``model``'s parameters (another model's: ``check_optimizer_of``).
        BudgetError: when a region is compiled or planned again and no plan fits.

    Note:
        What is planned again, and when: before each run of a training region, if more device
        bytes are resident than its plan left room for, every current region is planned again
        from the graph Dynamo captured (``memfit.compiler.replanning``); Dynamo traces nothing again.
        "Resident" is what this backend knows of: ``model``'s parameters, gradients and buffers
        and ``optimizer``'s parameters, gradients and state. So used directly in
        ``torch.compile`` without ``model=`` and ``optimizer=``, nothing resident is counted:
        optimizer state and gradients kept across micro-batches are planned for by no one, and
        the budget covers the regions' own tensors only. With ``optimizer=`` but no ``model=``,
        its parameters' gradients and state count; an optimizer it was not given is not found
        (``memfit.fit`` finds it by its first ``step``). Graph-broken regions are planned
        jointly after the first iteration either way. Dynamo's own guards (a frozen layer, a
        new shape) trace and plan anew as ``torch.compile`` does. Bytes eager code holds while
        a region runs (a loss computed in the loop, code at a graph break) are read at its
        measured runs' start (``memfit.runtime.outside``: on CUDA from the allocator; on a CPU
        only under ``memfit.fit``, whose module watches the eager code) and a region whose plan
        had no room for them is planned again with them, before its next run.

    Example:
        >>> compiled = torch.compile(model, backend=memfit.backend(budget=0.5), dynamic=False)
    """
    return Backend(backend_options(budget, strategy, hardware, compiler, optimizer, model,
                                   measure_runs, params), optimizer, model)


def backend_options(budget: str | int | float | None, strategy: str | None,
                    hardware: Hardware | str | None, compiler: str,
                    optimizer: torch.optim.Optimizer | None, model: torch.nn.Module | None,
                    measure_runs: int, params: dict[str, Any]) -> BackendOptions:
    """``memfit.backend``'s arguments checked, and the budget parsed once, into its options.

    Raises:
        ValueError: as ``memfit.backend``.
    """
    from memfit.fitting.arguments import check_hardware_and_optimizer, check_optimizer_of
    from memfit.planning.strategies import resolve_budget_and_strategy

    check_hardware_and_optimizer(hardware, optimizer)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model= takes the torch.nn.Module trained, not {type(model).__name__}")
    check_optimizer_of(model, optimizer)
    if isinstance(measure_runs, bool) or not isinstance(measure_runs, int):
        raise ValueError(f"measure_runs must be an int, got {measure_runs!r}")
    if measure_runs < 0:
        raise ValueError(f"measure_runs must be 0 or more, got {measure_runs}")
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: use one of {COMPILERS}")
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params, compiler)
    return BackendOptions(parsed, chosen, hardware, compiler, params, measure_runs)
