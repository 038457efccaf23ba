"""One planning trace with a symbolic batch, planned at any batch without tracing again.

``max_batch_size`` prices many batches of one step. Rather than a trace per batch (Dynamo, then
AOTAutograd, then memfit's partitioner), the step is traced once with the batch
dimension of its inputs marked dynamic (``torch._dynamo.mark_dynamic``), each region's joint
graph is kept with its sizes as expressions in the batch symbol, and a batch is planned by
pricing those graphs at it (``memfit.tracing.shapes.at_bound``: every size, and so every FLOP
count, at that batch) through the same partitioner a trace runs, region after region, each
beside the saves of the regions before it. Nothing is traced for a batch.

A trace serves a batch only where it holds for it: every symbolic size is the batch's (its
symbol traced at the hint batch), every guard and assertion Dynamo recorded on the batch holds
at it, and the batch is in the symbol's range (Dynamo specializes sizes 0 and 1, so batch 1 is
traced on its own). Where the step cannot be traced with a symbolic batch at all (a size
specialized to a constant, a size derived from the batch crossing a graph break, data-dependent
shapes, an input whose batch dimension is not its size), ``trace_batch`` says why instead.

Example:
    >>> traced = trace_batch(model, loss_fn, make_inputs, options)  # SymbolicBatch or a reason
    >>> regions = traced.plan(32, Budget(bytes=80 << 30))            # None: trace batch 32
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import compiling_site
from memfit.data.units import Budget
from memfit.fitting.callers_compile import own_trace
from memfit.fitting.traced import (
    PlanOptions,
    _PlanOnly,
    _RunOnFakes,
    _ShardedStop,
    _Stop,
    as_planned,
    fake_like,
    loss_module,
    memfit_error,
    planning_backend,
)
from memfit.planning.step import Planned
from memfit.runtime.resident import device_of
from memfit.tracing.shapes import shape_env_of, symbols_of
from memfit.tracing.target import host_code

HINT_BATCH = 8  # the batch the symbolic trace runs at: not 0 or 1, which Dynamo specializes


@dataclass(frozen=True)
class _Joint:
    """One region's joint graph as AOTAutograd gave it to the partitioner, untouched, with what
    ``plan_region`` is called with besides it."""

    graph_module: fx.GraphModule
    device: torch.device
    num_fwd_outputs: int
    static_lifetime_input_indices: tuple[int, ...] | None
    site: Any


class _Recorded(_Stop):
    """Raised by the recording backend once it kept a region's joint graph."""


class _Recorder(_PlanOnly):
    """A planning-only backend that keeps every region's joint graph and plans none; each region
    stands in for itself on the fake inputs, its outputs' batch dimensions marked dynamic, so a
    region after a graph break is traced with a symbolic batch too."""

    def __init__(self, options: BackendOptions, optimizer: torch.optim.Optimizer | None = None,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__(options, optimizer, model)
        self.joints: list[_Joint] = []
        self.refusals: list[str] = []

    def plan_region(self, joint: fx.GraphModule, device: torch.device, num_fwd_outputs: int,
                    static_lifetime_input_indices: list[int] | None, site: Any = None,
                    bound: Any = None) -> Any:
        static = None if static_lifetime_input_indices is None else \
            tuple(static_lifetime_input_indices)
        self.joints.append(_Joint(copied(joint), device, num_fwd_outputs, static, site))
        raise _Recorded

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list) -> Any:
        device = device_of(example_inputs)
        try:
            self.compile_region(graph_module, example_inputs, device, compiling_site())
        except _Recorded:
            pass
        runner = _MarkingRunner(graph_module, self._target, device, self.refusals)
        self.runners.append(runner)
        return runner


class _MarkingRunner(_RunOnFakes):
    """A region's stand-in that marks the batch dimensions of its outputs dynamic (those whose
    traced size is a bare batch symbol), and notes an output whose size is another expression
    of the batch: the region after a graph break would see it as a constant."""

    def __init__(self, graph_module: fx.GraphModule, target: Callable, device: torch.device,
                 refusals: list[str]) -> None:
        super().__init__(graph_module, target, device)
        output = graph_module.graph.output_node().args[0]
        self.traced = [node.meta.get("example_value") if isinstance(node, fx.Node) else None
                       for node in (output if isinstance(output, (tuple, list)) else [output])]
        self.refusals = refusals

    def __call__(self, *args: Any) -> Any:
        outputs = super().__call__(*args)
        listed = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        for value, traced in zip(listed, self.traced, strict=False):
            if isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor):
                self._mark(value, traced)
        return outputs

    def _mark(self, value: torch.Tensor, traced: torch.Tensor) -> None:
        for dimension, size in enumerate(traced.shape):
            if not isinstance(size, torch.SymInt):
                continue
            if isinstance(size.node.expr, sympy.Symbol):
                torch._dynamo.mark_dynamic(value, dimension)
            else:
                self.refusals.append(f"a value crossing a graph break has the size "
                                     f"{size.node.expr}, not the batch's")


def copied(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``graph_module`` with the same node names, targets and (shallow-copied) meta, so
    that planning one copy leaves the graph it was copied from as it was."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    return fx.GraphModule(graph_module, graph)


@dataclass
class SymbolicBatch:
    """A step traced once with a symbolic batch: its regions' joint graphs, planned at a batch
    by ``plan``. ``hint`` is the batch it was traced at."""

    model: torch.nn.Module
    options: PlanOptions
    joints: list[_Joint]
    hint: int
    environments: list[Any] = field(default_factory=list)

    def serves(self, batch: int) -> str:
        """Why the trace does not hold at ``batch`` (``""``: it does): a guard or assertion
        Dynamo recorded, or the symbol's range, excludes it."""
        for env in self.environments:
            values = {symbol: batch for symbol, hint in env.backed_var_to_val.items()
                      if hint == self.hint}  # the batch's symbols; others stay and refuse
            for symbol in values:
                found = env.var_to_range.get(symbol)
                if found is not None and not (found.lower <= batch <= found.upper):
                    return f"the batch's symbolic size ranges over [{found.lower}, {found.upper}]"
            asserts = [a.expr for group in env.deferred_runtime_asserts.values() for a in group]
            for expression in [guard.expr for guard in env.guards] + asserts:
                if expression.xreplace(values) is not sympy.true:
                    return f"the trace holds only where {expression}"
        return ""

    def plan(self, batch: int, budget: Budget | None) -> list[Planned]:
        """Each region planned at ``batch``, in the order the trace ran them, each beside the
        saves of the regions before it, as a trace at that batch plans them (nothing traced).

        Raises:
            BudgetError: where a region's strategy cannot fit ``budget`` at ``batch``.
        """
        planner = planning_backend(self.model, budget, self.options)
        for joint in self.joints:
            known = len(planner.regions)
            bound = {symbol: batch for symbol in symbols_of(joint.graph_module)}
            try:
                _plan_region(planner, joint, bound)
            except _ShardedStop as stop:
                planner.stopped.append(stop.planned)
            except _Stop:
                planner.stopped.append(as_planned(planner.regions[-1]))
            for region in planner.regions[known:]:  # its forward "ran": its saves are held
                region.forward_opened(None)
        return planner.stopped


def _plan_region(planner: _PlanOnly, joint: _Joint, bound: dict) -> None:
    """``planner`` plans a copy of ``joint`` at ``bound`` as its partitioner would in a trace."""
    planner.count_afresh(joint.device, 0)  # fake inputs: no eager bytes beside
    static = None if joint.static_lifetime_input_indices is None else \
        list(joint.static_lifetime_input_indices)
    with planner._target(joint.device), host_code(), warnings.catch_warnings():
        # priced at the batch itself, not at a bound serving smaller ones: monotone or not
        warnings.filterwarnings("ignore", message=".*not provably non-decreasing")
        planner.plan_region(copied(joint.graph_module), joint.device, joint.num_fwd_outputs,
                            static, joint.site, bound)


def batch_dimensions(make_inputs: Callable[[int], Sequence[Any]],
                     meta_inputs: Callable[[Callable, int], Sequence[Any]],
                     hint: int) -> list[tuple[int, ...]] | str:
    """Each input's batch dimensions (those whose size is the batch at ``hint`` and at another
    batch), or why the inputs cannot be traced with a symbolic batch."""
    first, second = meta_inputs(make_inputs, hint), meta_inputs(make_inputs, 2 * hint + 1)
    if len(first) != len(second):
        return "make_inputs gives a different number of inputs at another batch"
    found = []
    for position, (one, other) in enumerate(zip(first, second, strict=True)):
        if not isinstance(one, torch.Tensor):
            if one != other:
                return f"input {position} ({type(one).__name__}) changes with the batch"
            found.append(())
            continue
        if one.dim() != other.dim():
            return f"input {position} has another number of dimensions at another batch"
        dims = tuple(d for d in range(one.dim()) if one.shape[d] != other.shape[d])
        if any(one.shape[d] != hint or other.shape[d] != 2 * hint + 1 for d in dims):
            return f"input {position}'s shape {tuple(one.shape)} changes with the batch " \
                "in a dimension that is not the batch"
        found.append(dims)
    if not any(found):
        return "no input has a batch dimension"
    return found


def trace_batch(model: torch.nn.Module, loss_fn: Callable,
                make_inputs: Callable[[int], Sequence[Any]],
                meta_inputs: Callable[[Callable, int], Sequence[Any]],
                options: PlanOptions, hint: int = HINT_BATCH) -> SymbolicBatch | str:
    """The step traced once at ``hint`` with its batch dimensions symbolic, or why it cannot be
    (the caller then traces each batch on its own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if options.linearize:
        return "linearize reorders each traced graph, which memfit does not do for symbolic sizes"
    dimensions = batch_dimensions(make_inputs, meta_inputs, hint)
    if isinstance(dimensions, str):
        return dimensions
    inputs = meta_inputs(make_inputs, hint)
    recorder = planning_backend(model, None, options, kind=_Recorder)
    assert isinstance(recorder, _Recorder)
    device = device_of(model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = tuple(fake_like(t, device) if isinstance(t, torch.Tensor) else t for t in inputs)
    for value, dims in zip(fake, dimensions, strict=True):
        for dimension in dims:
            torch._dynamo.mark_dynamic(value, dimension)
    compiled = torch.compile(loss_module(model, loss_fn), backend=recorder, dynamic=False,
                             isolate_recompiles=True)
    try:
        with own_trace():
            compiled(*fake)
    except Exception as error:  # a specialized batch, a data-dependent shape: Dynamo's words
        found = memfit_error(error)
        first = str(found).strip().splitlines()[0] if str(found).strip() else type(found).__name__
        return f"Dynamo could not trace a symbolic batch ({first})"
    finally:
        for runner in recorder.runners:
            runner.close()
    return _checked(model, options, recorder, hint)


def _checked(model: torch.nn.Module, options: PlanOptions, recorder: _Recorder,
             hint: int) -> SymbolicBatch | str:
    """The recorded trace, or why it cannot serve other batches."""
    if recorder.eager_codes:
        return f"Dynamo hit its recompile limit on {recorder.eager_codes[0]}"
    if recorder.refusals:
        return recorder.refusals[0]
    if not recorder.joints:
        return "the trace found no region with gradients"
    environments = []
    for joint in recorder.joints:
        env = shape_env_of(joint.graph_module)
        if env is None:
            return "a region was traced with static sizes (its inputs' batch is not symbolic)"
        others = [str(s) for s in symbols_of(joint.graph_module)
                  if env.backed_var_to_val.get(s) != hint]
        if others:
            return f"a region has symbolic sizes other than the batch ({', '.join(others)})"
        environments.append(env)
    unique = list({id(env): env for env in environments}.values())
    return SymbolicBatch(model, options, recorder.joints, hint, unique)
