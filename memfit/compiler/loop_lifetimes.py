"""Regions planned for the loop as it runs: where no plan fits with every output held to the
iteration's end, a region that returns its own loss (a transformers model called with
``labels=``) is planned with its non-scalar outputs (a language model's logits, its key/value
cache) freed when its forward ends and their gradients never passed, as a loop that keeps only
the loss runs it (``memfit.compiler.region_lifetimes.dropped_outputs_graph``). The loss and the previous
call's loss the loop keeps stay counted. A region without a loss of its own is not: its loss is
computed outside from its outputs, which that code holds and takes gradients of.

What a region assumed is checked at each of its backwards: where the loop held one of those
outputs through it, or passed a gradient for one, the plan did not describe the step, and
memfit says so (``BudgetWarning``) and plans the region again with every output held.

Example:
    >>> loop_lifetimes_apply(backend.regions, site, pending=0, repeated=0, cap=None)
    True
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from memfit.compiler.region import Region
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError, BudgetWarning
from memfit.data.hardware import Hardware
from memfit.data.units import Budget, format_bytes
from memfit.planning.step import Planned, plan_step


def loop_lifetimes_apply(regions: Sequence[Region], site: Any, pending: int, repeated: int,
                         cap: int | None) -> bool:
    """Whether a region compiled at ``site`` may be planned for the loop's lifetimes: it runs
    with no earlier region's saves alive (no graph break before it, no repeated call of its
    code, no joint cap on its saves), and no backward of its code showed the loop holding
    what such a plan freed."""
    if pending or repeated or cap is not None:
        return False
    return not any(region.loop_refuted for region in regions if region.site == site)


def planned_for_the_loop(loop_graph: CostGraph, hardware: Hardware, held_error: BudgetError,
                         strategy: str, params: Mapping[str, Any], outside_bytes: int,
                         what_ifs: bool = False) -> Planned:
    """``loop_graph`` planned under the whole-device budget that ``held_error`` refused with
    every output held (a fraction already resolved against the step with them held).

    Raises:
        BudgetError: where it does not fit either: whichever of the two errors has the smaller
            minimum (each is the peak of a plan that strategy makes at it); the loop's says
            that it holds for a loop that keeps only the loss, and what holding the rest needs.
    """
    try:
        return plan_step(loop_graph, hardware, Budget(bytes=held_error.budget_bytes), strategy,
                         params, outside_bytes, what_ifs=what_ifs)
    except BudgetError as loop_error:
        try:
            if held_error.minimum_bytes <= loop_error.minimum_bytes:
                raise held_error from None
            raise _for_a_loop_keeping_the_loss(loop_error, held_error.minimum_bytes) from None
        finally:  # the error it raises holds this frame: keeping it here would be a cycle that
            del held_error  # holds every frame of the step (and the model's outputs) until a gc


def _for_a_loop_keeping_the_loss(error: BudgetError, held_minimum_bytes: int) -> BudgetError:
    """``error`` (the smallest peak of the step run by a loop that keeps only its loss), saying
    so, and the smallest peak where the loop holds the call's other outputs too."""
    note = (f"That minimum holds where the loop keeps only the loss of the model's call "
            f"(loss = model(...).loss); holding its other outputs through the backward (logits, "
            f"a Hugging Face model's key/value cache: pass use_cache=False) needs "
            f"{format_bytes(held_minimum_bytes)}.")
    return BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant, error.strategy,
                       f"{error.note} {note}".strip(), host_bytes=error.host_bytes)


def _released_but_alive(region: Region) -> list[str]:
    """The outputs ``region``'s plan freed after its forward that something still references."""
    return [name for name, reference in zip(region.output_names, region.output_storages,
                                            strict=False)
            if name in region.released_outputs and reference is not None
            and not reference.expired()]


def collect_before_backward(region: Region) -> None:
    """Before ``region``'s backward runs: where an output its plan freed is still alive, run a
    full collection, so that what only reference cycles hold (the frames a Dynamo trace leaves
    behind, the call's output among their locals) is freed before the backward's peak, and
    ``check_loop_lifetimes`` judges what the loop itself holds."""
    if region.released_outputs and not region.loop_refuted and _released_but_alive(region):
        gc.collect()


def check_loop_lifetimes(region: Region, passed: Sequence[tuple[str, object]]) -> None:
    """After ``region``'s backward ran with tangents ``passed`` (``tangents_given``): where its
    plan freed outputs the loop in fact held through the backward, or whose gradients it
    passed, say so once and have the region planned again with every output held."""
    if not region.released_outputs or region.loop_refuted:
        return
    given = {name for name, storage in passed if storage is not None}
    held = _released_but_alive(region)
    graded = [output for output, tangent in zip(region.output_names, region.output_tangents,
                                                strict=False)
              if output in region.released_outputs and tangent in given]
    if not held and not graded:
        return
    region.loop_refuted = region.replaced = True
    warnings.warn(
        f"memfit: region {region.index} was planned with its outputs "
        f"{sorted(set(held + graded))} freed after its forward (no plan fits with them held "
        "to the iteration's end), but the loop held them or took their gradient: this "
        "iteration may run over the budget. memfit plans it again with them held, which "
        "may not fit; keep only the loss (`loss = model(...).loss`).", BudgetWarning,
        stacklevel=3)
