"""Plans made again, before a compiled region runs, when more stays resident than they left room
for: optimizer state found by its first ``step`` (no ``optimizer=``), gradients kept across
micro-batches, bytes eager code held beside the region (``eager_room_needed``: the loop's loss,
code at a graph break), or a newer plan asked for by joint planning after a graph break.

The re-plan lives in the callable the backend gives Dynamo for each region, not in a Dynamo
guard: a guard is traced only where the frame Dynamo compiles reads the value it guards, and where
that frame starts depends on the model (for a Hugging Face model it is the decorator wrapper
around ``forward``, which ``memfit.fit``'s pre-hook never runs in). Resetting the compiled code
instead would reach every model sharing that code object (the same decorator wrapper). So the
region's callable compiles its own Dynamo graph again with memfit as the partitioner: exactly
this region is planned again, and Dynamo traces nothing again.

Example:
    >>> compiled = plan_again_when_stale(planner, graph_module, device, site, compiled, regions)
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.fx as fx

    from memfit.compiler.region import Planner, Region
    from memfit.compiler.shape_bound import InputSizes


def plan_again_when_stale(planner: Planner, graph_module: fx.GraphModule, device: torch.device,
                          site: Any, compiled: Callable[..., Any], regions: list[Region],
                          sizes: InputSizes | None = None) -> Callable[..., Any]:
    """``compiled`` (the region planned as ``regions``), compiled again from ``graph_module``
    with the arguments of the first run that ``planner.must_plan_again`` says needs a new plan,
    or, for a dynamic region (``sizes``), whose shape is past the bound its plan was priced at.

    Planning uses fake tensors only (AOTAutograd fakes the arguments; a dynamic region is traced
    again from Dynamo's symbolic fake inputs, so the new plan serves every shape too);
    the random generators are put back after it, so a re-planned step draws what eager draws.
    """
    current: list[Any] = [compiled, regions]

    def run(*args: Any) -> Any:
        bound = current[1][0].shape_bound
        raised = sizes.beyond(args, bound) if sizes is not None else None
        if raised is not None or planner.must_plan_again(current[1], device, args):
            first = len(planner.regions)
            if raised is not None:
                planner.bound_replans += 1
                for region in current[1]:
                    region.replaced = True
            inputs = list(args) if sizes is None else list(sizes.fake_inputs)
            # a dynamic region plans on fakes, beside which eager code holds nothing: what it
            # holds (an evaluation's outputs the loop kept) is read beside the real arguments
            eager = planner.eager_bytes_now(list(args)) if sizes is not None else None
            traced = sizes.traced_again() if sizes is not None else contextlib.nullcontext()
            with _generators_kept(device), planner.eager_watch_off(), traced:
                current[0] = planner.compile_region(graph_module, inputs, device, site,
                                                    raised or bound, eager)
            del inputs
            gc.collect()  # compiling leaves reference cycles that hold the real arguments
            current[1] = planner.regions[first:] or current[1]
        if sizes is not None:
            now = sizes.values(args)
            for region in current[1]:
                region.measure_larger_sizes(now, planner.options.measure_runs)
        return current[0](*args)

    return torch._dynamo.disable(run, reason="memfit: a planned region's callable")


def _generators_kept(device: torch.device) -> Any:
    """The CPU's random generator (and ``device``'s, on CUDA) as they were, after the block."""
    devices = [device.index or 0] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def eager_room_needed(regions: list[Region]) -> list[tuple[Region, int]]:
    """The regions whose plans leave no room for what eager code was seen to hold at the start
    of their measured forwards or backwards (measured by ``memfit.compiler.region_peak``), each
    with the bytes its next plan counts (``eager_bytes_to_plan``). A region whose checked peak
    has room for them is left as it is, and so is one whose every measured run, eager code's
    bytes at its start included, was within its budget (``shown_to_fit``): the checked peak
    holds every output to the end, where the loop frees one before eager code's bytes peak (a
    loss's input, whose log-softmax takes its place), and a plan made again for the sum could
    miss a budget its runs showed it fits.
    """
    needed = []
    for region in regions:
        if region.budget_bytes is None or shown_to_fit(region):
            continue
        if no_room_for(region, region.eager_forward_bytes, eager_at_backward_bytes(region)):
            needed.append((region, eager_bytes_to_plan(region)))
    return needed


def no_room_for(region: Region, forward_bytes: int, backward_bytes: int) -> bool:
    """Whether ``region``'s checked peak (``Region.bound``), with eager code's bytes in place of
    those its plan counts, is over its budget: ``forward_bytes`` held over its forward,
    ``backward_bytes`` over its backward (less its outputs freed by then: the plan holds them
    to the end)."""
    if max(forward_bytes, backward_bytes) <= region.planned_eager_bytes:
        return False
    forward_peak, backward_peak = phase_peaks(region)
    room = (region.budget_bytes or 0) - region.outside_bytes + region.planned_eager_bytes
    return forward_peak + forward_bytes > room or backward_peak + backward_bytes > room


def phase_peaks(region: Region) -> tuple[int, int]:
    """The most bytes ``region``'s checked timeline holds before its first backward op and
    from it on (its peak for both where the timeline has no labels or no backward)."""
    timeline = region.bound or region.predicted
    graph = region.planned_graph or region.graph
    backward = {op.name for op in graph.ops if op.phase == "backward"}
    first = next((index for index, label in enumerate(timeline.memory_labels)
                  if label in backward), None)
    if first is None or len(timeline.memory_bytes) != len(timeline.memory_labels):
        return timeline.peak_bytes, timeline.peak_bytes
    return (max(timeline.memory_bytes[:first], default=0),
            max(timeline.memory_bytes[first:]))


def shown_to_fit(region: Region) -> bool:
    """Whether every measured run of ``region``'s plan was read from the allocator (kernel
    scratch seen) and within its budget with the optimizer state its plan reserves counted as
    made (``Region.measured_most_bytes``)."""
    return (region.measured_runs > 0 and region.measured_only_allocator
            and region.measured_most_bytes <= (region.budget_bytes or 0))


def eager_gap_needed(regions: list[Region]) -> list[tuple[Region, int]]:
    """The regions between whose forward and backward eager code's own peak (a loss's softmax
    and its gradient while the region's saves wait: ``Region.eager_gap_bytes``) left no room
    in the budget, each with that peak, which its next plan leaves room for by saving less
    (``gap_saves_cap``): where the device's bytes alive then (``Region.gap_alive_bytes``) were
    over it, or where its plan's saves, outputs and inputs and what it counts beside them (the
    optimizer state a first iteration has not made yet) would be with a peak it did not plan
    for."""
    needed = []
    for region in regions:
        if region.budget_bytes is None:
            continue
        planned = region.saved_bytes + region.beside_saves_bytes + region.outside_bytes
        unplanned = (region.eager_gap_bytes > region.planned_gap_bytes
                     and planned + region.eager_gap_bytes > region.budget_bytes)
        if unplanned or region.gap_alive_bytes > region.budget_bytes:
            needed.append((region, region.eager_gap_bytes))
    return needed


def gap_saves_cap(gap_bytes: int, budget_bytes: int | None, outside_bytes: int,
                  beside_saves_bytes: int) -> int | None:
    """The most a region's forward may save so that, between its forward and backward, its
    saves, its outputs and inputs (``beside_saves_bytes``), what stays beside it
    (``outside_bytes``) and eager code's peak there (``gap_bytes``) fit ``budget_bytes``;
    ``None`` where there is no such peak or no budget."""
    if not gap_bytes or budget_bytes is None:
        return None
    return max(0, budget_bytes - outside_bytes - beside_saves_bytes - gap_bytes)


def outputs_and_inputs_bytes(joint: fx.GraphModule, graph: Any, output_names: Any,
                             inputs: Any) -> int:
    """Bytes alive beside a region's saves between its forward and backward, besides what is
    resident: its outputs (``output_names`` in the CostGraph ``graph``) and the loop's inputs
    (placeholders of ``joint`` whose binding in ``inputs`` is the user's)."""
    outputs = sum(graph.tensors[name].size_bytes for name in set(output_names)
                  if name in graph.tensors)
    values = [node.meta.get("val") for node in joint.graph.find_nodes(op="placeholder")]
    return outputs + sum(value.untyped_storage().nbytes()
                         for value, binding in zip(values, inputs, strict=True)
                         if binding.kind == "input" and isinstance(value, torch.Tensor))


def warn_eager_gap_over(region: Region) -> None:
    """Say, in the iteration that ran it, that eager code's own peak between ``region``'s
    forward and backward took the device over the budget (``eager_gap_needed``), by how much as
    memfit counted the bytes alive then, and that the next plan saves less to leave it room."""
    from memfit.data.errors import BudgetWarning
    from memfit.data.units import format_bytes

    over = region.gap_alive_bytes - (region.budget_bytes or 0)
    warnings.warn(
        f"memfit: eager code outside the compiled regions (a loss computed in the loop, code at "
        f"a graph break) held {format_bytes(region.eager_gap_bytes)} between the forward and "
        f"backward of region {region.index}, which its plan had no room for: this iteration ran "
        f"about {format_bytes(over)} over the budget. The region is planned again with room for "
        "it from the next iteration; compute the loss inside the model to have it planned from "
        "the first.", BudgetWarning, stacklevel=4)


def eager_overrun_bytes(region: Region) -> int:
    """How far the latest measured run of ``region`` (forward or backward, eager code's bytes
    included) was over its budget; 0 where it was within it, nothing was measured, or earlier
    regions' saves were open beside it: a measured run counts those at their plans' bytes
    (a dynamic region's priced at its bound, above a smaller batch's), so the figure there is
    no evidence of an overrun."""
    if region.pending_bytes or region.own_pending_bytes:
        return 0
    measured = max(region.measured_forward_bytes or 0, region.measured_backward_bytes or 0)
    return max(0, measured - (region.budget_bytes or measured))


def warn_eager_held_over(region: Region, held: int) -> None:
    """Say, in the iteration that ran it, that what eager code held at ``region``'s start
    (``eager_room_needed``: the loop's loss and target, another model's tensors, code at a graph
    break) took its measured run over the budget, by how much, and that the next plan counts
    it."""
    from memfit.data.errors import BudgetWarning
    from memfit.data.units import format_bytes

    warnings.warn(
        f"memfit: eager code outside the compiled regions (the loop's loss and target, another "
        f"model's tensors, code at a graph break) held {format_bytes(held)} while region "
        f"{region.index} ran, which its plan had no room for: this iteration ran about "
        f"{format_bytes(eager_overrun_bytes(region))} over the budget. The region is planned "
        "again with room for it from the next iteration.", BudgetWarning, stacklevel=4)


def count_eager_in_prediction(regions: list[Region]) -> None:
    """Count what eager code was seen to hold beside each region planned without a budget in
    its predicted (and unplanned) peak, as a re-plan counts it for a region with one
    (``outside_bytes``).

    Without a budget a plan does not depend on the room left beside it, so it is not made
    again; but its peak is the whole device's, and a loss computed outside the model holds its
    bytes there while the region's backward runs (a CPU ``mse_loss``'s input-sized buffer under
    the 0-dim loss, the target). Left out, the prediction would be below the measured peak by
    that buffer and the loss.
    """
    for region in regions:
        held = eager_bytes_to_plan(region)
        if region.budget_bytes is None and held > region.planned_eager_bytes:
            region.outside_bytes += held - region.planned_eager_bytes
            region.planned_eager_bytes = held


def eager_bytes_to_plan(region: Region) -> int:
    """The eager bytes a plan of ``region`` counts, alive over the whole region: those seen at
    its forwards' start, and those at its backwards' start less its outputs freed by then (a
    plan is checked with every output held to the end: room those bytes take in fact; an eager
    loss's buffer is the size of the output it read). What the loop holds at one backward's
    start (the loss and its buffers, the labels) it mostly still holds at the next forward's
    (``loss`` lives until reassigned), so one re-plan covers both. Eager code's own peak
    between its forward and backward is planned for by a cap on its saves instead
    (``gap_saves_cap``).
    """
    return max(region.eager_forward_bytes, eager_at_backward_bytes(region), 0)


def eager_at_backward_bytes(region: Region) -> int:
    """Eager code's bytes seen at ``region``'s backwards' start less its outputs freed by then
    (its checked plan holds them to the end: room those bytes take in fact)."""
    return region.eager_backward_bytes - (region.freed_output_bytes or 0)
