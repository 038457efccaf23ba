"""The text of ``memfit.report``: one row per compiled region, then notes.

Example:
    >>> print(regions_report(compiled._memfit_backend))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.data.tables import table
from memfit.data.units import format_bytes

if TYPE_CHECKING:
    from memfit.compiler.region import Planner, Region
    from memfit.data.plan import Plan


def regions_report(planner: Planner) -> str:
    """Per compiled region: budget, unplanned, predicted and measured peak and their gap, how
    many of its saved tensors were swapped and recomputed, its re-runs (the bytes they rebuild
    and their predicted time), the predicted step; then how often plans were remade and which
    code ran outside any plan."""
    if not planner.regions:
        return "\n".join(["memfit: no region has been compiled yet (call the model once)",
                          *_unplanned_notes(planner)])
    text = table(("region", "ops", "budget", "unplanned", "predicted", "measured", "gap",
                  "strategy", "swapped / saved", "recomputed / saved",
                  "re-runs (bytes, time predicted)", "step (predicted)"),
                 [_row(region) for region in planner.regions])
    return "\n".join([text, *_notes(planner)])


def _notes(planner: Planner) -> list[str]:
    notes = [planner.budget_note] if planner.budget_note else []
    if any(region.measured_peak_bytes is not None for region in planner.regions):
        notes.append("measured: the device's peak while the region's forward or backward ran "
                     "(latest measured run); on a CPU, of the tensors memfit sees (the model, "
                     "optimizer state, the regions' inputs, outputs and saves, and what eager "
                     "code was seen to hold), not others the loop may hold. gap: measured - "
                     "predicted; 'ops': counted from what ops returned (a profiler of the "
                     "user's was on), kernel scratch not seen.")
    notes.append("saved: the region's saved tensors (forward values its backward reads); "
                 "re-runs: forward ops run again, the bytes they rebuild and their time")
    count = len(planner.regions)
    notes.append(f"{count} plan{'s' if count != 1 else ''} made, {planner.planning_s:.1f} s "
                 "tracing and planning")
    notes += [_planning_note(region) for region in planner.regions
              if getattr(region, "planning", None)]
    notes += [f"plan cache: ignored {why}" for why in getattr(planner, "cache_ignored", ())]
    notes += [_bound_note(region) for region in planner.regions if region.shape_bound]
    if planner.bound_replans:
        notes.append(f"planned again {planner.bound_replans} time(s): a shape was past the "
                     "largest sizes a dynamic region's plan was priced at")
    if planner.joint_first_regions:
        notes.append(f"planned jointly before the first run: its {planner.joint_first_regions} "
                     "regions (graph breaks) traced on fake inputs, the earlier ones saving at "
                     "most their share ('saves <=' in budget) where a later one was short")
    elif planner.joint_first_note:
        notes.append(planner.joint_first_note)
    if planner.joint_rounds:
        notes.append(f"planned jointly {planner.joint_rounds} time(s): a region could not fit "
                     "beside the saves of the regions that ran before it (a graph break's, the "
                     "model's earlier call with other arguments), so those save "
                     "at most their share ('saves <=' in budget)")
    if any(region.replaced for region in planner.regions):
        notes.append("*: a plan replaced by a later one of the same code")
    if planner.replans:
        notes.append(f"planned again {planner.replans} time(s): more stayed resident than the "
                     "earlier plans left room for (optimizer state, kept gradients)")
    if planner.retained_replans:
        notes.append(f"planned again {planner.retained_replans} time(s): a backward with "
                     "retain_graph=True keeps the saves it reads to its end, which the earlier "
                     "plans freed as read; later plans keep them")
    notes += [_eager_note(region) for region in planner.regions
              if region.eager_forward_bytes or region.eager_backward_bytes]
    if planner.eager_replans:
        notes.append(f"planned again {planner.eager_replans} time(s) with room for what eager "
                     "code held beside the regions (its plan's budget counts it)")
    for where in planner.eager_codes:
        notes.append(f"ran outside any plan: {where} (Dynamo's recompile limit)")
    between = getattr(planner, "eager_between_bytes", 0)
    if between:
        notes.append(f"over the budget outside any plan: eager code between iterations held "
                     f"the device at {format_bytes(between)} with no compiled region open "
                     "(the optimizer's step, another model's forward, the batch's loading)")
    return notes + _unplanned_notes(planner)


def _unplanned_notes(planner: Planner) -> list[str]:
    """The calls of the model that ran code eagerly, outside any plan, by code and cause
    (``memfit.compiler.unplanned``)."""
    return [f"ran outside any plan: {count} call(s): {what}"
            for what, count in getattr(planner, "unplanned_calls", {}).items()]


def _planning_note(region: Region) -> str:
    """The seconds ``region``'s planning took, and whether its plan came from the cache
    (``memfit.planning.plan_cache``)."""
    cost = region.planning
    assert cost is not None
    if cost.plans_cached and not cost.plans_made:
        source = "read from the plan cache"
    elif cost.plans_cached:
        source = f"{cost.plans_made} made, {cost.plans_cached} read from the plan cache"
    else:
        source = f"{cost.plans_made} made" if cost.plans_made != 1 else "made"
    return (f"region {region.index}: plan {source} in {cost.choosing_s:.2f} s (planning "
            f"seconds), {cost.around_s:.2f} s analysing and rewriting its graph")


def _bound_note(region: Region) -> str:
    """The sizes a dynamic region's plan was priced at (every smaller shape runs it)."""
    sizes = ", ".join(f"{symbol}<={value}" for symbol, value in
                      sorted(region.shape_bound.items(), key=lambda item: str(item[0])))
    return f"region {region.index}: dynamic shapes, planned at {sizes}"


def _eager_note(region: Region) -> str:
    """Bytes eager code held while ``region`` ran (``memfit.runtime.outside``), and whether its
    plan had room for them."""
    from memfit.compiler.replanning import eager_bytes_to_plan, eager_overrun_bytes

    held = max(region.eager_forward_bytes, region.eager_backward_bytes)
    if region.budget_bytes is None:
        status = (f"no budget to plan it in; its predicted peak counts "
                  f"{format_bytes(region.planned_eager_bytes)} for it (the backward's less the "
                  "outputs freed by then)")
    elif region.planned_eager_bytes >= eager_bytes_to_plan(region):
        status = (f"its plan counts {format_bytes(region.planned_eager_bytes)} for it (the "
                  "backward's less the outputs freed by then)")
    elif region.replaced:
        status = "a later plan of its code counts it"
        if eager_overrun_bytes(region):
            status = (f"its measured run was {format_bytes(eager_overrun_bytes(region))} over "
                      f"the budget; {status}")
    else:
        status = "its plan had room for it"
    return (f"ran outside any plan: {format_bytes(held)} held by eager code while region "
            f"{region.index} ran ({format_bytes(region.eager_backward_bytes)} at its backward's "
            f"start, {format_bytes(region.eager_forward_bytes)} at its forward's: the loop's "
            f"loss and its buffers, the loss's target, code at a graph break, tensors the loop "
            f"keeps such as an EMA copy of the model); {status}")


def _row(region: Region) -> tuple:
    from memfit.model.explain import tally

    plan, graph = region.plan, region.plan_graph
    counted = tally(graph, plan, region.predicted)
    budget = format_bytes(region.budget_bytes) if region.budget_bytes else "none"
    if region.saves_cap_bytes is not None:
        budget += f", saves <= {format_bytes(region.saves_cap_bytes)}"
    measured = region.measured_peak_bytes
    gap = "-"
    if measured is not None:
        difference = measured - region.predicted_peak_bytes
        gap = f"{difference:+,d} B ({100 * difference / region.predicted_peak_bytes:+.2f}%)"
    return (f"{region.index}{'*' if region.replaced else ''}", len(graph.ops), budget,
            format_bytes(region.baseline_peak_bytes), format_bytes(region.predicted_peak_bytes),
            _measured(region), gap,
            _strategy_cell(plan),
            f"{counted.swapped} / {counted.saved}", f"{counted.recomputed} / {counted.saved}",
            f"{counted.rerun_count} ({format_bytes(counted.rerun_bytes)}, "
            f"{counted.recompute_s * 1e3:.2f} ms)",
            f"{region.predicted.step_time_s * 1e3:.2f} ms")


def _strategy_cell(plan: Plan) -> str:
    """The strategy, and in brackets the solver or candidate that made the plan where it names
    another (``auto (fused-chains)``, ``optimal-recompute (segments)``)."""
    solver = plan.params.get("solver", plan.strategy)
    return plan.strategy if solver == plan.strategy else f"{plan.strategy} ({solver})"


def _measured(region: Region) -> str:
    measured = region.measured_peak_bytes
    if measured is None:
        return "-"
    return format_bytes(measured) + (" (ops)" if region.measured_by == "ops" else "")
