"""memfit as AOTAutograd's partitioner: one compiled region's joint graph planned under the budget
and split into the forward and backward modules AOTAutograd runs.

``plan_region`` is the body of ``Backend.plan_region`` (the method the planning-only backends
override), one step a function: it prepares the joint graph (``prepared_joint``: graph passes,
capture, pricing at a symbolic bound, analysis into a ``CostGraph``), counts the bytes alive
beside the region while it runs (``memfit.compiler.outside_bytes``: resident model and
optimizer bytes, gradients of other regions, the open regions' saves, eager code's bytes),
chooses a plan with the backend's strategy (``chosen_on_every_rank``), fits it to the caps on
its saves (``lowered_beside_copies``, ``within_saves_limits``: joint planning, repeated calls,
eager code's peak between its forward and backward), agrees on it across ranks
(``agreed_across_ranks``), and records the ``Region`` (``region_of``).

Example:
    >>> forward, backward = plan_region(backend, joint, device, num_fwd_outputs, None, site)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.fx as fx

from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import first_iteration_cap, own_copies_bytes
from memfit.compiler.loop_lifetimes import loop_lifetimes_apply
from memfit.compiler.optimizer_step import check_the_step_fits, with_the_step
from memfit.compiler.outside_bytes import (
    OutsideBytes,
    OutsideCounter,
    binding_bytes,
    bytes_outside,
)
from memfit.compiler.region import (
    REGION_KEY,
    Region,
    counted_save_places,
    saved_device_bytes,
    user_input_names,
)
from memfit.compiler.region_lifetimes import (
    dropped_outputs_graph,
    output_tangents,
    output_tensor_names,
    scalar_output_bytes,
    with_dropped_gradients,
    with_later_gradients,
)
from memfit.compiler.replanning import gap_saves_cap, outputs_and_inputs_bytes
from memfit.compiler.shape_bound import priced_bound
from memfit.compiler.step_graph import analyzed
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError, CaptureError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.lowering.joint import (
    as_captured,
    drop_unread_running_statistics,
    elide_clones,
    realias_views,
    record_scopes,
    split,
    tag_phases,
)
from memfit.lowering.rewrite import rewrite
from memfit.model.lifetimes import with_retained_saves
from memfit.model.plan_memo import plans_remembered
from memfit.model.simulate import simulate
from memfit.planning.plan_cache import note_stage
from memfit.planning.step import Planned
from memfit.runtime.ranks import agree_on_plan, raise_if_any_failed
from memfit.tracing.capture import Captured
from memfit.tracing.rnn import size_lstm_buffers
from memfit.tracing.shapes import Bound, at_bound


class RegionPlanner(OutsideCounter, Protocol):
    """What planning a region reads and calls of ``memfit.compiler.backend.Backend``."""

    eager_gap: dict[Any, int]
    gap_saves_limit: dict[Any, int]
    provisional_now: bool  # the region is planned before the step's peak is known

    def hardware_for(self, device: torch.device) -> Hardware: ...

    def _choose(self, graph: CostGraph, hardware: Hardware, outside: int, pending: int,
                eager: int = 0, own_open: int = 0, loop_graph: CostGraph | None = None
                ) -> tuple[Planned, int | None, int | None]: ...

    def _fit_copies(self, extra: int, graph: CostGraph, hardware: Hardware, outside: int,
                    budget_bytes: int, lower: Any) -> tuple[Plan, Any]: ...

    def _save_at_most(self, cap_bytes: int, graph: CostGraph, hardware: Hardware, outside: int,
                      budget_bytes: int, lower: Any) -> tuple[Plan, Any]: ...


def plan_region(planner: RegionPlanner, joint: fx.GraphModule, device: torch.device,
                num_fwd_outputs: int, static_lifetime_input_indices: list[int] | None,
                site: Any = None, bound: Bound | None = None
                ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Plan one region's joint graph and split the rewritten program into its two modules;
    ``site`` is where Dynamo compiled the region from (see ``Region.site``). A joint graph
    with symbolic sizes is priced at ``bound`` (``memfit.tracing.shapes``): the plan is made
    on a copy at the bound and rewrites the symbolic program, which serves every smaller
    shape. The region is appended to ``planner.regions``. Every rank calls the same
    collectives in the same order (``memfit.runtime.ranks``).

    Raises:
        BudgetError: if no plan of the strategy fits, before anything runs.
    """
    with plans_remembered():  # its plans share their simulations (the keep plan's, say)
        return _plan_region(planner, joint, device, num_fwd_outputs,
                            static_lifetime_input_indices, site, bound)


def _plan_region(planner: RegionPlanner, joint: fx.GraphModule, device: torch.device,
                 num_fwd_outputs: int, static_lifetime_input_indices: list[int] | None,
                 site: Any, bound: Bound | None) -> tuple[fx.GraphModule, fx.GraphModule]:
    hardware = planner.hardware_for(device)
    index = len(planner.regions)
    prepared = prepared_joint(planner.options, joint, num_fwd_outputs,
                              static_lifetime_input_indices, hardware, index, bound)
    outside = bytes_outside(planner, prepared.joint, prepared.captured.inputs, device,
                            num_fwd_outputs, site)
    graph = with_later_gradients(prepared.graph, outside.later_gradient_bytes)
    graph = with_dropped_gradients(graph, outside.dropped_gradient_bytes)
    if planner.retained_backward:
        graph = with_retained_saves(graph)
    lower = Lowering(prepared.program, graph, num_fwd_outputs, static_lifetime_input_indices,
                     held_input_names(planner.regions, prepared, outside.repeated_copies),
                     prepared.bound)
    outputs = region_outputs(planner, prepared, graph, num_fwd_outputs, site, outside)
    # alive at the optimizer's step: the resident bytes, the batch and what eager code holds
    at_step = outside.resident_bytes + outside.eager_bytes + sum(
        binding_bytes(node) for node, binding in zip(
            prepared.joint.graph.find_nodes(op="placeholder"), prepared.captured.inputs,
            strict=True) if binding.kind == "input")
    try:
        chosen = chosen_on_every_rank(planner, graph, hardware, outside, outputs.loop_graph)
    except BudgetError as error:
        raise with_the_step(error, planner, device, at_step) from None
    check_the_step_fits(planner, device, chosen.budget_bytes, at_step,
                        first_plan=not any(region.most_open_forwards for region in planner.regions))
    lowered = lowered_beside_copies(planner, chosen, lower, hardware, outside, outputs, site)
    lowered = within_saves_limits(planner, chosen, lowered, lower, hardware, outside, outputs,
                                  site)
    lowered = agreed_across_ranks(lowered, lower, hardware)
    lowered.forward.meta[REGION_KEY] = lowered.backward.meta[REGION_KEY] = index
    planner.regions.append(region_of(planner, index, site, hardware, prepared, graph, outside,
                                     outputs, chosen, lowered))
    return lowered.forward, lowered.backward


@dataclass(frozen=True)
class PreparedJoint:
    """A region's joint graph ready to plan: the graph passes run, captured and analysed.

    Args:
        joint: the joint graph that is priced: a concrete copy at ``bound`` where its sizes
            are symbolic, else the joint graph itself.
        captured: ``joint`` as memfit's ``Captured`` (reordered where ``linearize``), with
            what each input is bound to.
        program: the joint graph a plan rewrites: the symbolic one where there is a bound,
            else ``captured``'s, so that what is planned and what runs are one order.
        graph: ``captured``'s ``CostGraph``, before other regions' gradients are added.
        owners: each storage's graph tensor, as ``analyze`` filled it.
        bound: each symbolic size at the value it is priced at (empty: static sizes).
    """

    joint: fx.GraphModule
    captured: Captured
    program: fx.GraphModule
    graph: CostGraph
    owners: dict
    bound: Bound


def prepared_joint(options: BackendOptions, joint: fx.GraphModule, num_fwd_outputs: int,
                   static_lifetime_input_indices: list[int] | None, hardware: Hardware,
                   index: int, bound: Bound | None) -> PreparedJoint:
    """``joint`` through memfit's graph passes (in place), captured, priced at ``bound`` where its
    sizes are symbolic, and analysed into the ``CostGraph`` of region ``index``. A plan made on
    the priced copy rewrites the symbolic program, which is therefore never reordered.

    Raises:
        CaptureError: if a region with dynamic shapes would be reordered (``linearize``).
    """
    tag_phases(joint)  # nodes AOTAutograd's passes added after its trace
    realias_views(joint)  # views left on a copy that inductor's joint-graph passes erased
    elide_clones(joint)
    drop_unread_running_statistics(joint)
    record_scopes(joint, options.scope_prefix)
    size_lstm_buffers(joint.graph, num_fwd_outputs)
    captured = as_captured(joint, num_fwd_outputs, static_lifetime_input_indices)
    program, priced_at = captured.graph_module, priced_bound(joint, bound)
    if priced_at:  # priced on a concrete copy at the bound; the symbolic program is rewritten
        joint = at_bound(joint, priced_at)
        captured = replace(captured, graph_module=joint)
    owners: dict = {}
    note_stage("analysing its graph")
    captured, graph = analyzed(captured, hardware, f"region {index}", options.linearize,
                               kernel_temporaries=options.kernel_temporaries,
                               owners=owners, compiler=options.compiler)
    if priced_at and captured.graph_module is not joint:
        raise CaptureError("memfit does not reorder (linearize) a region with dynamic "
                           "shapes: compile it with dynamic=False")
    return PreparedJoint(joint, captured, program if priced_at else captured.graph_module,
                         graph, owners, priced_at)


def held_input_names(regions: list[Region], prepared: PreparedJoint, repeated_copies: int
                     ) -> frozenset[str]:
    """The region's inputs whose bytes its saves count (``saved_device_bytes``): the user's,
    after a graph break or where its code runs again before its backward (a cell called per
    time step: the earlier calls' outputs are held by the later calls' saves); none otherwise,
    where the loop holds its inputs anyway."""
    after_a_break = any(region.open_forwards for region in regions)
    return (user_input_names(prepared.joint, prepared.captured.inputs)
            if after_a_break or repeated_copies else frozenset())


@dataclass(frozen=True)
class Lowering:
    """A plan of the region made into its forward and backward modules, and the device bytes
    the forward saves: the plan rewrites ``program`` by the lowered actions of the graph it was
    made on (``graph`` unless given), so the program and the prediction are one sequence."""

    program: fx.GraphModule
    graph: CostGraph
    num_fwd_outputs: int
    static_lifetime_input_indices: list[int] | None
    held_inputs: frozenset[str]  # ``held_input_names``
    bound: Bound  # symbolic sizes at the values they are priced at

    def __call__(self, plan: Plan, planned_on: CostGraph | None = None
                 ) -> tuple[fx.GraphModule, fx.GraphModule, int]:
        note_stage("rewriting its program")
        forward, backward = split(rewrite(self.program, planned_on or self.graph, plan),
                                  self.num_fwd_outputs, self.static_lifetime_input_indices)
        return forward, backward, saved_device_bytes(forward, self.num_fwd_outputs,
                                                     self.held_inputs, self.bound)


@dataclass(frozen=True)
class RegionOutputs:
    """The region's user-visible outputs, as a plan sees them.

    Args:
        names: each output's graph tensor (``None``: not a tensor).
        tangents: each output's tangent, where more than a loss's scalar seed.
        beside_saves_bytes: its outputs and the loop's inputs: alive beside its saves between
            its forward and backward.
        loop_graph: the graph as a loop that keeps only its loss runs it, where that frees any
            output and the loop's lifetimes apply (``dropped_outputs_graph``); else ``None``.
        released: the outputs ``loop_graph`` frees at its forward's end (empty without it).
    """

    names: tuple[str | None, ...]
    tangents: tuple[str | None, ...]
    beside_saves_bytes: int
    loop_graph: CostGraph | None
    released: frozenset[str]


def region_outputs(planner: RegionPlanner, prepared: PreparedJoint, graph: CostGraph,
                   num_fwd_outputs: int, site: Any, outside: OutsideBytes) -> RegionOutputs:
    """The outputs of the region compiled at ``site`` whose graph is ``graph``
    (``RegionOutputs``); a loop graph only for a region that returns its loss and runs with no
    earlier saves alive (``loop_lifetimes_apply``)."""
    joint, options = prepared.joint, planner.options
    names = output_tensor_names(joint, num_fwd_outputs, prepared.owners)
    tangents = output_tangents(joint, num_fwd_outputs)
    beside_saves = outputs_and_inputs_bytes(joint, graph, names, prepared.captured.inputs)
    loop, released = (dropped_outputs_graph(graph, names, tangents,
                                            tangents_as_none=options.compiler == "aot_eager")
                      if scalar_output_bytes(joint, num_fwd_outputs)  # returns its loss
                      and loop_lifetimes_apply(planner.regions, site, outside.pending_bytes,
                                               outside.repeated_copies, outside.saves_cap_bytes)
                      else (None, frozenset()))
    return RegionOutputs(names, tangents, beside_saves, loop if released else None, released)


@dataclass(frozen=True)
class ChosenPlan:
    """The backend's choice for a region (``Backend._choose``): the strategy's plan, the
    whole-device budget (``None``: no budget), and the region's smallest peak where it only
    misses the budget because of earlier regions' saves (``None`` where it fits)."""

    planned: Planned
    budget_bytes: int | None
    minimum_bytes: int | None


def chosen_on_every_rank(planner: RegionPlanner, graph: CostGraph, hardware: Hardware,
                         outside: OutsideBytes, loop_graph: CostGraph | None) -> ChosenPlan:
    """The backend's plan for ``graph`` beside ``outside`` (``loop_graph``'s where only it fits).
    Every rank calls ``raise_if_any_failed`` once whatever it found, so a ``BudgetError`` on
    any rank is raised on every rank and none waits in a collective.

    Raises:
        BudgetError: if no plan fits on this rank or on another.
    """
    try:
        planned, budget_bytes, minimum_bytes = planner._choose(
            graph, hardware, outside.outside_bytes, outside.pending_bytes, outside.eager_bytes,
            outside.own_open_bytes, loop_graph=loop_graph)
    except BudgetError as error:
        raise_if_any_failed(error)  # on every rank, so that none waits in a collective
    raise_if_any_failed(None)
    return ChosenPlan(planned, budget_bytes, minimum_bytes)


@dataclass(frozen=True)
class LoweredPlan:
    """A region's plan and what it lowers to (``Lowering``).

    Args:
        plan: the plan that runs; ``predicted`` its simulated timeline.
        forward: the forward module; ``backward`` the backward module.
        saved_bytes: device bytes ``forward`` saves for ``backward``.
        released_outputs: outputs the plan frees at its forward's end (made on the loop graph).
        saves_cap_bytes: the most its forward may save, where its copies or a joint plan of the
            regions capped it (``None``: no cap).
        outside_bytes: the bytes outside the graph the plan counts, its repeated calls' copies
            included.
    """

    plan: Plan
    predicted: Timeline
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved_bytes: int
    released_outputs: frozenset[str]
    saves_cap_bytes: int | None
    outside_bytes: int


def lowered_beside_copies(planner: RegionPlanner, chosen: ChosenPlan, lower: Lowering,
                          hardware: Hardware, outside: OutsideBytes, outputs: RegionOutputs,
                          site: Any) -> LoweredPlan:
    """The chosen plan lowered; under a budget, where the region's code runs again before its
    backward, a plan that fits beside those copies of its saves instead (``_fit_copies``: they
    then count outside and cap its saves), else, for an FSDP2 unit that fits, the cap on its
    saves that leaves room for the units after it (``first_iteration_cap``)."""
    planned, budget_bytes, graph = chosen.planned, chosen.budget_bytes, lower.graph
    made, predicted = planned.plan, planned.predicted
    released = outputs.released if planned.graph is outputs.loop_graph else frozenset()
    forward, backward, saved = lower(made, planned.graph)
    cap, outside_bytes, repeated = (outside.saves_cap_bytes, outside.outside_bytes,
                                    outside.repeated_copies)
    if repeated and budget_bytes is not None:
        made, (forward, backward, saved) = planner._fit_copies(repeated, graph, hardware,
                                                            outside_bytes, budget_bytes, lower)
        predicted = simulate(graph, made, hardware)
        cap, outside_bytes = saved, outside_bytes + repeated * saved
    elif cap is None and chosen.minimum_bytes is None and budget_bytes is not None:
        cap = first_iteration_cap(planner.model, planner.regions, site,
                                  budget_bytes - outside_bytes, predicted.peak_bytes - saved)
    return LoweredPlan(made, predicted, forward, backward, saved, released, cap, outside_bytes)


def within_saves_limits(planner: RegionPlanner, chosen: ChosenPlan, lowered: LoweredPlan,
                        lower: Lowering, hardware: Hardware, outside: OutsideBytes,
                        outputs: RegionOutputs, site: Any) -> LoweredPlan:
    """``lowered``, or, where its forward saves more than the least of its caps (its own, the room
    eager code's peak between its forward and backward leaves, ``gap_saves_cap``, and the
    backend's limit for ``site``), a plan that saves at most that (``_save_at_most``, on the
    graph that keeps every output). Not for repeated calls, which ``lowered_beside_copies``
    fitted, nor without a budget."""
    budget_bytes, graph = chosen.budget_bytes, lower.graph
    # room for eager code's own peak between its forward and backward (a loss in the loop);
    # kept apart from ``saves_cap_bytes``, which says its copies and joint plan were capped
    gap_cap = gap_saves_cap(planner.eager_gap.get(site, 0), budget_bytes, lowered.outside_bytes,
                            outputs.beside_saves_bytes)
    limit = min((c for c in (lowered.saves_cap_bytes, gap_cap, planner.gap_saves_limit.get(site))
                 if c is not None), default=None)
    if (outside.repeated_copies or limit is None or budget_bytes is None
            or lowered.saved_bytes <= limit):
        return lowered
    made, (forward, backward, saved) = planner._save_at_most(
        limit, graph, hardware, lowered.outside_bytes, budget_bytes, lower)
    if saved > limit and outside.evaluation_capped and limit == lowered.saves_cap_bytes:
        # an evaluation's cap (``evaluation_cap``) no plan within the budget meets: its first
        # plan stands, and the training step planned again beside its saves says so
        return replace(lowered, saves_cap_bytes=None)
    return replace(lowered, plan=made, predicted=simulate(graph, made, hardware),
                   forward=forward, backward=backward, saved_bytes=saved,
                   released_outputs=frozenset())


def agreed_across_ranks(lowered: LoweredPlan, lower: Lowering, hardware: Hardware
                        ) -> LoweredPlan:
    """``lowered`` where every rank chose the same plan; else rank 0's, lowered and simulated
    on this rank (it chose otherwise from the same numbers). Every rank calls ``agree_on_plan``
    once."""
    made, from_rank_0 = agree_on_plan(lowered.plan)
    if not from_rank_0:
        return lowered
    forward, backward, saved = lower(made)
    return replace(lowered, plan=made, predicted=simulate(lower.graph, made, hardware),
                   forward=forward, backward=backward, saved_bytes=saved)


def region_of(planner: RegionPlanner, index: int, site: Any, hardware: Hardware,
              prepared: PreparedJoint, graph: CostGraph, outside: OutsideBytes,
              outputs: RegionOutputs, chosen: ChosenPlan, lowered: LoweredPlan) -> Region:
    """The ``Region`` recording what was planned for region ``index``: its own open forwards'
    saves and the copies of its saves beside its last call are its ``own_pending_bytes``."""
    cap, saved, repeated = lowered.saves_cap_bytes, lowered.saved_bytes, outside.repeated_copies
    own_copies = repeated * saved if repeated else own_copies_bytes(planner.regions, site, cap)
    released = lowered.released_outputs
    counted = counted_save_places(lowered.forward, len(outputs.names), held_input_names(
        planner.regions, prepared, outside.repeated_copies))
    return Region(index, graph, lowered.plan, chosen.planned.baseline, lowered.predicted,
                  chosen.budget_bytes, lowered.outside_bytes, lowered.forward, lowered.backward,
                  outside.resident_bytes, saved, site=site, pending_bytes=outside.pending_bytes,
                  others_pending_bytes=max(0, outside.pending_bytes - outside.own_open_bytes),
                  minimum_bytes=chosen.minimum_bytes, saves_cap_bytes=cap,
                  provisional=planner.provisional_now, counted_saves=counted,
                  own_pending_bytes=outside.own_open_bytes + own_copies,
                  copies_planned=repeated if chosen.budget_bytes is not None else 0,
                  hardware=hardware,
                  bound=lowered.predicted, trainable_bytes=outside.trainable_bytes,
                  later_gradient_bytes=outside.later_gradient_bytes, output_names=outputs.names,
                  output_tangents=outputs.tangents,
                  planned_gap_bytes=planner.eager_gap.get(site, 0),
                  beside_saves_bytes=outputs.beside_saves_bytes, released_outputs=released,
                  planned_graph=outputs.loop_graph if released else None,
                  planned_eager_bytes=outside.eager_bytes, shape_bound=prepared.bound)
