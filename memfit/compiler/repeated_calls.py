"""A compiled region whose forward runs again before its backward: a model called twice per step
(a siamese or contrastive loss), a cell called once per time step. Each call's saved values live
until its backward, so an iteration holds one copy of them per open call, beside the region's
own peak. The first call is planned before the others are known; the backward's end shows how
many copies there were (``Region.most_open_forwards``), and the region's next plan is the one
whose peak beside that many more copies of its saves fits the budget (``fit_copies``).

Example:
    >>> uncounted_copies(region)  # copies of its saves its plan did not fit beside
    2
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memfit.compiler.graph_breaks import SAVES_BISECTION_STEPS, copies_held

if TYPE_CHECKING:
    from memfit.compiler.region import Region
    from memfit.data.plan import Plan


def storages_of(values: Sequence) -> set:
    """The storages of the tensors among ``values``, weakly (before a boxed call clears them)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    return {StorageWeakRef(value.untyped_storage()) for value in values
            if isinstance(value, torch.Tensor)}


def note_forward_saves(region: Region, inputs: set, saved: Iterable) -> None:
    """After a forward run of ``region``: note, weakly, the storages it ``saved`` for its
    backward beyond its ``inputs`` (``storages_of`` its arguments: parameters, the batch, and
    views of them) and its outputs (``Region.output_storages``: the loop may keep one after the
    backward, a sigmoid's, say), as one more forward whose saves may be alive
    (``live_forwards``), and forget the forwards whose saves all died (their backward ran, or
    autograd dropped their graph: a forward with gradients on and no backward, an evaluation
    without ``no_grad``)."""
    held = inputs | {reference for reference in region.output_storages if reference is not None}
    made = tuple(reference for reference in saved if reference not in held)
    alive = tuple(saves for saves in region.live_saves if _alive(saves))
    region.live_saves = alive + ((made,) if made else ())


def live_forwards(region: Region) -> int:
    """How many forwards of ``region`` still hold saves (whose backward has not run): what
    ``Region.open_forwards`` counts, less the forwards whose graph autograd dropped without a
    backward, which that counter keeps open for good."""
    return sum(1 for saves in region.live_saves if _alive(saves))


def _alive(saves: tuple) -> bool:
    return any(not reference.expired() for reference in saves)


def uncounted_copies(region: Region) -> int:
    """How many copies of ``region``'s saves beyond one its iteration held where its plan did
    not fit beside them: it was planned beside fewer (``Region.own_pending_bytes``: before its
    second call, ``Backend.beside_own_copies``, or for the copies of an earlier iteration) or
    could not fit there (``Region.minimum_bytes``); else 0. A plan already fitted beside as many
    (``fit_copies``, ``Region.copies_planned``) counts them, fitting or not: planning it again
    for them would choose it again, once per iteration (a loop that holds an evaluation's graph,
    made without ``no_grad``, through the next training step), and that none fits is said once.
    An FSDP2 unit capped in the first iteration (``first_iteration_cap``) counts its copies its
    own way: 0."""
    if region.site is None or not region.saved_bytes:
        return 0
    if region.saves_cap_bytes is not None and not region.own_pending_bytes:
        return 0
    extra = copies_held(region) - 1
    if extra <= region.copies_planned:
        return 0
    fitted_beside = (region.minimum_bytes is None
                     and region.saved_bytes * extra <= region.own_pending_bytes)
    return 0 if extra <= 0 or fitted_beside else extra


def fit_copies(plan_at: Callable[[int], tuple[Plan, int]], lower: Callable[[Plan], tuple],
               extra: int, budget_bytes: int,
               fewest: Callable[[], tuple[Plan, int] | None]) -> tuple[Plan, tuple, bool]:
    """The plan whose whole-device peak beside ``extra`` more copies of its saves fits
    ``budget_bytes``, at the largest budget a bisection between the region's smallest peak and
    ``budget_bytes`` finds (a larger budget re-runs less; it also saves more, which the copies
    multiply); where none does, the plan saving the fewest (the region re-run whole from its
    inputs) if that fits; else the plan whose peak with its copies is least.

    Args:
        plan_at: the region's plan at a whole-device budget and its whole-device peak (raises
            ``BudgetError`` below the strategy's smallest peak).
        lower: a plan's forward and backward modules and the device bytes the forward saves.
        extra: the copies of its saves alive beside its last call.
        budget_bytes: the region's budget.
        fewest: ``fewest()``: the plan saving the fewest bytes and its peak, or ``None``.

    Returns:
        The plan, ``lower(plan)``, and whether it fits with its copies.
    """
    from memfit.data.errors import BudgetError

    tried: list[tuple[int, Plan, tuple]] = []

    def with_copies(made: Plan, peak_bytes: int) -> bool:
        lowered = lower(made)
        tried.append((peak_bytes + extra * lowered[-1], made, lowered))
        return tried[-1][0] <= budget_bytes

    try:
        plan_at(1)
        raise AssertionError("no plan fits a budget of one byte")
    except BudgetError as error:
        low = error.minimum_bytes
    best = None
    if with_copies(*plan_at(low)):
        best, high = tried[-1], budget_bytes
        if with_copies(*plan_at(budget_bytes)):
            return tried[-1][1], tried[-1][2], True
        for _ in range(SAVES_BISECTION_STEPS):
            middle = (low + high) // 2
            if with_copies(*plan_at(middle)):
                best, low = tried[-1], middle
            else:
                high = middle
        return best[1], best[2], True
    fallback = fewest()
    if fallback is not None and with_copies(*fallback):
        return tried[-1][1], tried[-1][2], True
    least = min(tried, key=lambda candidate: candidate[0])
    return least[1], least[2], False


def call_site(regions: Sequence[Region], site: Any, bound: Mapping | None) -> Any:
    """Where Dynamo compiling ``site``'s code again makes a second program of one step, the site
    of that program, else ``site``. A model called again in a step with other arguments (an
    optional argument given, another flag, an input that needs its gradient) fails the guards of
    the graph its first call runs, while that call's saves wait for the backward: the two graphs
    run side by side every iteration, each with its own saves, and neither replaces the other.
    Such a compile gets the first of ``site``'s variants (``variant_of``) with no forward open
    now; a graph with more symbolic sizes (``bound``) than an open one of its site is Dynamo's
    more general program for both calls (another batch size, automatic dynamic shapes), which
    replaces it, and keeps its site."""
    if site is None:
        return None
    symbols = len(bound or {})
    for variant in range(len(regions) + 1):
        candidate = variant_of(site, variant)
        open_regions = [region for region in regions
                        if region.site == candidate and live_forwards(region)]
        if not open_regions or any(symbols > len(region.shape_bound or {})
                                   for region in open_regions):
            return candidate
    return site


def variant_of(site: Any, variant: int) -> Any:
    """``site`` (``compiling_site``) as its ``variant``-th program of one step (0: itself)."""
    if not variant:
        return site
    code, owner, place, training = (site + (None,) * 3)[:4] if isinstance(site, tuple) else (
        site, None, 0, None)
    return code, owner, place, training, variant
