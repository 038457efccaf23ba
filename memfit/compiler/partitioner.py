"""memfit as AOTAutograd's partitioner: one compiled region's joint graph planned under the budget
and split into the forward and backward modules AOTAutograd runs.

``plan_region`` is the body of ``Backend.plan_region`` (the method the planning-only backends
override): it analyses the joint graph into a ``CostGraph``, counts the bytes alive beside the
region while it runs (resident model and optimizer bytes, gradients of other regions, the open
regions' saves, eager code's bytes), chooses a plan with the backend's strategy, fits it to the
caps on its saves (joint planning, repeated calls, eager code's peak between its forward and
backward), agrees on it across ranks, rewrites the program, and records the ``Region``.

Example:
    >>> forward, backward = plan_region(backend, joint, device, num_fwd_outputs, None, site)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.compiler.graph_breaks import extra_copies, first_iteration_cap, own_copies_bytes
from memfit.compiler.loop_lifetimes import loop_lifetimes_apply
from memfit.compiler.region import (
    REGION_KEY,
    Planner,
    Region,
    saved_device_bytes,
    user_input_names,
)
from memfit.compiler.region_lifetimes import (
    dropped_outputs_graph,
    output_tangents,
    output_tensor_names,
    scalar_output_bytes,
    trainable_parameter_bytes,
    with_later_gradients,
)
from memfit.compiler.replanning import gap_saves_cap, outputs_and_inputs_bytes
from memfit.compiler.shape_bound import priced_bound
from memfit.compiler.step_graph import analyzed
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError, CaptureError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.lowering.joint import (
    as_captured,
    drop_unread_running_statistics,
    elide_clones,
    realias_views,
    record_scopes,
    split,
)
from memfit.lowering.rewrite import rewrite
from memfit.model.simulate import simulate
from memfit.planning.plan_cache import note_stage
from memfit.planning.step import Planned
from memfit.runtime.outside import CUDA_BLOCK_BYTES
from memfit.runtime.ranks import agree_max, agree_on_plan, raise_if_any_failed
from memfit.runtime.resident import fsdp_in_flight_bytes, local_tensor, resident_bytes
from memfit.tracing.rnn import size_lstm_buffers
from memfit.tracing.shapes import Bound, at_bound


class RegionPlanner(Planner, Protocol):
    """What planning a region reads and calls of ``memfit.compiler.backend.Backend``."""

    saves_caps: dict[Any, int]
    copies_sites: set[Any]
    eager_held: dict[Any, int]
    eager_gap: dict[Any, int]
    gap_saves_limit: dict[Any, int]
    _eager_now: int

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
    shape. The region is appended to ``planner.regions``.

    Raises:
        BudgetError: if no plan of the strategy fits, before anything runs.
    """
    options, hardware = planner.options, planner.hardware_for(device)
    realias_views(joint)  # views left on a copy that inductor's joint-graph passes erased
    elide_clones(joint)
    drop_unread_running_statistics(joint)
    record_scopes(joint, options.scope_prefix)
    size_lstm_buffers(joint.graph, num_fwd_outputs)
    captured = as_captured(joint, num_fwd_outputs, static_lifetime_input_indices)
    program, bound = captured.graph_module, priced_bound(joint, bound)
    if bound:  # priced on a concrete copy at the bound; the symbolic program is rewritten
        joint = at_bound(joint, bound)
        captured = replace(captured, graph_module=joint)
    index = len(planner.regions)
    owners: dict = {}
    note_stage("analysing its graph")
    captured, graph = analyzed(captured, hardware, f"region {index}", options.linearize,
                               kernel_temporaries=options.kernel_temporaries,
                               owners=owners, compiler=options.compiler)
    if bound and captured.graph_module is not joint:
        raise CaptureError("memfit does not reorder (linearize) a region with dynamic "
                           "shapes: compile it with dynamic=False")
    program = program if bound else captured.graph_module
    inside = sum(binding_bytes(node) for node, binding in
                 zip(joint.graph.find_nodes(op="placeholder"), captured.inputs, strict=True)
                 if binding.kind == "parameter")
    trainable = trainable_parameter_bytes(joint, num_fwd_outputs, captured.inputs)
    later = later_gradient_bytes(planner.model, planner.regions, device, trainable)
    # seen held by eager code beside it, at least the loop's loss of the previous call
    block = CUDA_BLOCK_BYTES if device.type == "cuda" else 1
    eager = max(planner.eager_held.get(site, 0), planner._eager_now,
                scalar_output_bytes(joint, num_fwd_outputs, block))
    resident = resident_bytes(planner.model, planner.optimizers, device, planner.partners())
    gathered = fsdp_in_flight_bytes(planner.model, device)  # FSDP2's all-gathered parameters
    # regions whose forward ran and whose backward has not hold their saved values meanwhile
    # (a model with graph breaks: the later region plans around the earlier one's saves)
    pending = sum(region.saved_bytes * region.open_forwards for region in planner.regions)
    # the rank holding most (uneven shards) plans for every rank (memfit.runtime.ranks)
    later, eager, resident, pending, gathered = agree_max(
        [later, eager, resident, pending, gathered])
    graph = with_later_gradients(graph, later)
    # the region's parameters are among the resident or, under FSDP2, the gathered bytes
    outside = max(0, resident + gathered - inside) + pending + eager
    if options.compiler == "inductor":  # its channels-last copies of the region's inputs
        from memfit.lowering.inductor import layout_copy_bytes

        outside += layout_copy_bytes(joint)
    cap = planner.saves_caps.get(site)
    # copies of its saves alive beside its last call, where its code runs again before its
    # backward (memfit.compiler.repeated_calls): its plan is chosen for them below
    repeated = extra_copies(planner.regions, site) if site in planner.copies_sites else 0
    outside += 0 if repeated else own_copies_bytes(planner.regions, site, cap)
    # the saves of its own code's open forwards (among the pending)
    own_open = sum(region.saved_bytes * region.open_forwards for region in planner.regions
                   if site is not None and region.site == site)

    # after a graph break, or where its code runs again before its backward (a cell called
    # per time step: the earlier calls' outputs are held by the later calls' saves)
    after_a_break = any(region.open_forwards for region in planner.regions)
    held_inputs = (user_input_names(joint, captured.inputs) if after_a_break or repeated
                   else frozenset())

    def lower(plan: Plan, planned_on: CostGraph | None = None
              ) -> tuple[fx.GraphModule, fx.GraphModule, int]:
        note_stage("rewriting its program")
        forward, backward = split(rewrite(program, planned_on or graph, plan),
                                  num_fwd_outputs, static_lifetime_input_indices)
        return forward, backward, saved_device_bytes(forward, num_fwd_outputs, held_inputs,
                                                     bound)

    names = output_tensor_names(joint, num_fwd_outputs, owners)
    tangents = output_tangents(joint, num_fwd_outputs)
    loop, released = (dropped_outputs_graph(graph, names, tangents,
                                            tangents_as_none=options.compiler == "aot_eager")
                      if scalar_output_bytes(joint, num_fwd_outputs)  # returns its loss
                      and loop_lifetimes_apply(planner.regions, site, pending, repeated, cap)
                      else (None, frozenset()))
    loop = loop if released else None
    try:
        planned, budget_bytes, minimum = planner._choose(graph, hardware, outside, pending,
                                                      eager, own_open, loop_graph=loop)
    except BudgetError as error:
        raise_if_any_failed(error)  # on every rank, so that none waits in a collective
    raise_if_any_failed(None)
    made, predicted = planned.plan, planned.predicted
    if planned.graph is not loop:
        released = frozenset()
    forward, backward, saved = lower(made, planned.graph)
    if repeated and budget_bytes is not None:
        made, (forward, backward, saved) = planner._fit_copies(repeated, graph, hardware,
                                                            outside, budget_bytes, lower)
        predicted = simulate(graph, made, hardware)
        cap, outside = saved, outside + repeated * saved
    elif cap is None and minimum is None and budget_bytes is not None:
        cap = first_iteration_cap(planner.model, planner.regions, site, budget_bytes - outside,
                                  predicted.peak_bytes - saved)
    beside_saves = outputs_and_inputs_bytes(joint, graph, names, captured.inputs)
    # room for eager code's own peak between its forward and backward (a loss in the loop);
    # kept apart from ``cap``, which says the region's copies and joint plan were capped
    gap_cap = gap_saves_cap(planner.eager_gap.get(site, 0), budget_bytes, outside, beside_saves)
    limit = min((c for c in (cap, gap_cap, planner.gap_saves_limit.get(site)) if c is not None),
                default=None)
    if not repeated and limit is not None and budget_bytes is not None and saved > limit:
        made, (forward, backward, saved) = planner._save_at_most(limit, graph, hardware, outside,
                                                              budget_bytes, lower)
        predicted, released = simulate(graph, made, hardware), frozenset()
    made, from_rank_0 = agree_on_plan(made)
    if from_rank_0:  # this rank chose otherwise from the same numbers: rank 0's plan runs
        forward, backward, saved = lower(made)
        predicted = simulate(graph, made, hardware)
    forward.meta[REGION_KEY] = backward.meta[REGION_KEY] = index
    planner.regions.append(Region(index, graph, made, planned.baseline, predicted,
                               budget_bytes, outside, forward, backward, resident, saved,
                               site=site, pending_bytes=pending, minimum_bytes=minimum,
                               saves_cap_bytes=cap, own_pending_bytes=own_open + (
                                   repeated * saved if repeated else
                                   own_copies_bytes(planner.regions, site, cap)),
                               hardware=hardware, bound=predicted,
                               trainable_bytes=trainable, later_gradient_bytes=later,
                               output_names=names, output_tangents=tangents,
                               planned_gap_bytes=planner.eager_gap.get(site, 0),
                               beside_saves_bytes=beside_saves,
                               released_outputs=released,
                               planned_graph=loop if released else None,
                               planned_eager_bytes=eager, shape_bound=bound))
    return forward, backward


def later_gradient_bytes(model: torch.nn.Module | None, regions: list[Region],
                         device: torch.device, trainable: int) -> int:
    """Gradients that exist while a region's backward runs though its graph does not make them
    (``trainable``: the bytes of those it makes): those of ``model``'s other trainable
    parameters, except the parameters of ``regions`` whose forward ran before this one in this
    iteration (still open: their backward comes after this one's). Parameters of regions later
    in the forward and of eager code after a graph break get their ``.grad`` first. Gradients
    that exist already (kept across micro-batches) are resident, counted in ``outside``."""
    if model is None:
        return 0
    local = [local_tensor(p).untyped_storage() for p in model.parameters()
             if p.requires_grad and p.grad is None and p.device == device]
    without_grad = {StorageWeakRef(storage): storage.nbytes() for storage in local}
    earlier = sum(region.trainable_bytes for region in regions
                  if region.open_forwards and not region.replaced)
    return max(0, sum(without_grad.values()) - trainable - earlier)


def binding_bytes(node: fx.Node) -> int:
    """The bytes of the storage under ``node``'s value; 0 where it is not a tensor."""
    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0
