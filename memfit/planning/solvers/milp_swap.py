"""The reference optimum for swapping *and* recomputing: POET's MILP on Checkmate's stages, by HiGHS.

The model (Patil et al. 2022, "POET"), on ``memfit.planning.solvers.milp``'s Checkmate model: stage t runs
op t, after re-running earlier forward ops (``R[t, i]``); ``S[t, i]`` keeps op i's outputs on the
device entering stage t. Swapping adds, in memfit's plan language:

- ``O[i]``: swap op i's outputs out, right after op i (memfit's one fused swap-out per tensor; the
  host copy then lives to the end of the step, POET's host-resident variable fixed to 1);
- ``I[t, i]``: swap them in right after op t - 1 (a ``SwapIn(after=op t - 1)``): counted in
  memory from there for all of stage t, resident from stage t + 1 (POET's page-in);
- ``J[t, i]``: the same swap-in read by op t itself: op t waits for it (what memfit's ``lb=1``
  swap-ins do, and what POET's page-in, usable only from the next stage, cannot express);
- ``W[t]``: the stall of stage t. Stage t lasts its re-runs + ``W[t]`` + op t; the swap-out of op
  t - 1 and the swap-ins issued after op t - 1 must end within it (each link on its own with
  ``duplex``, one shared link without), and the ``J`` swap-ins before op t.

Objective: the step time, sum of op times + re-run times + stalls. Memory is Checkmate's
program-order accounting (``memfit.model.schedule``), with each swap-in's buffer counted from its
issue, as ``memory_profile`` does. A swapped value's producer is never re-run, and no re-run reads
a swapped value (a restriction of this model, not of memfit's plans; see ``MISMATCHES``).

The solution is decoded into a schedule in the terms of memfit's plans: ``(op, before)`` re-runs
as ``optimal-recompute``'s MILP plan makes them, and per swapped tensor the swap-ins that serve
its readers (``SwappedTensor``), in the order they queue. The ``Plan`` is built from it, and
simulated, by ``memfit.planning.strategies.milp_swap_plan``.

Example:
    >>> from memfit.model import synthetic
    >>> from memfit.data.hardware import get_hardware
    >>> from memfit.data.plan import Plan
    >>> from memfit.model.schedule import peak_bytes
    >>> graph = synthetic.chain(6)
    >>> budget_bytes = int(0.7 * peak_bytes(graph, Plan("keep")))
    >>> solution = solve_swap_milp(graph, get_hardware("h100-pcie"), budget_bytes)
    >>> solution.status, solution.swapped != (), solution.reruns
    ('optimal', True, ())
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.planning.solvers._milp_model import StageProblem
from memfit.planning.solvers._milp_swap_model import SwapFacts, SwapMilpModel
from memfit.planning.solvers.milp import NODE_LIMIT, MilpStatus

MISMATCHES = """\
Where the MILP and memfit's simulator differ (the MILP is never the optimistic one):
- an early swap-in (I) must land before the op after the one it is issued for, not before its
  first reader; prefetching further ahead than one op earns nothing in the MILP.
- swap-ins issued after one op queue in the plan's decision order; the decoder puts the tensors
  an op waits for first, which is exact unless one tensor has both kinds after the same op.
- the swap-out-before-swap-in rule (duplex) is a sufficient condition on the d2h backlog.
- memory is per op, not per storage: an op's non-returned outputs live and die together (as in
  ``milp``); per storage, the decoded plan frees a copy after its last reader, never later.
- swapped values are never recomputed and never read by a re-run. memfit's plans allow the latter
  (a ``SwapIn`` naming a forward reader at or before its control op feeds that op's re-runs, and
  ``auto``'s swapped-checkpoints candidate uses it), but this model has no rows pricing such a
  swap-in yet: its optimum is the best plan without them, which ``auto`` may beat.
On every graph tested the simulated step time equals the MILP's objective.
"""


@dataclass(frozen=True)
class SwappedTensor:
    """One tensor the MILP swaps out after its producer, and the copies that bring it back.

    Args:
        tensor: the swapped tensor.
        swap_ins: per copy, ``(after, readers)``: issued right after op ``after``, read by
            ``readers`` (``SwapIn``'s fields), in the order of issue.
        waited: whether an op waits for one of its copies (the MILP's ``J``): such tensors
            queue first among the swap-ins issued after one op.
    """

    tensor: str
    swap_ins: tuple[tuple[str, tuple[str, ...]], ...]
    waited: bool


@dataclass(frozen=True)
class SwapMilpSolution:
    """What HiGHS found, as a schedule.

    Args:
        status: as ``MilpSolution.status``.
        step_time_s: the MILP's objective: op times + re-runs + stalls (inf when none found).
        recompute_time_s: time of the re-runs.
        stall_s: the stalls the MILP pays for copies that outlast their stage.
        solve_time_s: wall time of building and solving the model.
        reruns: ``(op, before)`` pairs: forward op ``op`` runs again right before op ``before``
            (views left out: they allocate nothing); empty when none was found.
        swapped: the swapped tensors in the order their swap-ins queue (those an op waits for
            first, then by name); empty when none was found.
    """

    status: MilpStatus
    step_time_s: float
    recompute_time_s: float
    stall_s: float
    solve_time_s: float
    reruns: tuple[tuple[str, str], ...] = ()
    swapped: tuple[SwappedTensor, ...] = ()

    @property
    def found(self) -> bool:
        return self.status in ("optimal", "feasible")


def solve_swap_milp(graph: CostGraph, hardware: Hardware, budget_bytes: int, *,
                    node_limit: int = NODE_LIMIT, mip_rel_gap: float = 1e-4) -> SwapMilpSolution:
    """The swap + recompute schedule of least step time whose peak fits ``budget_bytes``.

    Args:
        graph: the step; tens of ops (the model has O(T²) binaries, like ``solve_milp``'s, plus
            O(T²) swap-ins over the forward ops).
        hardware: link bandwidths and latency, ``duplex`` and ``async_copies`` set the copy rows;
            ``host_bytes`` bounds the bytes swapped out (a copy is held to the step's end here).
        budget_bytes: total device bytes, resident storages included.
        node_limit: HiGHS's branch-and-bound nodes (default ``milp.NODE_LIMIT``); past it the
            best schedule so far comes back as ``"feasible"``, or none as ``"node_limit"``.
        mip_rel_gap: HiGHS's relative gap (default 1e-4: a tenth of a permille of the step).

    An infeasible budget is not an error: the solution says ``"infeasible"``.
    """
    started = time.perf_counter()
    problem = StageProblem.from_graph(graph)
    facts = SwapFacts.from_graph(graph, hardware, problem)
    model = SwapMilpModel.build_swap(problem, facts, hardware, budget_bytes)
    x, status = model.solve(node_limit, mip_rel_gap)
    elapsed = time.perf_counter() - started
    if x is None:
        inf = float("inf")
        return SwapMilpSolution(status, inf, inf, inf, elapsed)
    computed, _ = model.decode(x)
    recompute_time_s = sum(problem.time_s[op] for stage, ops in enumerate(computed)
                           for op in ops if op != stage)
    stall_s = sum(model.value(x, ("W", t)) for t in range(problem.stages)) * model.time_unit_s
    names = [op.name for op in graph.ops]
    reruns = tuple((names[op], names[stage]) for stage, ops in enumerate(computed)
                   for op in ops if op != stage and graph.ops[op].outputs)
    return SwapMilpSolution(
        status=status, step_time_s=graph.step_time_s + recompute_time_s + stall_s,
        recompute_time_s=recompute_time_s, stall_s=stall_s, solve_time_s=elapsed,
        reruns=reruns, swapped=decode_swaps(graph, model, x),
    )


def decode_swaps(graph: CostGraph, model: SwapMilpModel,
                 x: np.ndarray) -> tuple[SwappedTensor, ...]:
    """Per swapped tensor that some reader reads, one swap-in for each copy read; in the order
    the swap-ins issued after one control op queue: those an op waits for first."""
    names = [op.name for op in graph.ops]
    swapped: list[SwappedTensor] = []
    for (_, op) in model.chosen(x, "O"):
        copies = _copies(model, x, op)
        for tensor in graph.ops[op].outputs:
            if graph.tensors[tensor].is_output:
                continue
            served: dict[int, list[str]] = {}  # copy issued at stage -> its readers
            for reader in graph.tensors[tensor].consumers:
                stage = graph.index[reader]
                if stage not in copies:
                    raise ValueError(f"{reader} reads {tensor}, which the MILP has off the device")
                if copies[stage] >= 0:
                    served.setdefault(copies[stage], []).append(reader)
            if served:
                waited = any(model.value(x, ("J", stage, op)) > 0.5 for stage in served)
                swap_ins = tuple((names[stage - 1], tuple(readers))
                                 for stage, readers in sorted(served.items()))
                swapped.append(SwappedTensor(tensor, swap_ins, waited))
    return tuple(sorted(swapped, key=lambda swap: (not swap.waited, swap.tensor)))


def _copies(model: SwapMilpModel, x: np.ndarray, op: int) -> dict[int, int]:
    """Stage -> the stage whose swap-in op ``op``'s outputs are read from there (-1: the original
    buffer), for the stages where they are on the device."""
    on: dict[int, int] = {}
    current: int | None = -1  # -1: the original, still on the device after its producer
    for stage in range(op + 1, model.problem.stages):
        kept = model.value(x, ("S", stage, op)) > 0.5
        if model.value(x, ("J", stage, op)) > 0.5:
            on[stage] = stage
        elif kept and current is not None:
            on[stage] = current
        if model.value(x, ("S", stage + 1, op)) > 0.5:
            if model.value(x, ("I", stage, op)) > 0.5:
                current = stage
            else:
                current = on.get(stage)
        else:
            current = None
    return on
