"""``strategy="auto"``: keep, swap or recompute each tensor for the least step time that fits.

Why a portfolio with hybrids. Swapping costs only the transfer time the copy streams cannot
hide, and the link carries a fixed number of bytes while the forward pass computes (a PCIe
host link tens of GB/s against hundreds of TFLOP/s; a GH200's NVLink-C2C several times more):
swapping beyond that stalls the step. Recomputation costs its run time, cheapest per byte
first. So the fastest plan swaps what the link can carry and recomputes the rest, and where the
balance lies depends on the hardware profile, not on a rule of thumb.

The candidates, each simulated exactly by ``simulate`` (memory is program-order liveness):

1. ``keep``, if it fits;
2. recompute only: ``optimal-recompute``'s separator-block DP;
3. swap only: the TFLMS tuner (``swap``);
4. the vDNN policies, where registered, and vDNN with zero lookahead (``_just_in_time_swap``:
   every feature map swapped, each copy back right before its run of backward readers): the
   least memory a swap of the feature maps reaches, whatever a layer spans (one pass, one
   simulation);
5. the hybrid: the separator-block DP's recomputation at a budget relaxed by up to what the
   free swaps save, plus every swap the link carries with no stall (``_free_swaps.free_swaps``:
   both copy queues replayed on the compute timeline, copies back just in time) of a tensor
   the recomputation does not touch; the fastest that fits, by exact simulation.
6. per-block checkpoints (``block-checkpoints``): each numbered block of the model's stacks
   (``transformer.h.*``, ``model.layers.*``, ``layer1.*``) keeps its output, the rest is
   recomputed, as ``torch.utils.checkpoint`` around every block does (torchtitan's default);
   the DP prices recomputation per separator block and can miss this plan by a little, so it
   is priced as a candidate of its own;
7. swapped checkpoints (Capuchin's swap + recompute): the same DP, then every free swap given
   its re-runs, checkpoints included: a value that re-runs read leaves the device during the
   forward pass and comes back just before the first re-run that reads it (a ``SwapIn`` that
   feeds re-runs). What those swaps save relaxes the DP's budget, and the two steps repeat to
   a fixed point (``TUNING.auto_checkpoint_rounds`` at most: a DP call, a linear swap pass and
   one simulation each, once the DP's tables are built).
8. under inductor, fused chains (``fused_chains``): every memory-bound forward value re-run
   inside the backward's kernels, and library calls' values, cheapest per byte first, where
   re-running one lowers the peak, as ``torch.compile``'s partitioner plans under its
   activation memory budget.

A candidate fits when its simulated device peak fits the budget and what it holds on the host
at once fits ``hardware.host_bytes`` (``memfit.model.host_memory``); the swapping candidates
already stop before the host limit, so a tight one leaves the recompute-heavy candidates to win.

The fastest that fits wins; ``plan.params["solver"]`` names it and ``plan.params["candidates"]``
lists every candidate's simulated step time (``None``: did not fit), which is how ``explain``
shows what the others would have cost.

Where none fits, auto does not give up before every other registered strategy has tried with its
own defaults (``checkpoint``, ``memory-poor``, ...; last, ``optimal-recompute``'s MILP on graphs
small enough for it): auto fails only where each of them does, and its ``BudgetError`` reports
the smallest minimum among theirs, at which that strategy, and so auto, fits. The MILP is not in
the portfolio: bounded by work rather than a clock (so the plan never depends on the machine's
load), its root alone takes seconds to tens of seconds on a 50-op chain near its minimum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Decision, Plan, Recompute, Swap
from memfit.model.recompute import planned_reruns
from memfit.model.simulate import simulate
from memfit.planning.solvers import segments
from memfit.planning.strategies import get_strategy, register, strategy_names
from memfit.planning.strategies._budget_checks import fits, live_at_peak
from memfit.planning.strategies._strategy_config import StrategyConfig
from memfit.planning.strategies.recomputing import fused_chains
from memfit.planning.strategies.recomputing.optimal_recompute import MILP_MAX_OPS, priced_segments
from memfit.planning.strategies.swapping import _just_in_time_swap
from memfit.planning.strategies.swapping._free_swaps import free_swaps
from memfit.planning.tuning import TUNING

VDNN_POLICIES = ("vdnn_all", "vdnn_conv", "vdnn_dyn")
LAST_RESORT = "optimal-recompute"  # with its defaults: the MILP on small graphs, minutes at worst


@dataclass(frozen=True)
class AutoConfig(StrategyConfig):
    """auto takes no parameters: each candidate runs with its own defaults."""

    strategy: ClassVar[str] = "auto"

    @classmethod
    def unknown_parameters(cls, unknown: list[str]) -> ValueError:
        """Say where parameters go instead: to a strategy named explicitly."""
        return ValueError(f"strategy 'auto' got unknown parameters {unknown}; it takes none: "
                          "name a strategy (swap, checkpoint, ...) to set its parameters")


@register("auto", config=AutoConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
         **unknown) -> Plan:
    """The fastest simulated plan whose peak fits ``budget_bytes`` (Keep without a budget).

    Raises:
        BudgetError: if no candidate and no other registered strategy fits; its minimum is the
            smallest any of them reported, so auto fits at it.
    """
    AutoConfig.from_params(unknown)
    keep = Plan("auto", graph_hash=graph.structure_hash, hardware=hardware.name,
                budget_bytes=budget_bytes, params={"solver": "keep"})
    keep_timeline = simulate(graph, keep, hardware, record_intervals=False)
    if budget_bytes is None or keep_timeline.peak_bytes <= budget_bytes:
        return keep
    found: dict[str, tuple[float, Plan] | None] = {}
    refusals: list[BudgetError] = []

    def consider(name: str, make: Callable[[], Plan | None]) -> None:
        try:
            made = make()
        except BudgetError as error:
            refusals.append(error)
            found[name] = None
            return
        if made is None:
            found[name] = None
            return
        timeline = simulate(graph, made, hardware, record_intervals=False)
        fitting = fits(timeline, budget_bytes, hardware.host_bytes)
        found[name] = (timeline.step_time_s, made) if fitting else None

    def run(strategy: str, **params: Any) -> Callable[[], Plan]:
        return partial(get_strategy(strategy), graph, hardware, budget_bytes, **params)

    consider("recompute", run("optimal-recompute", method="segments"))
    consider("swap", run("swap"))
    for policy in VDNN_POLICIES:
        if policy in strategy_names():
            consider(policy, run(policy))
    consider(_just_in_time_swap.NAME,
             lambda: _just_in_time_swap.plan(graph, hardware, budget_bytes))
    consider("hybrid", lambda: _hybrid(graph, hardware, budget_bytes, keep_timeline.peak_bytes))
    stacks = block_stacks(graph)
    if stacks:
        consider("block-checkpoints",
                 run("checkpoint", checkpoints=[f"{stack}.*" for stack in stacks]))
    consider("swapped-checkpoints", lambda: _swapped_checkpoints(graph, hardware, budget_bytes))
    if graph.compiler in fused_chains.FusedChainsConfig.compilers:
        consider(fused_chains.NAME, run(fused_chains.NAME))
    for strategy in _others(graph):  # only where nothing fits: auto never gives up before them
        if not any(found.values()):
            consider(strategy, _none_where_inapplicable(run(strategy)))
    if not any(found.values()):
        raise _smallest_refusal(graph, keep, budget_bytes, refusals)
    name, (_, best) = min(((n, e) for n, e in found.items() if e is not None),
                          key=lambda item: item[1][0])
    candidates = {key: (entry[0] if entry else None) for key, entry in found.items()}
    return Plan("auto", best.decisions, graph_hash=graph.structure_hash,
                budget_bytes=budget_bytes, hardware=hardware.name, reruns=best.reruns,
                params={"solver": name, "from": best.strategy, "candidates": candidates,
                        **{f"{best.strategy}.{k}": v for k, v in best.params.items()
                           if k != "candidates"}})


def block_stacks(graph: CostGraph) -> list[str]:
    """The module paths of the model's stacks of numbered blocks: each outermost module path
    whose numbered children (``transformer.h.0``, ``transformer.h.1``, ...) hold forward ops,
    where there are at least two of them."""
    children: dict[str, set[str]] = {}
    for op in graph.forward_ops:
        parts = op.scope.split(".") if op.scope else []
        numbered = next((end for end in range(1, len(parts)) if parts[end].isdigit()), None)
        if numbered is not None:
            children.setdefault(".".join(parts[:numbered]), set()).add(parts[numbered])
    return sorted(stack for stack, blocks in children.items() if len(blocks) >= 2)


def _others(graph: CostGraph) -> list[str]:
    """The registered strategies the portfolio has not run with their defaults, cheapest first:
    the rest, then optimal-recompute's MILP where the graph is small enough for it (above, its
    default is the DP, which the portfolio ran)."""
    ran = {"auto", "keep", "swap", fused_chains.NAME, LAST_RESORT, *VDNN_POLICIES}
    others = [name for name in strategy_names(graph.compiler) if name not in ran]
    return others + ([LAST_RESORT] if len(graph.ops) <= MILP_MAX_OPS else [])


def _none_where_inapplicable(make: Callable[[], Plan]) -> Callable[[], Plan | None]:
    """``make``, giving ``None`` where its strategy, run with its defaults, does not apply to the
    graph (``checkpoint`` on a graph with no separators raises ``ValueError``): the user named
    auto, not that strategy, so its refusal is not theirs to act on."""

    def made() -> Plan | None:
        try:
            return make()
        except ValueError:  # not a BudgetError, which is no ValueError: consider records those
            return None

    return made


def _smallest_refusal(graph: CostGraph, keep: Plan, budget_bytes: int,
                      refusals: list[BudgetError]) -> BudgetError:
    """auto's error: the smallest minimum any strategy reported (each one fits at its own, so
    auto does too), its tensors, and what the others said (a solver that stopped early)."""
    peak, dominant = live_at_peak(graph, keep)
    smallest = min([BudgetError(budget_bytes, peak, dominant, "keep"), *refusals],
                   key=lambda error: error.minimum_bytes)
    notes = " ".join(dict.fromkeys(error.note for error in refusals if error.note))
    reaches = (f"Strategy {smallest.strategy} reaches that minimum."
               if smallest.strategy in strategy_names() else "")  # not auto's own candidates'
    return BudgetError(budget_bytes, smallest.minimum_bytes, smallest.dominant, strategy="auto",
                       note=f"{reaches} {notes}".strip(),
                       host_bytes=smallest.host_bytes)  # named where the host limit set it


def _hybrid(graph: CostGraph, hardware: Hardware, budget_bytes: int,
            keep_peak: int) -> Plan | None:
    """Recompute down to a relaxed budget, then let the free swaps close the gap.

    Every subset of ``free_swaps`` is free too (dropping a copy from a FIFO queue only makes
    the others land sooner), so the DP's plan at ``budget + x`` is combined with the free swaps
    of every tensor it does not touch, for a few ``x`` up to what all free swaps save at the
    unplanned peak; the fastest combination that fits, by exact simulation, wins.
    """
    swaps = free_swaps(graph, hardware, min_bytes=TUNING.auto_min_swap_bytes)
    if not swaps:
        return None
    only_swaps = Plan("free swaps", swaps, graph_hash=graph.structure_hash)
    freed = keep_peak - simulate(graph, only_swaps, hardware, record_intervals=False).peak_bytes
    best: tuple[float, Plan] | None = None
    tried: set[frozenset[tuple[str, bool]]] = set()  # neighbouring relaxations often agree
    for share in TUNING.auto_hybrid_shares:
        made = _recompute_then_swap(graph, hardware, budget_bytes, int(freed * share), swaps)
        if made is None:
            continue
        decided = frozenset((t, isinstance(d, Swap)) for t, d in made.decisions.items())
        if decided in tried:
            continue
        tried.add(decided)
        timeline = simulate(graph, made, hardware, record_intervals=False)
        if fits(timeline, budget_bytes, hardware.host_bytes) and (
                best is None or timeline.step_time_s < best[0]):
            best = (timeline.step_time_s, made)
    return best[1] if best else None


def _recompute_then_swap(graph: CostGraph, hardware: Hardware, budget_bytes: int,
                         relaxed_bytes: int, swaps: dict[str, Swap]) -> Plan | None:
    """The DP's recomputation fitting ``budget + relaxed_bytes``, plus the free swaps of the
    tensors it neither recomputes nor re-reads."""
    found = _dp_recomputation(graph, budget_bytes + relaxed_bytes)
    if found is None:
        return None
    recomputed, touched = found
    decisions: dict[str, Decision] = {t: s for t, s in swaps.items() if t not in touched}
    decisions.update({t: Recompute("cheaper than the link") for t in sorted(recomputed)})
    return Plan("hybrid", decisions, graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, params={"relaxed_bytes": relaxed_bytes})


def _dp_recomputation(graph: CostGraph, budget_bytes: int
                      ) -> tuple[frozenset[str], frozenset[str]] | None:
    """The separator-block DP's (recomputed, touched) tensors for ``budget_bytes``; ``None``:
    it cannot fit."""
    blocks, table = priced_segments(graph)
    chosen = segments.solve_segments(table, blocks.count, budget_bytes)
    if chosen is None:
        return None
    return (frozenset().union(*(s.recomputed for s in chosen)),
            frozenset().union(*(s.touched for s in chosen)))


def _swapped_checkpoints(graph: CostGraph, hardware: Hardware, budget_bytes: int) -> Plan | None:
    """Recompute, swap for free what the link carries (checkpoints fed to their re-runs), give
    the bytes saved back to the recomputation; the fastest round that fits.

    Each round's DP budget is the last one plus how far the last plan's peak fell under the
    budget (minus how far it rose over), so the recomputation shrinks while the swaps keep the
    peak in: the fixed point of "recompute to fit what the swaps leave". Rounds stop at a
    repeat (an oscillation between two neighbouring DP budgets) or after
    ``TUNING.auto_checkpoint_rounds``.
    """
    if not hardware.async_copies:
        return None  # no swap is free: this is the recompute candidate again
    best: tuple[float, Plan] | None = None
    relaxed_bytes, seen = 0, set()
    for _ in range(TUNING.auto_checkpoint_rounds):
        found = _dp_recomputation(graph, budget_bytes + relaxed_bytes)
        if found is None or found[0] in seen:
            break
        seen.add(found[0])
        made = _feed_checkpoints(graph, hardware, budget_bytes, found[0], relaxed_bytes)
        timeline = simulate(graph, made, hardware, record_intervals=False)
        if fits(timeline, budget_bytes, hardware.host_bytes) and (
                best is None or timeline.step_time_s < best[0]):
            best = (timeline.step_time_s, made)
        relaxed_bytes += budget_bytes - timeline.peak_bytes
    return best[1] if best else None


def _feed_checkpoints(graph: CostGraph, hardware: Hardware, budget_bytes: int,
                      recomputed: frozenset[str], relaxed_bytes: int) -> Plan:
    """``recomputed`` plus the free swaps of everything else, checkpoints fed to re-runs."""
    decisions: dict[str, Decision] = {t: Recompute("cheaper than the link") for t in sorted(recomputed)}
    reruns = planned_reruns(graph, Plan("recompute", decisions))
    decisions.update(free_swaps(graph, hardware, exclude=recomputed,
                                min_bytes=TUNING.auto_min_swap_bytes,
                                reruns=reruns, packed=True))
    return Plan("swapped-checkpoints", decisions, graph_hash=graph.structure_hash,
                budget_bytes=budget_bytes, hardware=hardware.name,
                params={"relaxed_bytes": relaxed_bytes})
