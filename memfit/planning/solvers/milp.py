"""The reference optimum for recomputation on a general graph: Checkmate's MILP, solved by HiGHS.

What it optimises (Jain et al. 2020, "Checkmate", with Checkmate's linearised frees): the ops of
a ``CostGraph`` in execution order are stages t = 0..T-1. Stage t runs op t (``R[t, t] = 1``)
and, before it in op order, may *recompute* earlier forward ops (``R[t, i]``, i < t); ``S[t, i]``
says op i's outputs are kept in memory entering stage t. Backward and update ops run exactly once,
in their own stage, and so do ops whose outputs the step returns (the loss): only forward ops with
no returned output are recomputable. An op may run in a stage only if every op it reads from
(``depends_on`` and the producers of its input storages) is kept or recomputed earlier in the stage;
outputs are kept into stage t + 1 only if kept or computed in stage t. Objective: the least total
time of recomputations, sum over i < t of ``R[t, i] * time_s[i]``; the step's own ops are free.

Memory, in program order exactly as ``memfit.model.schedule`` counts it: resident storages (graph
inputs, parameters), returned storages from their producer on, and each op's other output storages
while live. Within stage t, ``U[t, k]`` is the memory after op k runs (its outputs allocated,
nothing freed yet) and must stay within the budget; after op k, the storages of k and of the ops
it reads are freed when no later op of the stage reads them and they are not kept into t + 1
(``FREE[t, i, k]``, only upper-bounded: leaving a dead storage unfreed only costs memory, so the
solver frees wherever that helps, and ``peak_bytes`` is replayed with every free made). A storage
kept into a stage counts from the stage's start until a reader in the stage frees it. The unit is
the op, not the storage: an op's non-returned outputs live and die together, which over-counts
when they die apart (a backward op's gradients for two different inputs); on chains each op has
one such output, so nothing is lost there.

On a chain this is exactly the accounting of ``memfit.planning.solvers.chain`` (``chain_graph`` and
``chain_costs_from_graph`` convert): the MILP equals an exhaustive search over *all* chain
schedules, and the chain DP wherever the best schedule is persistent (tested). It is lower than the
DP where dropping a kept checkpoint early and recomputing it pays off.

Example:
    >>> from memfit.model import synthetic
    >>> graph = synthetic.chain(4, size_bytes=100, weight_bytes=4, input_bytes=100)
    >>> solution = solve_milp(graph, budget_bytes=550)  # keeping everything peaks at 624
    >>> solution.status, round(solution.recompute_time_s, 6), solution.peak_bytes
    ('optimal', 0.001, 524)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from memfit.data.costgraph import CostGraph
from memfit.planning.solvers._milp_model import MilpModel, MilpStatus, StageProblem
from memfit.planning.tuning import TUNING

__all__ = ["NODE_LIMIT", "MilpSolution", "MilpStatus", "solve_milp"]

NODE_LIMIT = TUNING.milp_node_limit  # the default node_limit (why 200: memfit.planning.tuning)


@dataclass(frozen=True)
class MilpSolution:
    """What HiGHS found.

    Args:
        recompute_time_s: total time of recomputed ops (inf when no schedule was found).
        peak_bytes: the schedule's peak, replayed exactly (resident bytes included); -1 if none.
        status: ``"optimal"``; ``"feasible"`` (a schedule, not proven optimal within the node
            limit); ``"infeasible"`` (no schedule fits the budget); ``"node_limit"`` (none found
            within the node limit: the budget may still fit); ``"error"`` (HiGHS failed
            otherwise).
        solve_time_s: wall time of building and solving the model (reported, never deciding).
        computed: per stage, the ops it runs (recomputations first, in op order; then the stage op).
        kept: per stage, the ops whose outputs are kept in memory entering it.
    """

    recompute_time_s: float
    peak_bytes: int
    status: MilpStatus
    solve_time_s: float
    computed: tuple[tuple[str, ...], ...] = ()
    kept: tuple[tuple[str, ...], ...] = ()

    @property
    def found(self) -> bool:
        """Whether a schedule came back (optimal or merely feasible)."""
        return self.status in ("optimal", "feasible")


def solve_milp(graph: CostGraph, budget_bytes: int, *, node_limit: int = NODE_LIMIT,
               mip_rel_gap: float = 1e-6) -> MilpSolution:
    """The recompute schedule of least recompute time whose peak fits ``budget_bytes``.

    Args:
        graph: the step; tens to a few hundred ops (the model has O(T²) binaries and O(T² d)
            continuous variables for T ops of d inputs).
        budget_bytes: total device bytes, resident storages included (``CostGraph.resident_bytes``).
        node_limit: HiGHS's branch-and-bound nodes (default ``NODE_LIMIT``); past it the best
            schedule found so far comes back as ``"feasible"``, or none as ``"node_limit"``. A
            work limit, not a clock: the answer is the same on a busy machine and an idle one.
        mip_rel_gap: HiGHS's relative optimality gap (default 1e-6: exact on small graphs).

    An infeasible budget is not an error: the solution says ``"infeasible"``.
    """
    started = time.perf_counter()
    problem = StageProblem.from_graph(graph)
    model = MilpModel.build(problem, budget_bytes)
    x, status = model.solve(node_limit, mip_rel_gap)
    elapsed = time.perf_counter() - started
    if x is None:
        return MilpSolution(float("inf"), -1, status, elapsed)
    computed, kept = model.decode(x)
    recompute_time_s, peak_bytes = problem.replay(computed, kept)
    names = [op.name for op in graph.ops]
    return MilpSolution(
        recompute_time_s=recompute_time_s,
        peak_bytes=peak_bytes,
        status=status,
        solve_time_s=elapsed,
        computed=tuple(tuple(names[i] for i in stage) for stage in computed),
        kept=tuple(tuple(names[i] for i in stage) for stage in kept),
    )
