"""The swap columns and rows of the swap + recompute MILP (see ``memfit.planning.solvers.milp_swap``).

``SwapFacts`` adds to a ``StageProblem`` what swapping needs (per op: whether its outputs may be
swapped, its copy times each way, which ops read it through a storage); ``SwapMilpModel`` is the
Checkmate model of ``_milp_model`` plus, in POET's terms:

- ``O[i]``: op i's outputs are copied to the host right after op i (memfit's one fused swap-out);
- ``I[t, i]``: a copy of them is brought back at the start of stage t (right after op t - 1),
  counted in memory for the whole stage and resident from stage t + 1 (POET's page-in);
- ``J[t, i]``: one brought back at the start of stage t for op t itself, which waits for it;
- ``W[t]``: the stall of stage t, in time units, paid by the objective;
- ``B[link, t]``: the backlog of a copy link entering stage t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.planning.solvers._milp_model import Key, MilpModel, StageProblem
from memfit.planning.tuning import TUNING


@dataclass(frozen=True)
class SwapFacts:
    """Per op, in execution order: what swapping it costs and who may read its copies.

    Args:
        swappable: forward ops whose outputs the step does not return and an op two or more
            stages later reads (a copy issued any earlier could not land before its reader).
        d2h_s: time of the swap-out copies of its non-returned outputs (latency included).
        h2d_s: time of bringing them back.
        storage_readers: ops that read one of its output storages (``Tensor.consumers``).
        storage_sources: per op, the ops whose output storages it reads.
    """

    swappable: tuple[bool, ...]
    d2h_s: tuple[float, ...]
    h2d_s: tuple[float, ...]
    storage_readers: tuple[tuple[int, ...], ...]
    storage_sources: tuple[tuple[int, ...], ...]

    @staticmethod
    def from_graph(graph: CostGraph, hardware: Hardware, problem: StageProblem) -> SwapFacts:
        index = graph.index
        swappable, d2h, h2d, readers, sources = [], [], [], [], []
        for position, op in enumerate(graph.ops):
            dying = [graph.tensors[t] for t in op.outputs
                     if not graph.tensors[t].is_output and graph.tensors[t].consumers]
            read_by = sorted({index[c] for t in dying for c in t.consumers})
            readers.append(tuple(read_by))
            producers = {graph.tensors[t].producer for t in op.inputs} - {None}
            sources.append(tuple(sorted(index[p] for p in producers if p is not None)))
            d2h.append(sum(hardware.d2h_time_s(t.size_bytes) for t in dying))
            h2d.append(sum(hardware.h2d_time_s(t.size_bytes) for t in dying))
            swappable.append(op.phase == "forward" and bool(dying) and not problem.returned_bytes[position]
                             and any(reader >= position + 2 for reader in read_by))
        return SwapFacts(tuple(swappable), tuple(d2h), tuple(h2d), tuple(readers), tuple(sources))


class SwapMilpModel(MilpModel):
    """Checkmate's columns and rows plus swap-outs, swap-ins, stalls and per-stage link time."""

    facts: SwapFacts
    time_unit_s: float

    @staticmethod
    def build_swap(problem: StageProblem, facts: SwapFacts, hardware: Hardware,
                   budget_bytes: int) -> SwapMilpModel:
        model = SwapMilpModel(problem)
        model.facts = facts
        # times in units of the mean op time, so HiGHS's tolerances sit far below one copy
        model.time_unit_s = max(sum(problem.time_s) / max(1, problem.stages), 1e-12)
        model._add_schedule_columns()
        model._add_swap_columns()
        model._add_schedule_rows()
        unit = max(1.0, budget_bytes / 1e4)
        model._add_memory_rows(budget_bytes / unit, unit)
        model._add_swap_rows()
        model._add_host_row(hardware.host_bytes, unit)
        model._add_time_rows(hardware)
        model.cost = [cost / model.time_unit_s if key[0] == "R" else cost
                      for key, cost in zip(model.columns_by_key, model.cost, strict=True)]
        return model

    def _add_swap_columns(self) -> None:
        problem, facts, stages = self.problem, self.facts, self.problem.stages
        for op in range(stages):
            if not facts.swappable[op]:
                continue
            self.column(("O", op), cost=TUNING.milp_swap_copy_cost)
            for stage in range(op + 2, stages):
                if any(reader > stage for reader in facts.storage_readers[op]):
                    self.column(("I", stage, op), cost=TUNING.milp_swap_copy_cost)
                if stage in facts.storage_readers[op] and op in problem.reads[stage]:
                    self.column(("J", stage, op), cost=TUNING.milp_swap_copy_cost)
        for stage in range(stages):
            self.column(("W", stage), cost=1.0, upper=math.inf, integer=False)

    def _add_swap_rows(self) -> None:
        """Copies come back only from the host; a value is brought in only when not on the device;
        this model does not re-run an op that reads a swapped value (memfit's plans may: see
        ``milp_swap``'s notes), nor re-run a swapped value's producer."""
        stages = self.problem.stages
        for key in [k for k in self.columns_by_key if k[0] in ("I", "J")]:
            _, stage, op = key
            self.row([(key, 1.0), (("O", op), -1.0)], -math.inf, 0.0)
            self.row([(key, 1.0), (("S", stage, op), 1.0)], -math.inf, 1.0)
            if key[0] == "I":
                self.row([(key, 1.0), (("J", stage, op), 1.0)], -math.inf, 1.0)
        for op in range(stages):
            for stage in range(op + 1, stages):
                if ("R", stage, op) not in self.columns_by_key:
                    continue
                for source in (op, *self.facts.storage_sources[op]):
                    if ("O", source) in self.columns_by_key:
                        self.row([(("R", stage, op), 1.0), (("O", source), 1.0)], -math.inf, 1.0)

    def _add_host_row(self, host_bytes: int | None, unit: float) -> None:
        """What is swapped out fits ``host_bytes`` (``None``: no row). This model keeps a host
        copy to the end of the step, so the row counts every swap-out: a bound at least as tight
        as the decoded plan's host peak (``memfit.model.host_memory``), never looser."""
        if host_bytes is None:
            return
        terms = [(("O", op), self.problem.dying_bytes[op] / unit)
                 for op in range(self.problem.stages) if ("O", op) in self.columns_by_key]
        if terms:
            self.row(terms, -math.inf, host_bytes / unit)

    def _add_time_rows(self, hardware: Hardware) -> None:
        """Stage t lasts its re-runs (``rc``) + its stall + op t; the copies issued at its start
        (the swap-out of op t - 1, then the swap-ins after op t - 1, those op t waits for first)
        queue on their link as ``simulate`` queues them (a FIFO per direction with ``duplex``, one
        shared without). ``B[link, t]`` is the link's backlog entering stage t (time units):
        ``B[t + 1] >= B[t] + issued[t] - duration[t]``, drained by the end of the step. A copy op
        t waits for (J) lands before op t; one brought in early (I) before op t + 1; a swap-in
        starts only once its value's swap-out has ended. Without ``async_copies`` copies overlap
        nothing and each stage stalls for all of its copies.
        """
        problem, facts, unit = self.problem, self.facts, self.time_unit_s
        stages = problem.stages

        def out(t: int) -> list[tuple[Key, float]]:
            return [(("O", t - 1), facts.d2h_s[t - 1] / unit)] if t else []

        def ins(kind: str, t: int) -> list[tuple[Key, float]]:
            return [((kind, t, op), facts.h2d_s[op] / unit) for op in range(t)]

        def rc(t: int, sign: float) -> list[tuple[Key, float]]:
            terms = [(("R", t, op), sign * problem.time_s[op] / unit) for op in range(t)]
            return [*terms, (("W", t), sign)]

        if not hardware.async_copies:
            for t in range(stages):
                self.row(out(t) + ins("I", t) + ins("J", t) + [(("W", t), -1.0)], -math.inf, 0.0)
            return
        links = ("d2h", "h2d") if hardware.duplex else ("link",)
        total = sum(d for d, ok in zip(facts.d2h_s, facts.swappable, strict=True) if ok)
        total += sum(h * len(facts.storage_readers[op])
                     for op, (h, ok) in enumerate(zip(facts.h2d_s, facts.swappable, strict=True)) if ok)
        big = total / unit + 1.0
        for link in links:
            for t in range(stages + 1):
                fixed = t in (0, stages)
                self.column(("B", link, t), upper=0.0 if fixed else big, integer=False)
        for t in range(stages):
            own = problem.time_s[t] / unit
            for link in links:
                issued = (out(t) if link != "h2d" else []) + (ins("I", t) + ins("J", t) if link != "d2h" else [])
                self.row([(("B", link, t + 1), 1.0), (("B", link, t), -1.0)]
                         + [(k, -c) for k, c in issued] + rc(t, 1.0), -own, math.inf)
            queue = links[-1]  # the swap-ins' link
            ahead = out(t) if queue == "link" else []
            for op in range(t):
                if ("J", t, op) in self.columns_by_key:  # lands before op t
                    self.row([(("B", queue, t), 1.0), *ahead, *ins("J", t), *rc(t, -1.0),
                              (("J", t, op), big)], -math.inf, big)
                if ("I", t, op) in self.columns_by_key and t + 1 < stages:  # before op t + 1
                    self.row([(("B", queue, t + 1), 1.0), *rc(t + 1, -1.0), (("I", t, op), big)],
                             -math.inf, big)
                if hardware.duplex:  # its swap-out has ended: the d2h backlog is newer work
                    for kind in ("I", "J"):
                        if (kind, t, op) in self.columns_by_key:
                            later = [term for s in range(op + 2, t) for term in out(s)]
                            self.row([(("B", "d2h", t), 1.0), *[(k, -c) for k, c in later],
                                      ((kind, t, op), big)], -math.inf, big)

    def value(self, solution: np.ndarray, key: tuple) -> float:
        column = self.columns_by_key.get(key)
        return 0.0 if column is None else float(solution[column])

    def chosen(self, solution: np.ndarray, kind: str) -> list[tuple]:
        """The keys of binary columns of ``kind`` set in ``solution``."""
        return sorted(key for key, column in self.columns_by_key.items()
                      if key[0] == kind and solution[column] > 0.5)
