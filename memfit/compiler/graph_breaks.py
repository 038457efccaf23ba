"""Compiled regions split by graph breaks: planned jointly once all are known, and the regions
Dynamo stops compiling (its recompile limit) named.

A model with a graph break runs as several compiled regions, each planned when Dynamo compiles
it. The first region is planned before the later ones exist, so it may keep more saved values
than the later regions can afford to have alive while they run (a region's forward and backward
both run while every earlier region's saves wait for their backward). Once an iteration has run
every region and one of them could not fit, ``saves_caps`` gives each earlier region a share of
what the short region leaves for them, and each region is planned anew before its next run
(``Backend.replan_regions``, ``memfit.compiler.replanning``), each earlier one saving at most its share:
from the next iteration on the whole iteration fits. The first iteration need not wait for
that: ``memfit.fit`` traces the call on fakes before it first runs and gives the same caps from
the regions planned there (``graph_break_follows``, ``memfit.fitting.joint_first``); where the
regions are FSDP2's units (a transformer's blocks), a unit's region is planned knowing how many
units are still to run beside its saves, and saves at most its share of the room
(``regions_ahead``, ``units_ahead_cap``).

Example:
    >>> caps = saves_caps(latest_regions(backend.regions))  # {site: most bytes it may save}
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.compiler.region import Planner, Region
    from memfit.data.plan import Plan


def compiling_site() -> Any:
    """Where the region Dynamo is compiling now runs in one iteration: its code object, the
    module whose method it is (by id; its first argument, however named) where it is one, and
    its place among the regions of one Dynamo compile. A model whose blocks Dynamo compiles
    one by one (FSDP2's per-block ``fully_shard``: its hooks are skipped, so each block is a
    region between graph breaks) runs one code object as several regions per iteration, and
    DDP's ``DDPOptimizer`` splits one frame's graph into a region per gradient bucket; keyed by
    the code alone, they would replace one another in ``latest_regions`` and share one saves
    cap. The module's ``training`` flag is
    part of it: an evaluation run with gradients on (``model.eval()`` without ``no_grad``) is
    another program beside the training one, whose saves the loop may hold through the next
    training step, not a newer plan of it. A new shape of the same block is the same site, and
    replaces its older region. ``None`` outside Dynamo."""
    import torch
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        translator = InstructionTranslator.current_tx()
    except AttributeError:  # no translation running (a backend called by hand)
        return None
    code = getattr(translator, "f_code", None)
    frame_locals = getattr(translator, "f_locals", {})
    owner = frame_locals.get("self")
    if not isinstance(owner, torch.nn.Module) and getattr(code, "co_argcount", 0):
        first = frame_locals.get(code.co_varnames[0])  # a method's first argument, however named
        method = getattr(type(first), code.co_name, None)
        if getattr(method, "__code__", None) is code:
            owner = first
    place = _REGIONS_COMPILED.get(translator, 0)
    _REGIONS_COMPILED[translator] = place + 1
    if isinstance(owner, torch.nn.Module):
        return code, id(owner), place, owner.training
    # ``model.compile()`` runs the module's call inside a wrapper frame (``wrap_inline``)
    called = getattr(frame_locals.get("fn"), "__self__", None)
    if isinstance(called, torch.nn.Module):
        return code, None, place, called.training
    return code if not place else (code, None, place)


_REGIONS_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per Dynamo compile


def graph_break_follows(graph_module: Any, example_inputs: list) -> bool:
    """Whether Dynamo compiles this training region because a graph break ends it (more of the
    model runs after it, possibly more regions), rather than because its frame returns."""
    import torch

    reason = getattr(graph_module, "compile_subgraph_reason", None)
    trains = torch.is_grad_enabled() and any(
        isinstance(value, torch.Tensor) and value.requires_grad for value in example_inputs)
    return bool(trains and reason is not None and reason.graph_break)


def site_code(site: Any) -> Any:
    """The code object of a ``compiling_site``."""
    return site[0] if isinstance(site, tuple) else site


def latest_regions(regions: Sequence[Region]) -> list[Region]:
    """The newest region of each site (``compiling_site``), in the order those newest plans were
    made: the regions one iteration runs now (a re-planned site replaces its older ones)."""
    newest: dict[Any, Region] = {}
    for region in regions:
        if not region.replaced:
            newest[region.site if region.site is not None else region.index] = region
    return sorted(newest.values(), key=lambda region: region.index)


def saves_caps(regions: Sequence[Region], grown_bytes: Mapping[int, int] | None = None,
               fitting: bool = False) -> dict[Any, int]:
    """The most device bytes each earlier region may save so that every region that ran short
    fits its budget: what a short region has for the saves before it (its budget less its
    smallest peak without them) split among the earlier regions in proportion to what they
    saved. A region run several times before the short one (blocks sharing one compiled code,
    ``Region.most_open_forwards``) holds that many copies of its saves, so its cap is its share
    of the room divided among its copies. Regions whose smallest peak is over the budget even
    alone get nothing from this. ``grown_bytes``: region index -> bytes its next plan counts
    beyond this one's (eager code's, ``Backend.make_room_for_eager``), which raise its smallest
    peak by at most as much. ``fitting``: the regions that fit leave room too, their budget
    less their predicted peak without the earlier saves, so that their plans keep fitting
    (each earlier region's share is then at least what it saved).
    """
    caps: dict[Any, int] = {}
    for position, short in enumerate(regions):
        if short.budget_bytes is None or (short.minimum_bytes is None and not fitting):
            continue
        grown = (grown_bytes or {}).get(short.index, 0)
        needs = (short.predicted_peak_bytes if short.minimum_bytes is None
                 else short.minimum_bytes + grown)
        room = short.budget_bytes - (needs - short.pending_bytes)
        earlier = [region for region in regions[:position]
                   if region.site is not None and region.saved_bytes]
        total = sum(region.saved_bytes * copies_held(region) for region in earlier)
        if room <= 0 or not total:
            continue
        for region in earlier:
            share = room * region.saved_bytes // total  # of each of its copies
            caps[region.site] = min(caps.get(region.site, share), share)
    return caps


def copies_held(region: Region) -> int:
    """How many copies of ``region``'s saves an iteration holds at once (one, until it ran)."""
    return max(1, region.most_open_forwards)


def regions_ahead(unit_ids: Sequence[int], site: Any, open_owner_ids: set[int]) -> int | None:
    """How many regions will hold their saves beside this one's: the FSDP2 units
    (``memfit.runtime.resident.fsdp_unit_modules``, by id) that have not run yet in this
    iteration (none of their regions is open), this one aside, plus one for the root's code
    after the last unit (a final norm, the head, the loss: counted as one more unit). ``None``
    where the region is not a unit's (its ``compiling_site`` names another module, or none) or
    its unit is open."""
    owner = site[1] if isinstance(site, tuple) else None
    if owner not in unit_ids or owner in open_owner_ids:
        return None
    ran = sum(1 for unit in unit_ids if unit in open_owner_ids)
    return len(unit_ids) - ran


def units_ahead_cap(room_bytes: int, transient_bytes: int, ahead: int) -> int:
    """The most a unit's region may save when it is planned before the units after it have run
    (the first iteration): ``room_bytes`` (its budget less what is outside it, earlier regions'
    saves included) shared alike by it and the ``ahead`` regions after it, each holding its saves
    until its backward, with room left for one region's ``transient_bytes`` (its peak beyond its
    saves) on top. Assumes the units alike (a transformer's blocks): joint planning
    (``saves_caps``) corrects the rest once every region has run."""
    return max(0, room_bytes - transient_bytes) // (ahead + 1)


def own_copies_bytes(regions: Sequence[Region], site: Any, cap_bytes: int | None) -> int:
    """Bytes of a region's own saves alive at its last run in an iteration, beside it: where
    one compiled code runs for several blocks (``Region.most_open_forwards`` of its site's
    earlier regions), each earlier run holds its saves, at most ``cap_bytes`` each once joint
    planning capped them. Before a cap there is no bound to count (the first plan of a site
    does not know its copies yet; joint planning then finds them short). Under FSDP2 one
    region may run every block of a model, so left out of the caps and of this count, its
    copies would go unplanned and the step would hold every block's saves at once.
    """
    if cap_bytes is None or site is None:
        return 0
    return extra_copies(regions, site) * cap_bytes


def site_training(site: Any) -> bool | None:
    """The module's ``training`` flag a ``compiling_site`` was compiled in (``None``: no module)."""
    return site[3] if isinstance(site, tuple) and len(site) >= 4 else None


def mode_sibling(site: Any, other: Any) -> bool:
    """Whether ``other`` is ``site``'s code run in the module's other mode (``training``)."""
    training, other_training = site_training(site), site_training(other)
    return (training is not None and other_training is not None
            and training is not other_training and site[:3] == other[:3])


def evaluation_cap(regions: Sequence[Region], site: Any) -> int | None:
    """The most an evaluation's region may save: one compiled from the same code as training
    (``compiling_site`` but for the module's ``training`` flag, here ``False``) runs with
    gradients on (``model.eval()`` without ``no_grad``), and the loop may keep its output, so
    its graph and saves, through the next training step. That step's plan leaves room for what
    the newest training region's budget holds beyond its predicted peak without other code's
    saves (``Region.others_pending_bytes``); the evaluation saves at most that. ``None`` for
    other regions, or without a budgeted training region."""
    if site_training(site) is not False:
        return None
    rooms = [region.budget_bytes - (region.predicted_peak_bytes - region.others_pending_bytes)
             for region in latest_regions(regions)
             if mode_sibling(site, region.site) and region.budget_bytes is not None]
    return max(0, min(rooms)) if rooms else None


def extra_copies(regions: Sequence[Region], site: Any) -> int:
    """How many copies of its saves beyond its own the last run of ``site``'s code in an
    iteration has beside it (``copies_held`` of its regions, less one)."""
    return max((copies_held(region) for region in regions if region.site == site), default=1) - 1


def first_iteration_cap(model: Any, regions: Sequence[Region], site: Any, room_bytes: int,
                        transient_bytes: int) -> int | None:
    """The most an FSDP2 unit's region may save so that the units after it in this iteration fit
    beside its saves (``units_ahead_cap``); ``None`` for other regions. Without it the first units,
    planned before the later ones exist, would keep what the last cannot fit beside, and the first
    iteration would run over the budget. Every rank counts the same units and open regions."""
    from memfit.runtime.resident import fsdp_unit_modules

    units = [id(unit) for unit in fsdp_unit_modules(model)]
    open_owners = {region.site[1] for region in regions
                   if region.open_forwards and isinstance(region.site, tuple)}
    ahead = regions_ahead(units, site, open_owners) if units else None
    return None if ahead is None else units_ahead_cap(room_bytes, transient_bytes, ahead)


def joint_failure_reason(short: Region, eager_bytes: int) -> str:
    """Why planning jointly cannot fit ``short``, for the warning: ``eager_bytes`` is what eager
    code was seen to hold beside it beyond what its plan counted (the loop's loss, buffers)."""
    from memfit.data.units import format_bytes

    alone, budget = (short.minimum_bytes or 0) - short.pending_bytes, short.budget_bytes or 0
    if alone > budget:
        return f"it needs {format_bytes(alone)} even without the saves of {EARLIER_REGIONS}"
    if eager_bytes > 0 and alone + eager_bytes >= budget:
        return (f"it needs {format_bytes(alone)} and the {format_bytes(eager_bytes)} eager code "
                "holds beside it (the loss computed in the loop and its buffers), which leaves "
                f"no room for the {format_bytes(short.pending_bytes)} of saves of "
                f"{EARLIER_REGIONS}")
    return (f"{EARLIER_REGIONS} cannot save less than the {format_bytes(short.pending_bytes)} "
            "it ran beside")


EARLIER_REGIONS = ("the regions that ran before it (those before a graph break, the model's call "
                   "earlier in the step with other arguments)")  # whose saves wait beside it

SAVES_BISECTION_STEPS = 6  # budgets tried for a region whose saves are capped (1/64 resolution)


def save_at_most(plan_at: Callable[[int], Plan], lower: Callable[[Plan], tuple],
                 cap_bytes: int, budget_bytes: int,
                 fewest: Callable[[], Plan | None] | None = None) -> tuple[Plan, tuple]:
    """The plan whose forward saves at most ``cap_bytes``, at the largest budget a bisection
    between the region's smallest peak and ``budget_bytes`` finds (a larger budget re-runs
    less). Where even the smallest-peak plan saves more, ``fewest``'s plan (the region re-run
    whole from its inputs in its backward, as per-block checkpointing does) where it saves less
    than that: a region's smallest peak is not its fewest saves (a stage whose peak is one
    large op keeps what re-running could drop, at no gain to its own peak), and an earlier
    region's saves are what a later one lacks room for. Else the smallest-peak plan.

    Args:
        plan_at: the region's plan at a whole-device budget in bytes (raises ``BudgetError``
            below the strategy's smallest peak).
        lower: a plan's forward and backward modules and the device bytes the forward saves.
        cap_bytes: the most the forward may save.
        budget_bytes: the region's budget, the top of the bisection.
        fewest: the plan saving the fewest bytes within ``budget_bytes`` (``None``: none fits).

    Returns:
        The plan and ``lower(plan)``.
    """
    from memfit.data.errors import BudgetError

    try:
        plan_at(1)
        raise AssertionError("no plan fits a budget of one byte")
    except BudgetError as error:
        low = error.minimum_bytes
    smallest = plan_at(low)  # a strategy's smallest peak is the peak of a plan it built
    best = (smallest, lower(smallest))
    high = budget_bytes
    for _ in range(SAVES_BISECTION_STEPS):
        middle = (low + high) // 2
        try:
            made = plan_at(middle)
        except BudgetError:
            low = middle
            continue
        lowered = lower(made)
        if lowered[-1] <= cap_bytes:
            best, low = (made, lowered), middle
        else:
            high = middle
    if best[1][-1] <= cap_bytes or fewest is None:
        return best
    fallback = fewest()
    if fallback is None:
        return best
    lowered = lower(fallback)
    return (fallback, lowered) if lowered[-1] < best[1][-1] else best


class RecompileLimitWatch(logging.Handler):
    """Tells each live backend when Dynamo gives up compiling a code object (its recompile
    limit): that code then runs eagerly, outside any plan. Dynamo reports it only in a warning
    of its log, so this handler reads that log."""

    MESSAGE = "torch._dynamo hit config."

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.backends: weakref.WeakSet[Planner] = weakref.WeakSet()

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith(self.MESSAGE):
            return
        arguments = record.args if isinstance(record.args, tuple) else ()
        where = str(arguments[2]) if len(arguments) > 2 else "a compiled function"
        limit = arguments[1] if len(arguments) > 1 and isinstance(arguments[1], int) else None
        backend, code = _backend_being_compiled()
        if backend is not None and backend in self.backends:
            backend.recompile_limit_hit(where, code, limit)


def _backend_being_compiled() -> tuple[Any, Any]:
    """The backend of the frame Dynamo is converting now (its ``_compile``'s ``compiler_fn``,
    unwrapped), and the frame's code: the code Dynamo names is often a wrapper every compiled
    module shares, so the backend, not the code, tells whose region it is."""
    import sys

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals:
            code = frame.f_locals.get("code")
            found = frame.f_locals["compiler_fn"]
            for _ in range(8):  # WrapBackendDebug, _TorchCompileWrapper, ... around it
                inner = (getattr(found, "_torchdynamo_orig_backend", None)
                         or getattr(found, "compiler_fn", None))
                if inner is None:
                    break
                found = inner
            return found, code
        frame = frame.f_back  # type: ignore[assignment]
    return None, None


_WATCH = RecompileLimitWatch()


def watch_recompile_limit(backend: Planner) -> None:
    """Have ``backend.recompile_limit_hit(where)`` called when Dynamo stops compiling a code."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _WATCH not in logger.handlers:
        logger.addHandler(_WATCH)
    _WATCH.backends.add(backend)


def graph_break_counts() -> dict[str, int]:
    """Dynamo's count of each graph-break reason so far in this process."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def graph_breaks_since(before: dict[str, int], most: int = 3) -> list[str]:
    """The graph breaks Dynamo reported since ``before`` (``graph_break_counts``), at most
    ``most``, each as its reason's first line and the explanation Dynamo gave (which names a
    function it does not trace, such as ``checkpoint_sequential``)."""
    from torch._dynamo.utils import counters

    found = []
    for reason, count in counters["graph_break"].items():
        if count > before.get(reason, 0):
            lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
            why = [line.removeprefix("Explanation:").strip().rstrip(".") for line in lines[1:]
                   if line.startswith("Explanation:")]
            said = (lines[0].rstrip(".") if lines else "") + (f" ({why[0]})" if why else "")
            found.append(said[:300])
    return found[:most]
