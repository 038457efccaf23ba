"""``memfit.fit``: a model compiled with memfit's backend, in the user's own loop.

``fit`` is ``torch.compile(model, backend=memfit.backend(...), dynamic=False)`` plus what makes a
budget hold over a whole training run: the model itself passed to the backend, so that its
parameters, gradients and buffers count and its regions are planned again when more stays
resident than their plans left room for (``memfit.compiler.replanning``: optimizer state, gradients kept
across micro-batches), the loop's optimizer found by its first step, and memfit's own errors
raised whole instead of wrapped by Dynamo. ``report`` shows what was planned.

Example:
    >>> model = memfit.fit(model, budget=0.5, optimizer=optimizer)
    >>> loss = model(**batch).loss; loss.backward(); optimizer.step()
    >>> print(memfit.report(model))
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch

from memfit.compiler.backend import COMPILERS, Backend
from memfit.compiler.plan_step import BudgetWarning
from memfit.data.hardware import Hardware


def fit(model: torch.nn.Module, budget: str | int | float | None = None,
        strategy: str | None = None, hardware: Hardware | str | None = None,
        compiler: str = "aot_eager", optimizer: torch.optim.Optimizer | None = None,
        **params: Any) -> torch.nn.Module:
    """``model`` compiled so that each training iteration fits ``budget``: the one-line form of
    ``torch.compile(model, backend=memfit.backend(...), dynamic=False)``.

    Each input shape is planned on its own (``dynamic=False``); Dynamo's guards decide when a
    region is traced and planned again (a frozen layer, a changed Python value, a new shape).
    Arguments are those of ``memfit.backend``; ``memfit.report(compiled)`` shows the plans.

    Example:
        >>> model = memfit.fit(model, budget=0.5, optimizer=optimizer)
        >>> loss = model(**batch).loss; loss.backward(); optimizer.step()
    """
    from memfit.runtime.ranks import agreement_group

    planner = backend(budget, strategy, hardware, compiler, optimizer, model=model, **params)
    agreement_group()  # in a distributed job: made here, where every rank calls fit, not mid-step
    _watch_optimizers(planner)
    planner.checks_calls = True
    compiled = torch.compile(model, backend=planner, dynamic=False, **own_recompiles())
    compiled.__class__ = _fitted_class()
    compiled._memfit_backend = planner  # type: ignore[assignment]
    compiled._memfit_traces_rnns = _traces_rnns(model, compiler)  # type: ignore[assignment]
    return compiled


def own_recompiles() -> dict[str, Any]:
    """``torch.compile``'s option that gives each call its own compiled entries and recompile
    limit (torch 2.13 on): by default every compiled module shares one code object, so one
    model's recompiles count against every other's limit, and one past it runs all eagerly."""
    import inspect

    return ({"isolate_recompiles": True}
            if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {})


def _watch_optimizers(planner: Backend) -> None:
    """Find the loop's optimizer by its first step, when ``optimizer=`` was not given, so that
    its state counts from the next iteration on (a global post-step hook, held weakly); after a
    step, the watch of eager code leaves the mode stack once measuring has ended
    (``Backend.end_eager_watch``)."""
    import weakref

    from torch.optim.optimizer import register_optimizer_step_post_hook

    reference = weakref.ref(planner)

    def adopt(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found = reference()  # a dead backend leaves a hook that does nothing: torch iterates
        if found is not None:  # the hooks while calling them, so it cannot remove itself here
            found.adopt(optimizer)
            found.end_eager_watch()  # off the stack once measuring ended (not inside a backward)

    register_optimizer_step_post_hook(adopt)


def _fitted_class() -> type:
    """``torch.compile``'s module type, raising memfit's own errors as they are.

    Dynamo wraps an error of a backend in ``BackendCompilerFailed``; a ``BudgetError`` (with its
    ``minimum_bytes``) or a ``CaptureError`` is what the user can act on, so it comes out whole.
    """
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.exc import BackendCompilerFailed

    from memfit.compiler.unplanned import (
        call_ended,
        call_started,
        conversion_failed,
        dispatch_modes,
    )
    from memfit.data.errors import BudgetError, CaptureError
    from memfit.model.schedule import PlanError

    class FittedModule(OptimizedModule):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            planner = self._memfit_backend
            planner.end_eager_watch()
            planner.watch_first_call(self._orig_mod)
            planner.note_call_arguments((args, kwargs))
            start = call_started(planner)
            try:
                if dispatch_modes():  # Dynamo runs it eagerly and skips its entry for good
                    result = self._orig_mod(*args, **kwargs)
                else:
                    with _rnn_traced(self._memfit_traces_rnns), _units_compiled(self):
                        result = super().__call__(*args, **kwargs)
            except BaseException as failed:
                if conversion_failed(start):  # Dynamo gave up on a frame of this model
                    _compile_anew(self)
                inner = getattr(failed, "inner_exception", None)
                if (isinstance(failed, BackendCompilerFailed)
                        and isinstance(inner, (BudgetError, CaptureError, PlanError))):
                    raise inner.with_traceback(None) from None
                raise
            call_ended(planner, start, self._orig_mod, (args, kwargs))
            if planner.compiler == "aot_eager":  # its backward modules take None (inductor's do not)
                _lazy_output_gradients(result)
            planner.watch_eager()  # what the loop holds beside the regions (memfit.runtime.outside)
            return result

    return FittedModule


def _compile_anew(fitted: Any) -> None:
    """Give ``fitted`` fresh compiled entries, traced and planned at its next call, in place of
    those an exception left: Dynamo marks the frame whose trace met an exception (a hook that
    raised, a Ctrl-C, a data check) skipped for good, for this model's entries
    (``own_recompiles``), so every later call would run eagerly. The plans its next call makes
    replace the current ones."""
    from memfit.compiler.unplanned import undo_entry_skips

    planner = fitted._memfit_backend
    fresh = torch.compile(fitted._orig_mod, backend=planner, dynamic=False, **own_recompiles())
    for name in ("dynamo_ctx", "forward", "_forward"):
        if name in fresh.__dict__:
            fitted.__dict__[name] = fresh.__dict__[name]
    fitted.__dict__.pop("_memfit_unit_forwards", None)  # FSDP2 units: compiled anew too
    for region in planner.regions:
        region.replaced = True
    undo_entry_skips()  # without its own entries (torch before 2.13): the shared entry's skip


@contextlib.contextmanager
def _units_compiled(fitted: Any) -> Any:
    """While the fitted model runs, each FSDP2 unit whose ``forward`` Dynamo would not compile
    runs it compiled with memfit's backend (the user's modules are as they were outside).

    Why: FSDP2's hooks are ``torch._dynamo.disable``d, so Dynamo breaks the graph at every
    unit's call and the unit runs from eager code; Dynamo then compiles the frames it meets
    inside, but not those of files it skips, such as ``torch.nn``'s containers and layers. A
    unit that is an ``nn.Sequential`` (MONAI's U-Net stages, a plain ``Sequential`` of blocks)
    ran its convolutions, norms and activations eagerly, outside any plan: on the U-Net (2
    ranks, channels 4-16, 16^3) its last stage's transposed convolution, norm and activation
    held 196,608 B of activations no plan could drop, and memfit measured eager's peak at
    every budget.
    """
    from torch._dynamo import trace_rules

    from memfit.runtime.resident import fsdp_unit_modules

    compiled = fitted.__dict__.get("_memfit_unit_forwards")
    if compiled is None:  # found once: fully_shard comes before memfit.fit
        compiled = fitted.__dict__["_memfit_unit_forwards"] = [
            (unit, functools.partial(torch.compile(
                _unit_forward, backend=fitted._memfit_backend, dynamic=False,
                **own_recompiles()), unit))
            for unit in fsdp_unit_modules(fitted._orig_mod)
            # not one with a forward of its own (the user's), nor one Dynamo compiles itself
            if "forward" not in unit.__dict__ and trace_rules.check(type(unit).forward)]
    for unit, forward in compiled:
        unit.forward = forward
    try:
        yield
    finally:
        for unit, _ in compiled:
            del unit.forward


def _unit_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A unit's own ``forward``, in a frame Dynamo compiles whose ``self`` is the unit (where
    ``memfit.compiler.graph_breaks.compiling_site`` finds which unit a region is)."""
    return type(self).forward(self, *args, **kwargs)


def _rnn_traced(traced: bool) -> contextlib.AbstractContextManager:
    """While the model runs, Dynamo traces its RNNs where ``_traces_rnns`` said so; the flag is
    put back after."""
    return torch._dynamo.config.patch(allow_rnn=True) if traced else contextlib.nullcontext()


def _traces_rnns(model: torch.nn.Module, compiler: str) -> bool:
    """Whether Dynamo should trace ``model``'s RNN modules (it skips the frames that call one
    otherwise, and they run eagerly, outside any plan): with ``aot_eager`` on a CPU, where memfit
    traces ``nn.LSTM`` as eager runs it (``memfit.graph.rnn``), and not for a model with an
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


def _lazy_output_gradients(result: Any) -> None:
    """Let the backward of each compiled region that produced ``result`` receive ``None`` for
    outputs nothing used, instead of zeros autograd makes before it starts (see
    ``memfit.compiler.region_run.zeros_at_first_use``). All outputs of a region share one backward node."""
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(result):
        node = getattr(leaf, "grad_fn", None) if isinstance(leaf, torch.Tensor) else None
        if node is not None and type(node).__name__ == "CompiledFunctionBackward":
            node.set_materialize_grads(False)


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
            partitioner, so results are ``torch.compile(model)``'s, see ``memfit.graph.inductor``).
        optimizer: the optimizer of the loop, so that its state is reserved in the budget before
            its first ``step()`` creates it. Without it, state that exists when a region is
            planned still counts, but on the first iteration none exists yet.
        model: the model, so that its parameters outside a region count (``memfit.fit`` passes it).
        measure_runs: how many forward and backward runs of each planned region are measured
            for ``report``'s measured column (the first ones after each plan; 2 covers the first
            iteration, whose optimizer state is only reserved, and one with it real). A measured
            run starts a profiler (on a CPU) or a dispatch mode, which costs time, so not every
            run is measured; 0 turns measuring off, a large number measures every run. The
            bytes eager code holds beside a region are read on these runs only.
        **params: the strategy's parameters.

    Raises:
        ValueError: for a malformed budget, an unknown strategy, parameter or compiler.
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
    from memfit.planning.strategies import resolve_budget_and_strategy

    if measure_runs < 0:
        raise ValueError(f"measure_runs must be 0 or more, got {measure_runs}")
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: use one of {COMPILERS}")
    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    return Backend(parsed, chosen, hardware, compiler, optimizer, model, params, measure_runs)
