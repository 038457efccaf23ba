"""Planning the compiled regions of one iteration together, after it has run: a region whose
saves an iteration held in several copies (its forward ran again before its backward), and the
regions of a graph-broken model whose earlier saves left a later one short (the rules are in
``memfit.compiler.graph_breaks``).

A mixin of ``memfit.compiler.backend.Backend``, its own file so the backend reads as planning
one region; it uses the backend's ``regions``, ``options``,
``saves_caps``, ``joint_rounds``, ``joint_failed``, ``replanned_beside_copies``,
``copies_sites``, ``copies_short_said`` and ``make_room_for_eager``.

Example:
    >>> backend.iteration_closed()  # after a backward: plan the regions again where needed
"""

from __future__ import annotations

import warnings
from typing import Any

from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import (
    copies_held,
    joint_failure_reason,
    latest_regions,
    mode_sibling,
    save_at_most,
    saves_caps,
    site_training,
)
from memfit.compiler.region import Region
from memfit.compiler.repeated_calls import fit_copies, live_forwards, uncounted_copies
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetWarning
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.units import Budget, format_bytes
from memfit.model.simulate import simulate
from memfit.planning.step import plan_step, rerun_whole
from memfit.runtime.outside import EagerWatch
from memfit.runtime.ranks import agree_on_eager_bytes

MAX_JOINT_ROUNDS = 2  # joint re-plans of a graph-broken model; each costs a trace of every region


class JointPlanning:
    """The backend's planning of the regions of an iteration together, once it has run."""

    regions: list[Region]
    options: BackendOptions
    saves_caps: dict[Any, int]
    joint_rounds: int
    joint_failed: bool
    replanned_beside_copies: set[Any]
    copies_sites: set[Any]
    copies_short_said: bool
    beside_evaluation: set[Any]
    evaluations_capped: set[Any]

    def make_room_for_eager(self, current: list[Region]) -> dict[int, int]:
        raise NotImplementedError  # the backend's (memfit.compiler.eager_watching)

    def step_peak_found(self, peak_bytes: int) -> None:
        raise NotImplementedError  # the backend's

    def eager_watch(self) -> EagerWatch | None:
        raise NotImplementedError  # the backend's (memfit.compiler.eager_watching)

    def watch_between_iterations(self) -> None:
        raise NotImplementedError  # the backend's (memfit.compiler.eager_watching)

    def replans_provisional(self, regions: list[Region]) -> bool:
        raise NotImplementedError  # the backend's

    def _save_at_most(self, cap_bytes: int, graph: CostGraph, hardware: Hardware, outside: int,
                      budget_bytes: int, lower: Any) -> tuple[Plan, Any]:
        """A plan of this region whose forward saves at most ``cap_bytes`` (``save_at_most``)."""
        def plan_at(at_bytes: int) -> Plan:
            return plan_step(graph, hardware, Budget(bytes=at_bytes), self.options.strategy,
                             self.options.params, outside).plan

        return save_at_most(plan_at, lower, cap_bytes, budget_bytes,
                            lambda: rerun_whole(graph, hardware, budget_bytes, outside))

    def iteration_closed(self) -> None:
        """After a backward: once no region is open (the iteration's backward is done), plan
        again the regions whose plans left no room for what eager code held beside them
        (``make_room_for_eager``) or for the copies of their own saves the iteration held
        (``plan_for_copies``); if a region could not fit because of earlier regions' saves, cap
        those saves and plan every region again, so the next iteration fits (see
        ``memfit.compiler.graph_breaks``)."""
        current = latest_regions(self.regions)
        if any(region.open_forwards for region in current):
            return
        watch = self.eager_watch()
        if watch is not None:
            watch.new_iteration()
            self.watch_between_iterations()
        self.replanned_beside_copies.clear()
        self.settle_provisional(current)
        agree_on_eager_bytes(current)
        grown = self.make_room_for_eager(current)
        if self.joint_failed or self.plan_for_copies(current):
            return
        short = [region for region in current if region.minimum_bytes is not None
                 and region.site not in self.beside_evaluation]
        if not short:
            return
        caps = saves_caps(current, grown)
        if self.joint_rounds >= MAX_JOINT_ROUNDS or all(
                self.saves_caps.get(site) == cap for site, cap in caps.items()):
            self._joint_failed(short[0], grown.get(short[0].index, 0))  # nothing new to plan
            return  # for: no caps, or the same again
        self.joint_rounds += 1
        self.saves_caps.update(caps)
        self.replan_regions()

    def settle_provisional(self, current: list[Region]) -> None:
        """Once an iteration ran every region, where some were planned provisionally (under a
        fraction before the step's unplanned peak was known: ``Backend._provisional``), the
        peak is the highest among the regions', and those whose budget that changes are planned
        again under that fraction of it, each saving at most its share of the room the regions
        after it leave (``saves_caps`` with ``fitting``), so that their plans, made beside the
        provisional saves, keep fitting."""
        if not any(region.provisional for region in current):
            return
        self.step_peak_found(max(region.baseline_peak_bytes for region in current))
        caps = saves_caps(current, fitting=True)
        for region in current:
            if not self.replans_provisional([region]):
                continue
            cap = caps.get(region.site)
            if cap is not None:
                self.saves_caps[region.site] = min(self.saves_caps.get(region.site, cap), cap)
            region.replaced = True

    def beside_own_copies(self, regions: list[Region]) -> bool:
        """Whether the compiled code planned as ``regions`` is planned again before its forward
        runs, beside the saves of its own earlier forwards that are still alive and that its
        plan did not count (the second call of a model called twice per step): once per code
        and iteration, so that a siamese loss fits from the first iteration where the room is
        there; where more calls follow, ``plan_for_copies`` plans for all of them after it."""
        newest = regions[-1]
        site = newest.site
        if (site is None or newest.budget_bytes is None or newest.saves_cap_bytes is not None
                or site in self.replanned_beside_copies or self.options.fixed_plan is not None):
            return False
        alive = sum(region.saved_bytes * live_forwards(region) for region in self.regions
                    if region.site == site)
        if alive <= newest.own_pending_bytes:
            return False
        self.replanned_beside_copies.add(site)
        for region in regions:
            region.replaced = True
        return True

    def beside_more_saves(self, regions: list[Region]) -> bool:
        """Whether the compiled code planned as ``regions`` is planned again before it runs,
        beside more saves of other regions' open forwards than its plan counted: an evaluation
        run with gradients on whose output (and so its graph) the loop still holds, a region
        before a graph break whose newer plan saves more. Its next plan counts them, or says it
        cannot fit beside them; a plan made beside more than are open now stays, so that saves
        held only now and then do not plan it again each time."""
        newest = regions[-1]
        if newest.budget_bytes is None or self.options.fixed_plan is not None:
            return False
        others = [region for region in self.regions
                  if (region.site != newest.site if newest.site is not None
                      else region not in regions)]
        alive = sum(region.saved_bytes * region.open_forwards for region in others)
        if alive <= newest.others_pending_bytes:
            return False
        for region in regions:
            region.replaced = True
        return True

    def evaluations_planned(self, made: list[Region]) -> None:
        """After regions ``made`` were planned: a training region that could only run at its
        smallest peak beside an evaluation's open saves (its code in ``eval()`` mode, run with
        gradients on, its output kept: ``evaluation_cap``) has that evaluation planned again
        before its next run (once per evaluation), under the cap its room now gives; an
        evaluation planned under such a cap has its training code planned again beside its
        smaller saves."""
        for region in made:
            site, training = region.site, site_training(region.site)
            if training is False and region.saves_cap_bytes is not None:
                for other in latest_regions(self.regions):
                    if mode_sibling(site, other.site) and other.site in self.beside_evaluation:
                        self.beside_evaluation.discard(other.site)
                        other.replaced = True
            elif training and region.minimum_bytes is not None:
                open_sites = {other.site for other in self.regions if other.open_forwards
                              and mode_sibling(site, other.site)}
                if open_sites:  # short beside them: not joint planning's to fix
                    self.beside_evaluation.add(site)
                open_sites -= self.evaluations_capped  # once each: no plan ping-pong
                self.evaluations_capped |= open_sites
                for other in self.regions:
                    if other.site in open_sites:
                        other.replaced = True

    def plan_for_copies(self, current: list[Region]) -> bool:
        """Have each region whose forward ran again before its backward, where its plan did
        not fit beside the copies of its saves that its iteration held (``uncounted_copies``),
        planned for them (``fit_copies``), and every region planned again; whether any was.
        A block called twice per step (a siamese loss) holds the first call's saves while the
        second runs; unplanned, those copies put every iteration over the budget."""
        copied = [region for region in current
                  if region.budget_bytes is not None and uncounted_copies(region)]
        if not copied or self.options.fixed_plan is not None:
            return False
        for region in copied:
            self.copies_sites.add(region.site)
            warnings.warn(
                f"memfit: the forward of region {region.index} ran {copies_held(region)} times "
                f"before its backward (the model called that often per step, or one compiled "
                f"block run for several layers) while its plan did not fit beside the copies of "
                f"its {format_bytes(region.saved_bytes)} of saved values, so this iteration may "
                f"have run over the budget; it is planned again for them, to fit from the next "
                f"iteration.", BudgetWarning, stacklevel=2)
        self.replan_regions()
        return True

    def _fit_copies(self, extra: int, graph: CostGraph, hardware: Hardware, outside: int,
                    budget_bytes: int, lower: Any) -> tuple[Plan, Any]:
        """A plan of this region that fits beside ``extra`` more copies of its saves
        (``fit_copies``); where none does, the closest, said once."""
        def plan_at(at_bytes: int) -> tuple[Plan, int]:
            planned = plan_step(graph, hardware, Budget(bytes=at_bytes), self.options.strategy,
                                self.options.params, outside)
            return planned.plan, planned.predicted.peak_bytes + outside

        def fewest() -> tuple[Plan, int] | None:
            made = rerun_whole(graph, hardware, budget_bytes, outside)
            if made is None:
                return None
            return made, simulate(graph, made, hardware).peak_bytes + outside

        made, lowered, fits = fit_copies(plan_at, lower, extra, budget_bytes, fewest)
        if not fits and not self.copies_short_said:
            self.copies_short_said = True  # said once; joint planning of other regions goes on
            warnings.warn(
                f"memfit: no plan of a compiled region fits {format_bytes(budget_bytes)} beside "
                f"the {extra} more copies of its saved values that its repeated calls hold "
                f"before their backward; it runs the plan closest to it and may run over the "
                f"budget. Raise the budget or call it fewer times per backward.", BudgetWarning,
                stacklevel=2)
        return made, lowered

    def _joint_failed(self, short: Region, eager_bytes: int = 0) -> None:
        """Say once that planning jointly cannot make ``short`` fit: it keeps running at its
        smallest peak, over the budget, on every iteration. ``eager_bytes``: what eager code was
        seen to hold beside it beyond what its plan counted (the loop's loss and its buffers)."""
        self.joint_failed = True
        why = joint_failure_reason(short, eager_bytes)
        warnings.warn(
            f"memfit: planning the regions jointly cannot fit region {short.index} in "
            f"{format_bytes(short.budget_bytes or 0)}: {why}; every iteration runs over the "
            "budget. Raise the budget, remove the graph break (torch._dynamo.explain(model)"
            "(...) shows it), or call the model once per step.", BudgetWarning, stacklevel=2)

    def replan_regions(self) -> None:
        """Have every current region planned again before its next run (each region's callable,
        ``memfit.compiler.replanning``, does it without Dynamo tracing anything again)."""
        for region in latest_regions(self.regions):
            region.replaced = True
