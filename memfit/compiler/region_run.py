"""What runs a planned region's forward and backward modules: each run with the region's copy
engine current and the eager watch paused, its first runs measured, a forward opening the region
and its backward closing it (``Region.open_forwards``), the iteration closed after the last
backward; and a backward's unused output gradients made as zeros where first read.

Example:
    >>> compile_module = aot_eager_runner(engine, planner)  # AOTAutograd's fw/bw compiler
"""

from __future__ import annotations

import contextlib
import sys
import unittest.mock
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from memfit.compiler.dropped_gradients import GradientsSeen, note_backward, note_forward
from memfit.compiler.loop_lifetimes import check_loop_lifetimes, collect_before_backward
from memfit.compiler.region import REGION_KEY, Planner, Region
from memfit.compiler.region_lifetimes import observe_loop, remember_outputs, tangents_given
from memfit.compiler.region_peak import measure_region_run
from memfit.compiler.repeated_calls import live_forwards, note_forward_saves, storages_of
from memfit.data.errors import BudgetWarning
from memfit.data.units import format_bytes
from memfit.runtime.streams import CopyEngine, active_engine
from memfit.tracing.rnn import run_rnn_layers_for_training


def aot_eager_runner(engine: CopyEngine, planner: Planner):
    """AOTAutograd's module compiler for ``aot_eager``: the module's own generated code, boxed
    (it frees its inputs as it goes), run with the region's copy engine current; a region's
    forward opens it and its backward closes it (see ``Region.open_forwards``). The first
    ``planner.options.measure_runs`` runs of each region's modules are measured
    (``run_measured``)."""
    from torch.fx.graph import _BoxedCodeGen

    def compile_module(module: fx.GraphModule, example_inputs) -> Any:
        index = module.meta.get(REGION_KEY)
        region = planner.regions[index] if index is not None else None
        is_backward = any(node.meta.get("autograd_backward") for node in module.graph.nodes)
        if is_backward:
            zeros_at_first_use(module.graph)
        if region is not None:  # a training region's module: eager runs under autograd
            run_rnn_layers_for_training(module.graph)
            if is_backward:
                region.backward_input_names = tuple(
                    node.name for node in module.graph.find_nodes(op="placeholder"))
        module.graph.set_codegen(_BoxedCodeGen())
        module.recompile()
        return region_run(planner, region, is_backward, module.forward, engine)

    return compile_module


@contextlib.contextmanager
def saved_tensors_not_donated():
    """While AOTAutograd compiles an ``aot_eager`` region: none of its saved tensors is marked
    *donated*. AOTAutograd marks saved tensors that alias no input or output as donated (for
    inductor to reuse their memory in the backward), and then refuses a backward with
    ``retain_graph=True`` once a backward without it compiled the region's backward: eager
    PyTorch allows it (a second backward through a retained graph, a penalty on gradients). An
    ``aot_eager`` backward reuses no memory of its inputs (it frees each at its last use), so
    nothing is lost; which backward first runs a region's plan is memfit's (a plan made again
    after the first iteration) and no longer decides whether the loop's second backward works."""
    from torch._functorch._aot_autograd import graph_compile

    def none_donated(*_: Any) -> list[int]:
        return []

    if not hasattr(graph_compile, "collect_bw_donated_buffer_idxs"):  # a torch that donates none
        yield
        return
    with unittest.mock.patch.object(graph_compile, "collect_bw_donated_buffer_idxs",
                                    none_donated):
        yield


def inductor_runner(engine: CopyEngine, planner: Planner):
    """What wraps each module inductor compiled for a region (``compile_with_inductor``): the
    same runs as ``aot_eager``'s (``region_run``: measured first runs, the eager code beside
    them read and planned for, open forwards, the iteration closed), without re-simulating the
    plan with the loop's lifetimes (inductor's kernels are bounded by the plan, not predicted
    from them). So a loss computed outside the model (a CPU ``mse_loss``'s input-sized buffer)
    is planned for under inductor as under ``aot_eager``."""

    def wrap(module: fx.GraphModule, compiled: Callable[[list], Any], is_backward: bool) -> Any:
        index = module.meta.get(REGION_KEY)
        region = planner.regions[index] if index is not None else None
        return region_run(planner, region, is_backward, compiled, engine, follow_loop=False)

    return wrap


def region_run(planner: Planner, region: Region | None, is_backward: bool,
                forward: Callable[[list], Any], engine: CopyEngine, follow_loop: bool = True):
    """``forward`` (a region's compiled forward or backward, boxed) run with the region's copy
    engine current and the eager watch paused; its first ``options.measure_runs`` runs measured
    (``measure_region_run``); a forward opens the region and its backward closes it (see
    ``Region.open_forwards``), then ``planner.iteration_closed``. ``follow_loop``: re-simulate
    the plan with the outputs the loop held and the tangents it passed (``observe_loop``)."""

    def run(args: list) -> Any:
        given = (tangents_given(region, args) if region is not None and is_backward
                 and (follow_loop or region.released_outputs) else ())
        inputs = storages_of(args) if region is not None and not is_backward else set()
        if region is not None and not is_backward and not any(
                other.open_forwards for other in planner.regions):
            planner.check_between_iterations(region)  # an iteration opens
        if region is not None and not is_backward and region.program:
            note_forward(planner.gradients_seen.setdefault(region.program, GradientsSeen()),
                         planner.model)
        if region is not None and is_backward:
            collect_before_backward(region)
            plan_for_dropped_gradients(planner, region)
            if keeps_its_graph():
                plan_for_retained_saves(planner, region)
        watch = planner.eager_watch()
        with active_engine(engine), watch.paused() if watch else contextlib.nullcontext():
            if region is not None and region.measuring(planner.options.measure_runs):
                result = measure_region_run(planner, region, forward, args, is_backward)
                if planner.options.warn_over_prediction:
                    warn_if_over_its_prediction(region, is_backward)
            else:
                result = forward(args)
        if watch is not None:  # what it returns is eager code's once an eager op reads it
            watch.note_made(result if is_backward or region is None
                            else result[:len(region.output_names)])
        node = calling_autograd_node() if region is not None or follow_loop else None
        if follow_loop and not is_backward and node is not None:
            # the backward module takes ``None`` for an output nothing used, not the zeros
            # autograd would otherwise make before it starts (``zeros_at_first_use``)
            node.set_materialize_grads(False)
        if region is not None:
            if not is_backward:
                note_forward_saves(region, inputs, remember_outputs(region, result))
            if is_backward and region.released_outputs:
                check_loop_lifetimes(region, given)
            if is_backward and follow_loop and not region.loop_refuted:
                observe_loop(region, given)  # a refuted plan is planned again: nothing to follow
            if is_backward:
                region.backward_closed(node)
                planner.iteration_closed()
            else:
                region.forward_opened(node)
                planner.forward_ran(region)
                region.most_open_forwards = max(region.most_open_forwards,
                                                open_forwards_of_its_code(planner, region))
        return result

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def keeps_its_graph() -> bool:
    """Whether the backward running now was called with ``retain_graph=True``."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(keep_graph()) if keep_graph is not None else False


def plan_for_dropped_gradients(planner: Planner, region: Region) -> None:
    """At a backward's start: where it is the first to show that the loop drops the model's
    gradients after ``region``'s forward (``zero_grad()`` before ``backward()``), or the first
    to show them kept after that, the plans of its program are made again before their next
    run, counting them over their forward only, or as resident. On one process only: each rank
    sees its own loop, and a plan made again on one alone would leave the others in its
    collectives (they count it at their next plan)."""
    from memfit.runtime.ranks import agreement_group

    seen = planner.gradients_seen.get(region.program)
    if (seen is not None and note_backward(seen, planner.model)
            and region.budget_bytes is not None
            and planner.options.fixed_plan is None and agreement_group() is None):
        for other in planner.regions:
            if other.program == region.program:
                other.replaced = True


def plan_for_retained_saves(planner: Planner, region: Region) -> None:
    """At a backward that keeps its graph (``retain_graph=True``: it frees none of the saves it
    reads, the next backward reads them again): every plan made from now on keeps them to the
    backward's end (``with_retained_saves``). Where ``region``'s plan was made without that and
    its peak with them is over its budget, it is planned again before its next run, and this
    call says so where it is over even without the optimizer state its plan reserves that no
    step has made yet."""
    from dataclasses import replace

    from memfit.model.lifetimes import RETAINED_SAVES, with_retained_saves
    from memfit.model.schedule import peak_bytes

    planner.retained_backward = True
    if region.budget_bytes is None or RETAINED_SAVES in region.plan_graph.tensors:
        return
    if region.retained_peak_bytes is None:  # once per plan, not at every retaining backward
        graph = with_retained_saves(region.plan_graph)
        region.retained_peak_bytes = peak_bytes(
            graph, replace(region.plan, graph_hash=graph.structure_hash))
    peak = region.retained_peak_bytes
    if peak + region.outside_bytes <= region.budget_bytes:
        return
    if not region.replaced:  # a third backward through the same forward: counted once
        region.replaced = True
        planner.retained_replans += 1
    if peak + region.outside_bytes - planner.state_to_come_bytes() <= region.budget_bytes:
        return
    region.warned_over = True  # what a measured run of it shows is this, said here
    warnings.warn(
        f"memfit: a backward with retain_graph=True keeps region {region.index}'s saved "
        f"tensors to its end, and its plan, made for a backward that frees each as it reads "
        f"it, then peaks at {format_bytes(peak + region.outside_bytes)}, over the budget "
        f"{format_bytes(region.budget_bytes)}. memfit plans it again for retained backwards "
        "before its next run.", BudgetWarning, stacklevel=2)


def calling_autograd_node() -> Any:
    """The autograd node whose forward or backward runs this module: the context AOTAutograd's
    ``CompiledFunction`` passes, found among its callers' frames; ``None`` where none is (an
    inference graph, a runtime that calls it otherwise). A region's forward is open while that
    node lives and its backward has not run (``Region.open_forwards``)."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES_TO_NODE):
        if frame is None:
            break
        context = frame.f_locals.get("ctx")
        if isinstance(context, torch.autograd.function.BackwardCFunction):
            return context
        frame = frame.f_back
    return None


MAX_FRAMES_TO_NODE = 8  # AOTAutograd's forward and backward call the module 2-4 frames down


def open_forwards_of_its_code(planner: Planner, region: Region) -> int:
    """The forwards of ``region``'s code (its site) whose saves are alive, over every plan of
    it: one planned again before its second call (``Backend.beside_own_copies``) is a newer
    region beside the older one still open. Counted from the saves alive (``live_forwards``),
    so that a forward whose graph autograd dropped without a backward is not a copy."""
    if region.site is None:
        return live_forwards(region)
    return sum(live_forwards(other) for other in planner.regions if other.site == region.site)


OVER_PREDICTION_FRACTION = 0.01  # the memory model's stated accuracy, a fraction of the peak


def warn_if_over_its_prediction(region: Region, is_backward: bool = False) -> None:
    """Say once when a measured run of ``region``'s plan, eager code's bytes set aside (a re-plan
    makes room for those), is over both its budget and its prediction by more than the model's
    accuracy: the plan does not do what the planner simulated, and no re-plan will fix that.
    The saves of its own earlier forwards still open are set aside too where its plan did not
    count them: joint planning plans for those (``JointPlanning.plan_for_copies``).

    Why: under ``compiler="inductor"`` a plan's kernels are inductor's, ordered by their data
    dependencies, and a plan can run far above what was simulated while the step's gradients
    stay right; the user is told that its memory is not what was asked.
    """
    measured = region.measured_backward_bytes if is_backward else region.measured_forward_bytes
    if region.warned_over or measured is None or region.budget_bytes is None:
        return
    own = measured - max(region.eager_forward_bytes, region.eager_backward_bytes)
    if region.saves_cap_bytes is None:  # the saves of its earlier forwards, if its plan did not count them
        own -= region.saved_bytes * max(0, region.open_forwards - (1 if is_backward else 0))
    limit = (1 + OVER_PREDICTION_FRACTION) * region.predicted_peak_bytes
    if own <= region.budget_bytes or own <= limit:
        return
    region.warned_over = True
    warnings.warn(
        f"memfit: region {region.index} measured {format_bytes(measured)} against its budget "
        f"{format_bytes(region.budget_bytes)} and its predicted peak "
        f"{format_bytes(region.predicted_peak_bytes)} (strategy {region.plan.strategy}, "
        f"{region.plan.params.get('solver', '')}): this plan does not run as simulated. Try "
        "compiler='aot_eager' or another strategy; memfit.report(model) shows the gap.",
        BudgetWarning, stacklevel=3)


def zeros_at_first_use(graph: fx.Graph) -> None:
    """Let a backward module take ``None`` for the gradient of an output nothing used: zeros of
    the traced layout are made where the gradient is first read.

    Autograd otherwise materializes these zeros before the backward starts (a Llama's unused
    key/value cache and logits, at a peak that eager does not have, since in eager no one asks
    for them), and they live until the backward reads them, for a cached key or value in the
    last layer the backward reaches. ``memfit.fitting.fitted`` turns materialization off for its regions.
    """
    for placeholder in graph.find_nodes(op="placeholder"):
        value = placeholder.meta.get("val")
        if not placeholder.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        if not placeholder.users:
            continue
        layout = (tuple(value.shape), tuple(value.stride()))
        if _symbolic(value):  # its sizes from the backward's symbolic ints, at run time
            found = _symbolic_layout(graph, value)
            if found is None:  # autograd makes them: the backward does not read its sizes
                continue
            layout = found
        first = min(placeholder.users, key=_position(graph).__getitem__)
        with graph.inserting_before(first):
            zeros = graph.call_function(_zeros_if_none, (placeholder, *layout, value.dtype,
                                                         value.device))
        placeholder.replace_all_uses_with(zeros, delete_user_cb=lambda user, made=zeros: user is not made)


def _symbolic(value: torch.Tensor) -> bool:
    return any(isinstance(size, torch.SymInt) for size in (*value.shape, *value.stride()))


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: index for index, node in enumerate(graph.nodes)}


def _zeros_if_none(gradient: torch.Tensor | None, shape: tuple, stride: tuple,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``gradient``, or zeros in the layout it was traced with (what autograd would have made):
    a size is an int, or a ``(expression, symbol names, symbol values)`` of a dynamic one."""
    if gradient is not None:
        return gradient
    return torch.empty_strided(_sizes(shape), _sizes(stride), dtype=dtype,
                               device=device).zero_()


def _sizes(sizes: tuple) -> list[int]:
    import sympy

    return [size if isinstance(size, int) else int(sympy.sympify(size[0]).xreplace(
        {sympy.Symbol(name): value
         for name, value in zip(size[1], size[2], strict=True)}))
            for size in sizes]


def _symbolic_layout(graph: fx.Graph, value: torch.Tensor) -> tuple[tuple, tuple] | None:
    """``value``'s sizes and strides, each symbolic one as its expression with the backward's
    symbolic-int placeholders it reads (the values they take at run time); ``None`` where a
    symbol is not among them."""
    symbols = {str(node.meta["val"].node.expr): node for node in graph.find_nodes(op="placeholder")
               if isinstance(node.meta.get("val"), torch.SymInt)}

    def one(size: Any) -> Any:
        if not isinstance(size, torch.SymInt):
            return int(size)
        names = tuple(sorted(str(symbol) for symbol in size.node.expr.free_symbols))
        if any(name not in symbols for name in names):
            raise KeyError(names)
        return (str(size.node.expr), names, [symbols[name] for name in names])

    try:
        return (tuple(one(size) for size in value.shape),
                tuple(one(step) for step in value.stride()))
    except KeyError:
        return None
