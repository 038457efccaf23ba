"""The device bytes alive beside a compiled region while it runs, outside its graph: what its plan
reserves from the budget (``OutsideBytes``, counted by ``bytes_outside``).

Resident model and optimizer bytes, FSDP2's gathered parameters, gradients other regions make
during its backward, the saves of open regions (a graph break's, its own code's earlier calls'),
eager code's bytes beside it. ``memfit.compiler.partitioner.plan_region`` counts them once per
region planned, on every rank alike.

Example:
    >>> outside = bytes_outside(backend, joint, captured.inputs, device, num_fwd_outputs, site)
    >>> outside.outside_bytes, outside.pending_bytes
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from memfit.compiler.dropped_gradients import GradientsSeen, dropped_gradient_bytes
from memfit.compiler.graph_breaks import evaluation_cap, extra_copies, own_copies_bytes
from memfit.compiler.region import Planner, Region
from memfit.compiler.region_lifetimes import scalar_output_bytes, trainable_parameter_bytes
from memfit.runtime.outside import CUDA_BLOCK_BYTES
from memfit.runtime.ranks import agree_max
from memfit.runtime.resident import (
    fsdp_in_flight_bytes,
    missing_gradient_bytes,
    resident_bytes,
)
from memfit.tracing.capture import Binding


class OutsideCounter(Planner, Protocol):
    """What counting the bytes outside a region reads of ``memfit.compiler.backend.Backend``."""

    saves_caps: dict[Any, int]
    copies_sites: set[Any]
    eager_held: dict[Any, int]
    _eager_now: int
    gradients_seen: dict[int, GradientsSeen]
    program_now: int


@dataclass(frozen=True)
class OutsideBytes:
    """The device bytes alive beside a region while it runs, outside its graph. The counts
    that can differ between ranks are each rank's largest (uneven shards: the rank holding most
    plans for every rank); ``outside_bytes`` is what the plan reserves from the budget.

    Args:
        parameter_bytes: the region's own parameters, among the resident or gathered bytes.
        trainable_bytes: those of its parameters its backward makes a gradient for.
        later_gradient_bytes: gradients its graph does not make, alive during its backward.
        eager_bytes: held by eager code beside it, at least the loop's loss of the previous call.
        resident_bytes: the model's and optimizers' (and partner models') resident bytes.
        gathered_bytes: FSDP2's all-gathered parameters in flight.
        pending_bytes: saves of open regions (forward run, backward not yet): a graph break's.
        own_open_bytes: those of ``pending_bytes`` its own code's open forwards hold.
        repeated_copies: copies of its saves alive beside its last call, where its code runs
            again before its backward (``memfit.compiler.repeated_calls``); 0 otherwise.
        saves_cap_bytes: the most its forward may save, planned jointly, or an evaluation's
            (``evaluation_cap``) (``None``: no cap).
        evaluation_capped: ``saves_cap_bytes`` is an evaluation's, which no plan may meet.
        dropped_gradient_bytes: the model's gradients, among ``resident_bytes``, that the loop
            frees before the backward (``memfit.compiler.dropped_gradients``): the plan's graph
            holds them over its forward, and ``outside_bytes`` leaves them out.
        outside_bytes: ``resident_bytes + gathered_bytes`` less ``parameter_bytes``, plus
            ``pending_bytes``, ``eager_bytes``, inductor's layout copies of its inputs and,
            without ``repeated_copies``, its own copies under ``saves_cap_bytes``.
    """

    parameter_bytes: int
    trainable_bytes: int
    later_gradient_bytes: int
    eager_bytes: int
    resident_bytes: int
    gathered_bytes: int
    pending_bytes: int
    own_open_bytes: int
    repeated_copies: int
    saves_cap_bytes: int | None
    outside_bytes: int
    evaluation_capped: bool = False
    dropped_gradient_bytes: int = 0


def bytes_outside(planner: OutsideCounter, joint: fx.GraphModule, inputs: Sequence[Binding],
                  device: torch.device, num_fwd_outputs: int, site: Any) -> OutsideBytes:
    """The bytes alive beside the region compiled at ``site`` while it runs (``OutsideBytes``),
    ``joint`` its priced joint graph and ``inputs`` what each of its placeholders is bound to;
    agreed across ranks by one collective (``agree_max``) that every rank calls."""
    parameters = sum(binding_bytes(node) for node, binding in
                     zip(joint.graph.find_nodes(op="placeholder"), inputs, strict=True)
                     if binding.kind == "parameter")
    trainable = trainable_parameter_bytes(joint, num_fwd_outputs, inputs)
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
    seen = planner.gradients_seen.get(planner.program_now)
    dropped = dropped_gradient_bytes(seen, planner.model, device) if seen is not None else 0
    later, eager, resident, pending, gathered, fewest_dropped = agree_max(
        [later, eager, resident, pending, gathered, -dropped])
    dropped = min(-fewest_dropped, resident)  # what every rank drops
    # the region's parameters are among the resident or, under FSDP2, the gathered bytes
    outside = max(0, resident - dropped + gathered - parameters) + pending + eager
    if planner.options.compiler == "inductor":  # its channels-last copies of the region's inputs
        from memfit.lowering.inductor import layout_copy_bytes

        outside += layout_copy_bytes(joint)
    cap, evaluation = planner.saves_caps.get(site), False
    if cap is None:  # an evaluation's, where its code also trains (``evaluation_cap``)
        cap = evaluation_cap(planner.regions, site)
        evaluation = cap is not None
    # its plan is chosen for its repeated calls' copies (``partitioner.lowered_beside_copies``)
    repeated = extra_copies(planner.regions, site) if site in planner.copies_sites else 0
    outside += 0 if repeated else own_copies_bytes(planner.regions, site, cap)
    own_open = sum(region.saved_bytes * region.open_forwards for region in planner.regions
                   if site is not None and region.site == site)
    return OutsideBytes(parameters, trainable, later, eager, resident, gathered, pending,
                        own_open, repeated, cap, outside, evaluation, dropped)


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
    earlier = sum(region.trainable_bytes for region in regions
                  if region.open_forwards and not region.replaced)
    return max(0, missing_gradient_bytes(model, device) - trainable - earlier)


def binding_bytes(node: fx.Node) -> int:
    """The bytes of the storage under ``node``'s value; 0 where it is not a tensor."""
    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0
