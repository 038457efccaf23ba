"""The variables and constraints of the Checkmate MILP (see ``memfit.planning.solvers.milp`` for the model).

``StageProblem`` is the graph reduced to what the MILP needs (per op: bytes, reads, readers,
whether it may be recomputed) and replays a decoded schedule exactly. ``MilpModel`` lays the
variables out in one vector and the constraints out as sparse rows for ``scipy.optimize.milp``,
and solves them bounded by work, never by the clock (``MilpModel.solve``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from memfit.data.costgraph import CostGraph

MilpStatus = Literal["optimal", "feasible", "infeasible", "node_limit", "error"]
Key = tuple  # ("R", t, i) | ("S", t, i) | ("F", t, i, k) | ("U", t, k); swap model: I, J, O, W


@dataclass(frozen=True)
class StageProblem:
    """Per op, in execution order: the facts the MILP and its replay use.

    Args:
        time_s: run time of each op.
        dying_bytes: bytes of its output storages that the step does not return.
        returned_bytes: bytes of its outputs the step returns (live from the op to the end).
        reads: indices of the ops whose values it reads (``depends_on`` and storage producers).
        recomputable: forward ops that return nothing may run again; all others run once.
        resident_bytes: graph inputs and parameters, live throughout.
        transient_bytes: bytes of its outputs that nothing reads and the step does not return
            (a kernel's own buffers): live while it runs, freed right after, never kept.
    """

    time_s: tuple[float, ...]
    dying_bytes: tuple[int, ...]
    returned_bytes: tuple[int, ...]
    reads: tuple[tuple[int, ...], ...]
    recomputable: tuple[bool, ...]
    resident_bytes: int
    transient_bytes: tuple[int, ...] = ()
    readers: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        readers: list[list[int]] = [[] for _ in self.time_s]
        for op, sources in enumerate(self.reads):
            for source in sources:
                readers[source].append(op)
        object.__setattr__(self, "readers", tuple(tuple(r) for r in readers))

    @staticmethod
    def from_graph(graph: CostGraph) -> StageProblem:
        index = graph.index
        reads, dying, returned, transient = [], [], [], []
        for op in graph.ops:
            producers = {graph.tensors[t].producer for t in op.inputs} - {None}
            sources = {index[name] for name in (*op.depends_on, *producers) if name is not None}
            reads.append(tuple(sorted(sources)))
            outputs = [graph.tensors[t] for t in op.outputs]
            dying.append(sum(t.size_bytes for t in outputs if not t.is_output and t.consumers))
            returned.append(sum(t.size_bytes for t in outputs if t.is_output))
            transient.append(sum(t.size_bytes for t in outputs if not t.is_output and not t.consumers))
        recomputable = tuple(op.phase == "forward" and not returned[i] for i, op in enumerate(graph.ops))
        return StageProblem(tuple(op.time_s for op in graph.ops), tuple(dying), tuple(returned),
                            tuple(reads), recomputable, graph.resident_bytes, tuple(transient))

    def transient(self, op: int) -> int:
        return self.transient_bytes[op] if self.transient_bytes else 0

    @property
    def stages(self) -> int:
        return len(self.time_s)

    def replay(self, computed: list[list[int]], kept: list[list[int]]) -> tuple[float, int]:
        """Run the decoded schedule with program-order liveness: (recompute_time_s, peak_bytes).

        Raises:
            ValueError: if an op runs without its inputs in memory (a modelling bug).
        """
        peak = base = self.resident_bytes
        recompute_time_s = 0.0
        for stage, ops in enumerate(computed):
            live = set(kept[stage])
            keep_next = set(kept[stage + 1]) if stage + 1 < len(kept) else set()
            used = sum(self.dying_bytes[i] for i in live)
            for position, op in enumerate(ops):
                missing = [source for source in self.reads[op] if source not in live]
                if missing:
                    raise ValueError(f"stage {stage}: op {op} runs without ops {missing} in memory")
                live.add(op)
                used += self.dying_bytes[op] + (self.returned_bytes[op] if op == stage else 0)
                peak = max(peak, base + used + self.transient(op))
                later = set(ops[position + 1:])
                for source in (*self.reads[op], op):
                    if source in live and source not in keep_next and not later & set(self.readers[source]):
                        live.discard(source)
                        used -= self.dying_bytes[source]
                if op != stage:
                    recompute_time_s += self.time_s[op]
            base += self.returned_bytes[stage]
        return recompute_time_s, peak


@dataclass
class MilpModel:
    """Columns (cost, bounds, integrality) and sparse rows of the MILP, and how to read x back."""

    problem: StageProblem
    columns_by_key: dict[Key, int] = field(default_factory=dict)
    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integrality: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)

    @staticmethod
    def build(problem: StageProblem, budget_bytes: int) -> MilpModel:
        model = MilpModel(problem)
        model._add_schedule_columns()
        model._add_schedule_rows()
        # memory in units of budget / 1e4, so that HiGHS's tolerances sit far below one tensor
        unit = max(1.0, budget_bytes / 1e4)
        model._add_memory_rows(budget_bytes / unit, unit)
        return model

    def solve(self, node_limit: int, mip_rel_gap: float) -> tuple[np.ndarray | None, MilpStatus]:
        """HiGHS's solution vector (``None`` when none was found) and what it says.

        The search stops after ``node_limit`` branch-and-bound nodes, never on a clock: HiGHS is
        deterministic for a fixed model and options, so the same graph and budget give the same
        schedule on a busy machine and an idle one. ``"node_limit"``: no schedule within the
        limit, which proves nothing about the budget.
        """
        matrix = coo_matrix((self.values, (self.rows, self.columns)),
                            shape=(len(self.row_lower), len(self.cost))).tocsr()
        result = milp(
            c=np.array(self.cost), integrality=np.array(self.integrality),
            bounds=Bounds(np.array(self.lower), np.array(self.upper)),
            constraints=LinearConstraint(matrix, np.array(self.row_lower), np.array(self.row_upper)),
            options={"node_limit": node_limit, "mip_rel_gap": mip_rel_gap, "disp": False},
        )
        if result.x is not None:
            return result.x, "optimal" if result.status == 0 else "feasible"
        if result.status == 2:
            return None, "infeasible"
        nodes = getattr(result, "mip_node_count", None) or 0
        return None, "node_limit" if nodes >= node_limit else "error"

    def column(self, key: Key, cost: float = 0.0, lower: float = 0.0, upper: float = 1.0,
               integer: bool = True) -> int:
        self.columns_by_key[key] = len(self.cost)
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integrality.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[Key, float]], lower: float, upper: float) -> None:
        """Add ``lower <= sum(coefficient * x[key]) <= upper``; absent keys are zero variables."""
        number = len(self.row_lower)
        for key, coefficient in terms:
            if key in self.columns_by_key:
                self.rows.append(number)
                self.columns.append(self.columns_by_key[key])
                self.values.append(coefficient)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def _add_schedule_columns(self) -> None:
        """R[t, i] (op i runs in stage t) and S[t, i] (op i's outputs kept entering stage t)."""
        problem, stages = self.problem, self.problem.stages
        for stage in range(stages):
            for op in range(stage + 1):
                if op == stage:
                    self.column(("R", stage, op), lower=1.0)
                elif problem.recomputable[op]:
                    self.column(("R", stage, op), cost=problem.time_s[op])
            for op in range(stage):  # keeping an op no later stage reads is never useful
                useful = any(reader >= stage for reader in problem.readers[op])
                self.column(("S", stage, op), upper=1.0 if useful else 0.0)

    def _add_schedule_rows(self) -> None:
        """An op runs only with its sources in memory; outputs are kept only if kept or computed.

        The swap model (``_milp_swap_model``) adds columns I[t, i] (a copy of op i's outputs
        brought in at the start of stage t, resident from t + 1) and J[t, i] (one brought in for
        op t itself); the terms name them and ``row`` drops them where they do not exist.
        """
        problem, stages = self.problem, self.problem.stages
        for stage in range(stages):
            for op in range(stage + 1):
                if ("R", stage, op) not in self.columns_by_key:
                    continue
                for source in problem.reads[op]:
                    terms = [(("R", stage, op), 1.0), (("R", stage, source), -1.0),
                             (("S", stage, source), -1.0)]
                    if op == stage:
                        terms.append((("J", stage, source), -1.0))
                    self.row(terms, -math.inf, 0.0)
            if stage + 1 < stages:
                for op in range(stage + 1):
                    self.row([(("S", stage + 1, op), 1.0), (("S", stage, op), -1.0),
                              (("R", stage, op), -1.0), (("I", stage, op), -1.0),
                              (("J", stage, op), -1.0)], -math.inf, 0.0)

    def _add_memory_rows(self, budget_units: float, unit: float) -> None:
        """U[t, k] and FREE[t, i, k]: memory after each op of each stage stays within budget."""
        problem = self.problem
        dying = [size / unit for size in problem.dying_bytes]
        base = problem.resident_bytes / unit
        for stage in range(problem.stages):
            for op in range(stage + 1):
                self.column(("U", stage, op), lower=0.0, upper=budget_units, integer=False)
            returned_now = problem.returned_bytes[stage] / unit
            transient = [problem.transient(op) / unit for op in range(stage + 1)]
            first = dying[0] + transient[0] + (returned_now if stage == 0 else 0)
            terms = [(("U", stage, 0), 1.0), (("R", stage, 0), -first)]
            for i in range(stage):  # kept, or (swap model) being brought in during the stage
                terms += [(("S", stage, i), -dying[i]), (("I", stage, i), -dying[i]),
                          (("J", stage, i), -dying[i])]
            self.row(terms, base, base)
            for op in range(1, stage + 1):
                added = dying[op] + transient[op] + (returned_now if op == stage else 0.0)
                terms = [(("U", stage, op), 1.0), (("U", stage, op - 1), -1.0), (("R", stage, op), -added),
                         (("R", stage, op - 1), transient[op - 1])]
                terms += [(key, dying[key[2]]) for key in self._free_columns(stage, op - 1)]
                self.row(terms, 0.0, 0.0)
            base += problem.returned_bytes[stage] / unit

    def _free_columns(self, stage: int, op: int) -> list[Key]:
        """FREE[stage, i, op] for the storages op may free, each bounded by what forbids it."""
        problem, keys = self.problem, list[Key]()
        if ("R", stage, op) not in self.columns_by_key:
            return keys
        for source in (*problem.reads[op], op):
            if not problem.dying_bytes[source]:
                continue
            key = ("F", stage, source, op)
            self.column(key, integer=False)
            keys.append(key)
            self.row([(key, 1.0), (("R", stage, op), -1.0)], -math.inf, 0.0)
            self.row([(key, 1.0), (("S", stage + 1, source), 1.0)], -math.inf, 1.0)
            for reader in problem.readers[source]:
                if op < reader <= stage:
                    self.row([(key, 1.0), (("R", stage, reader), 1.0)], -math.inf, 1.0)
        return keys

    def decode(self, solution: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """Per stage: the ops computed (in op order) and the ops kept entering it."""
        stages = self.problem.stages
        computed: list[list[int]] = [[] for _ in range(stages)]
        kept: list[list[int]] = [[] for _ in range(stages)]
        for key, column in self.columns_by_key.items():
            if key[0] in ("R", "S") and solution[column] > 0.5:
                (computed if key[0] == "R" else kept)[key[1]].append(key[2])
        return [sorted(ops) for ops in computed], [sorted(ops) for ops in kept]
