"""The least recomputation that fits a budget: an exact MILP on small graphs, a DP over separator
blocks on whole models.

Two solvers, picked by size (``method="auto"``):

- ``"milp"``: Checkmate's MILP (``memfit.planning.solvers.milp``) on HiGHS decides, before every op, which
  forward ops to run again; each decision becomes a ``Rerun(op, before)``, so a value may be
  rebuilt many times, as the optimum often wants. It has one binary per (stage, op) pair, so it
  is for graphs of up to ``max_ops`` ops (100 by default: seconds to minutes here), and HiGHS
  stops after ``node_limit`` branch-and-bound nodes, a work limit, never a clock, so the plan is
  the same on a busy machine and an idle one. Where it finds no schedule (infeasible in its
  per-op accounting, or stopped at the node limit) the DP below plans instead: a MILP that
  stopped early never makes the strategy say "does not fit".
- ``"segments"``: the chain of separator blocks (``memfit.planning.solvers.segments``): each segment of
  blocks is kept, rebuilt whole from the separator before it, or rebuilt but for its matmul /
  conv / attention outputs; the DP picks the split with the least recompute time whose exact
  profile fits. Captured transformers, ResNets and U-Nets (a thousand ops) plan in a second or
  a few.

Below the DP's reach, when the peak sits in the forward pass (branchy graphs), forward values
are freed and re-run too (``recompute_in_forward``); otherwise separators are rebuilt from
separators, revolve over the blocks (``memfit.planning.solvers.block_chain``: a fraction of a
step's time where memory-poor re-runs the forward pass many times); memory-poor is the last
resort.

The answer is never slower than the article's two fixed modes at the same budget: the
``checkpoint`` strategy's ``"memory"`` and ``"speed"`` plans are priced too, and one of them is
returned when it recomputes less (the DP's segments keep the separators they end on, where
``"speed"`` may recompute a cheap separator, so at ``"speed"``'s own peak it can lose by a few
bytes). ``plan.params["solver"]`` says which plan won.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Recompute, Rerun
from memfit.data.timeline import Timeline
from memfit.model.profile import BaseProfile
from memfit.model.schedule import PlanError
from memfit.model.simulate import simulate
from memfit.planning.solvers import segments
from memfit.planning.solvers.block_chain import (
    BlockChain,
    NestedSchedule,
    nested_schedule,
    next_chain_budget,
)
from memfit.planning.solvers.milp import NODE_LIMIT, solve_milp
from memfit.planning.solvers.segments import Blocks
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import live_at_peak
from memfit.planning.strategies._strategy_config import StrategyConfig, positive_int
from memfit.planning.strategies.recomputing._forward_recompute import recompute_in_forward
from memfit.planning.tighten import tighten
from memfit.planning.tuning import TUNING

METHODS = ("auto", "milp", "segments")
MILP_MAX_OPS = TUNING.milp_max_ops  # the default max_ops (auto and the benchmarks read it)
POOR_MAX_FORWARD_OPS = TUNING.memory_poor_max_forward_ops  # read here, so a test may lower it
_TABLES: dict[tuple, tuple[segments.Blocks, list[segments.Segment]]] = {}  # small cache


@dataclass(frozen=True)
class OptimalRecomputeConfig(StrategyConfig):
    """optimal-recompute's parameters (see ``plan``), checked when built."""

    strategy: ClassVar[str] = "optimal-recompute"
    method: str = "auto"  # "milp", "segments", or "auto": the MILP up to max_ops ops
    max_ops: int = MILP_MAX_OPS  # the largest graph handed to the MILP
    node_limit: int = NODE_LIMIT  # HiGHS's branch-and-bound nodes: a work limit, not a clock

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        positive_int("max_ops", self.max_ops)
        positive_int("node_limit", self.node_limit, " (branch-and-bound nodes)")

    @classmethod
    def unknown_parameters(cls, unknown: list[str]) -> ValueError:
        """``time_limit_s`` was a parameter once: say what replaced it."""
        if "time_limit_s" in unknown:
            return ValueError(
                "optimal-recompute no longer takes time_limit_s: a clock made the plan depend on "
                "the machine's load. Bound the MILP's work with node_limit= (branch-and-bound "
                f"nodes, default {NODE_LIMIT}) and its size with max_ops=, or use "
                "method='segments'")
        return super().unknown_parameters(unknown)


@register("optimal-recompute", config=OptimalRecomputeConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, *,
         method: str = "auto", max_ops: int = MILP_MAX_OPS, node_limit: int = NODE_LIMIT,
         **unknown) -> Plan:
    """The recomputation schedule with the least recompute time whose peak fits ``budget_bytes``.

    Args:
        method: ``"milp"`` (exact, small graphs), ``"segments"`` (the separator-block DP) or
            ``"auto"``: the MILP up to ``max_ops`` ops, the DP above.
        max_ops: the largest graph handed to the MILP (default 100 ops: seconds to minutes here).
        node_limit: HiGHS's branch-and-bound nodes (default ``milp.NODE_LIMIT``); a schedule
            found but not proven optimal is still used, and none found hands over to the DP.

    Raises:
        ValueError: for bad parameters, no budget, or ``method="milp"`` on a graph larger than
            ``max_ops``.
        BudgetError: if no recomputation schedule fits the budget; planning again at its
            ``minimum_bytes`` fits.
    """
    OptimalRecomputeConfig.from_params({"method": method, "max_ops": max_ops,
                                       "node_limit": node_limit, **unknown})
    if budget_bytes is None:
        raise ValueError("optimal-recompute needs a budget: memfit.compile(..., budget='0.5')")
    params = {"method": method, "max_ops": max_ops, "node_limit": node_limit}
    if method == "milp" or (method == "auto" and len(graph.ops) <= max_ops):
        if len(graph.ops) > max_ops:
            raise ValueError(
                f"this graph has {len(graph.ops)} ops, more than the MILP's max_ops={max_ops}; "
                "raise max_ops (the solve grows fast) or use method='segments'")
        made = _milp_plan(graph, hardware, budget_bytes, params, node_limit)
        if isinstance(made, Plan):
            return made
        try:
            return _segment_plan(graph, hardware, budget_bytes, {**params, "milp_status": made})
        except BudgetError as error:
            if made in ("infeasible", "over"):
                raise
            raise BudgetError(error.budget_bytes, error.minimum_bytes, error.dominant,
                              error.strategy, note=_stopped_early(made, node_limit)) from None
    return _segment_plan(graph, hardware, budget_bytes, params)


def _stopped_early(status: str, node_limit: int) -> str:
    """What to tell a user whose MILP gave no schedule without proving there is none."""
    how = (f"stopped at its node limit ({node_limit} nodes)" if status == "node_limit"
           else f"failed ({status})")
    return (f"The MILP {how} without a schedule, so the separator-block DP planned instead: a "
            "larger node_limit= may fit lower.")


def _milp_plan(graph: CostGraph, hardware: Hardware, budget_bytes: int, params: dict,
               node_limit: int) -> Plan | str:
    """The MILP's plan if it found one that fits, else why not (its status, or ``"over"``)."""
    solution = solve_milp(graph, budget_bytes, node_limit=node_limit)
    if not solution.found:
        return solution.status
    reruns = tuple(
        Rerun(op, stage[-1]) for stage in solution.computed for op in stage[:-1]
        if graph.op(op).outputs  # views allocate nothing; the rewriter replays them anyway
    )
    made = Plan("optimal-recompute", graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, reruns=reruns,
                params={**params, "solver": "milp", "milp_status": solution.status})
    predicted = simulate(graph, made, hardware, record_intervals=False).peak_bytes
    if predicted > budget_bytes:  # the MILP's accounting is an upper bound; this is a safeguard
        return "over"
    return made


def _segment_plan(graph: CostGraph, hardware: Hardware, budget_bytes: int, params: dict) -> Plan:
    """The DP's plan, or the checkpoint modes' if one recomputes less; memory-poor's as the last
    resort below the DP's reach."""
    model = BaseProfile.of(graph)
    found: list[tuple[float, str, frozenset[str]]] = []
    recomputed = _segment_recomputed(graph, model, budget_bytes)
    if recomputed is not None:
        found.append((model.recomputes(recomputed).recompute_s, "segments", recomputed))
    for mode in ("speed", "memory"):
        chosen = _checkpoint_recomputed(graph, hardware, budget_bytes, mode)
        if chosen is None:
            continue
        priced = model.folded(model.recomputes(chosen))
        if priced.peak_bytes <= budget_bytes:
            found.append((priced.recompute_s, f"checkpoint {mode}", chosen))
    if not found:
        return _below_the_segments(graph, hardware, model, budget_bytes, params)
    time_s, solver, chosen = min(found, key=lambda item: (item[0], item[1] != "segments"))
    made = Plan("optimal-recompute", {t: Recompute("optimal segment") for t in sorted(chosen)},
                graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, params={**params, "solver": solver})
    peak = simulate(graph, made, hardware, record_intervals=False).peak_bytes
    if peak > budget_bytes:  # the memory model is exact; this guards against drift
        raise BudgetError(budget_bytes, peak, strategy="optimal-recompute")
    return made


def _below_the_segments(graph: CostGraph, hardware: Hardware, model: BaseProfile,
                        budget_bytes: int, params: dict) -> Plan:
    """Below the DP's smallest peak: re-runs in the forward pass, else revolve over the blocks,
    else memory-poor's plan, the first that fits (memory-poor's before revolve's if it fits and
    recomputes less).

    Memory-poor's plan re-runs O(n^2) ops, so it is simulated once and priced for both uses, and
    only on graphs of at most ``POOR_MAX_FORWARD_OPS`` forward ops: beyond, its step would take
    a thousand forward passes or more, and lowering it alone takes seconds and gigabytes.
    """
    forward = _with_forward_reruns(graph, hardware, model, budget_bytes, params)
    if forward is not None:
        return forward
    poor = _memory_poor(graph) if len(graph.forward_ops) <= POOR_MAX_FORWARD_OPS else None
    poor_timeline = None if poor is None else simulate(graph, poor, hardware,
                                                       record_intervals=False)
    nested = _nested_fit(graph, hardware, budget_bytes, params, poor_timeline)
    if nested is not None:
        return nested
    if poor is None or poor_timeline is None:
        raise _refusal(graph, model, budget_bytes, None)
    return _memory_poor_fit(graph, hardware, model, budget_bytes, params, poor, poor_timeline)


def _with_forward_reruns(graph: CostGraph, hardware: Hardware, model: BaseProfile,
                         budget_bytes: int, params: dict) -> Plan | None:
    """The DP's smallest plan plus re-runs in the forward pass, if that fits: for branchy graphs
    whose peak is in the forward pass, which no backward recomputation lowers."""
    smallest = _least_fitting(graph, model, budget_bytes)
    recomputed = _segment_recomputed(graph, model, smallest)
    if recomputed is None:
        return None
    base = Plan("optimal-recompute", {t: Recompute("optimal segment") for t in sorted(recomputed)},
                graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, params={**params, "solver": "segments + forward"})
    try:
        made = recompute_in_forward(graph, base, hardware, budget_bytes)
    except PlanError:
        return None
    fits = simulate(graph, made, hardware, record_intervals=False).peak_bytes <= budget_bytes
    return made if fits else None


def _nested_fit(graph: CostGraph, hardware: Hardware, budget_bytes: int, params: dict,
                poor: Timeline | None) -> Plan | None:
    """Revolve over the separator blocks (``block_chain``), when memory-poor's plan (whose
    ``poor`` timeline is given) is not faster: below the segment DP's reach, separators rebuilt
    from separators cost a few forward passes where memory-poor's rebuilding from the inputs
    costs n of them."""
    blocks, _ = priced_segments(graph)
    made = nested_reruns(graph, hardware, blocks, budget_bytes)
    if made is None:
        return None
    nested_s = simulate(graph, made, hardware, record_intervals=False).recompute_s
    if poor is not None and poor.peak_bytes <= budget_bytes and poor.recompute_s < nested_s:
        return None
    return replace(made, params={**params, "solver": "nested blocks"})


def nested_reruns(graph: CostGraph, hardware: Hardware, blocks: Blocks,
                  budget_bytes: int) -> Plan | None:
    """The revolve-like plan of least recompute over ``blocks`` (``block_chain``) whose simulated
    peak fits ``budget_bytes``, as explicit re-runs; ``None`` when the chain DP finds none that
    fits.

    The chain DP's accounting is not the step's exact peak, so each of its schedules is simulated
    and the chain's budget cut by the excess (``block_chain.next_chain_budget``).

    Args:
        graph: the step.
        hardware: prices the plan (``simulate``).
        blocks: the forward pass cut at separators (``segments.find_blocks``); needs at least
            two blocks (one chain step and the loss).
        budget_bytes: the whole step's device budget.
    """
    if blocks.count < 2:
        return None
    chain = BlockChain.from_blocks(graph, blocks)

    def planned_at(chain_budget_bytes: int) -> tuple[tuple[Plan, NestedSchedule], int] | None:
        schedule = nested_schedule(chain, chain_budget_bytes)
        if schedule is None:
            return None
        made = Plan("optimal-recompute", graph_hash=graph.structure_hash,
                    budget_bytes=budget_bytes, hardware=hardware.name,
                    reruns=tuple(Rerun(op, before) for op, before in schedule.reruns))
        return (made, schedule), simulate(graph, made, hardware, record_intervals=False).peak_bytes

    def next_target(chain_budget_bytes: int, excess_bytes: int,
                    planned: tuple[Plan, NestedSchedule],
                    previous: tuple[Plan, NestedSchedule] | None) -> int:
        return next_chain_budget(chain_budget_bytes, excess_bytes, planned[1],
                                 None if previous is None else previous[1])

    found = tighten(budget_bytes, planned_at, rounds=TUNING.chain_tighten_rounds,
                    next_target=next_target, start_bytes=chain.chain_budget_bytes(budget_bytes))
    return None if found is None else found[0]


def _memory_poor_fit(graph: CostGraph, hardware: Hardware, model: BaseProfile,
                     budget_bytes: int, params: dict, poor: Plan, poor_timeline: Timeline) -> Plan:
    """Memory-poor's plan (rebuild everything before each backward op) if it fits: below the
    DP's smallest peak it is the only recomputation plan we have, at O(n^2) recompute."""
    if poor_timeline.peak_bytes > budget_bytes:
        raise _refusal(graph, model, budget_bytes, (poor, poor_timeline.peak_bytes))
    return Plan("optimal-recompute", graph_hash=graph.structure_hash, budget_bytes=budget_bytes,
                hardware=hardware.name, reruns=poor.reruns,
                params={**params, "solver": "memory-poor"})


def _refusal(graph: CostGraph, model: BaseProfile, budget_bytes: int,
             poor: tuple[Plan, int] | None) -> BudgetError:
    """The error below every plan: the lower of memory-poor's peak and the DP's least fitting
    budget (each one this strategy plans and fits at), with the tensors live at that peak."""
    least = _least_fitting(graph, model, budget_bytes)
    if poor is not None and poor[1] <= least:
        at_peak, smallest = poor
    else:
        recomputed = _segment_recomputed(graph, model, least) or frozenset()
        smallest, at_peak = least, Plan("optimal-recompute",
                                        {t: Recompute("optimal segment") for t in sorted(recomputed)})
    return BudgetError(budget_bytes, smallest, live_at_peak(graph, at_peak)[1],
                       strategy="optimal-recompute")


def _segment_recomputed(graph: CostGraph, model: BaseProfile,
                        budget_bytes: int) -> frozenset[str] | None:
    """The DP's recomputed tensors, re-solved with a tighter budget while the assembled plan's
    exact peak is over (the decomposition is exact on the graphs we know; this is the net)."""
    blocks, table = priced_segments(graph)

    def recomputed_at(target_bytes: int) -> tuple[frozenset[str], int] | None:
        chosen = segments.solve_segments(table, blocks.count, target_bytes)
        if chosen is None:
            return None
        recomputed = frozenset().union(*(s.recomputed for s in chosen))
        return recomputed, model.folded(model.recomputes(recomputed)).peak_bytes

    return tighten(budget_bytes, recomputed_at, rounds=TUNING.segment_tighten_rounds)


def _least_fitting(graph: CostGraph, model: BaseProfile, budget_bytes: int) -> int:
    """The smallest budget the DP fits (by bisection: feasibility grows with the budget)."""
    low, high = budget_bytes, int(model.high_bytes.max(initial=0))
    if _segment_recomputed(graph, model, high) is None:
        return high
    while high - low > max(1, high // 1000):
        middle = (low + high) // 2
        if _segment_recomputed(graph, model, middle) is None:
            low = middle
        else:
            high = middle
    return high


def priced_segments(graph: CostGraph) -> tuple[segments.Blocks, list[segments.Segment]]:
    """The priced segments of ``graph``: they do not depend on the budget, so a budget sweep
    prices them once."""
    key = (graph.structure_hash, tuple(op.time_s for op in graph.ops))
    cached = _TABLES.get(key)  # one read: another thread may clear the cache at any moment
    if cached is None:
        from memfit.planning.strategies.recomputing.checkpoint import _speed_checkpoints

        blocks = segments.find_blocks(graph, max_blocks=TUNING.segment_max_blocks)
        cached = (blocks, segments.segment_table(graph, blocks, _speed_checkpoints(graph, 4)))
        _TABLES.clear()
        _TABLES[key] = cached
    return cached


def _checkpoint_recomputed(graph: CostGraph, hardware: Hardware, budget_bytes: int,
                           mode: str) -> frozenset[str] | None:
    from memfit.planning.strategies.recomputing.checkpoint import plan as checkpoint

    try:
        made = checkpoint(graph, hardware, budget_bytes, checkpoints=mode)
    except (BudgetError, ValueError):
        return None
    return frozenset(t for t, d in made.decisions.items() if isinstance(d, Recompute))


def _memory_poor(graph: CostGraph) -> Plan:
    from memfit.planning.strategies.recomputing.memory_poor import plan as memory_poor

    return memory_poor(graph, Hardware("none", {"float32": 1.0}, 1.0, 1.0, 1.0))
