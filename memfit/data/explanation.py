"""The explanation a plan carries: its rows, tallies and what-if budgets. Frozen data only.

``memfit.model.explain`` computes an ``Explanation`` where the plan is made; it lives here, apart
from that computation, so that ``Plan`` (which holds one) and the JSON schema can name the type
without importing the simulator that fills it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

DecisionKind = Literal["keep", "swap", "recompute"]


@dataclass(frozen=True)
class TensorRow:
    """One decided tensor.

    Args:
        tensor: its name (the fx node that allocates it).
        scope: module path of its producer (``"transformer.h.3.attn"``), ``""`` at top level.
        module_type: class name of that module.
        size_bytes: bytes of its storage.
        decision: ``"keep"``, ``"swap"`` or ``"recompute"``.
        reason: what the strategy said when it decided.
        prefetch_after: for a swap, the control op after which each swap-in is issued.
        prefetch_scopes: the module path of each of those control ops.
        exposed_s: compute time lost waiting for this tensor's copies.
        reruns: how many times its producer runs again.
        recompute_s: compute time of those re-runs (its share).
    """

    tensor: str
    scope: str
    module_type: str
    size_bytes: int
    decision: DecisionKind
    reason: str = ""
    prefetch_after: tuple[str, ...] = ()
    prefetch_scopes: tuple[str, ...] = ()
    exposed_s: float = 0.0
    reruns: int = 0
    recompute_s: float = 0.0
    saved: bool = True  # read by the backward: one of ``Tally.saved`` (rebuilt on the way: not)

    @property
    def time_paid_s(self) -> float:
        return self.exposed_s + self.recompute_s


@dataclass(frozen=True)
class Tally:
    """What a plan does to the step's saved tensors, and what its re-runs cost.

    The counts are of one population, the saved tensors (forward values a backward op reads,
    ``CostGraph.saved_tensors``), so ``swapped + recomputed + kept == saved``. Values a re-run
    rebuilds on its way to a saved one are not saved tensors: they show in the re-run figures.

    Args:
        saved: saved tensors.
        swapped: saved tensors the plan swaps.
        recomputed: saved tensors the plan rebuilds (``Recompute`` or an explicit re-run).
        swapped_bytes: bytes of the ``swapped`` ones.
        swap_ins: copies back to the device (a tensor may come back more than once).
        rerun_count: forward ops run again (an op re-run twice counts twice).
        rerun_ops: distinct forward ops among them.
        rerun_bytes: device bytes those re-runs allocate (the values they rebuild).
        exposed_transfer_s: compute time lost waiting for copies, on the timeline given.
        recompute_s: compute time of the re-runs, on the timeline given.
        swapped_unsaved: swapped values that are not saved tensors (a forward value read
            again later in the forward pass only), counted apart from ``swapped``.
        swapped_unsaved_bytes: their bytes.
    """

    saved: int
    swapped: int
    recomputed: int
    swapped_bytes: int = 0
    swap_ins: int = 0
    rerun_count: int = 0
    rerun_ops: int = 0
    rerun_bytes: int = 0
    exposed_transfer_s: float = 0.0
    recompute_s: float = 0.0
    swapped_unsaved: int = 0
    swapped_unsaved_bytes: int = 0

    @property
    def kept(self) -> int:
        return self.saved - self.swapped - self.recomputed


@dataclass(frozen=True)
class WhatIf:
    """The same strategy and parameters at another budget (whole-device bytes).

    ``minimum_bytes`` is set, and the figures are ``None``, when the plan does not fit.
    """

    factor: float
    budget_bytes: int
    peak_bytes: int | None = None
    step_time_s: float | None = None
    exposed_transfer_s: float | None = None
    recompute_s: float | None = None
    minimum_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.minimum_bytes is None


@dataclass(frozen=True)
class BudgetRow:
    """One row of the what-if table: the fastest plan found at or under one budget.

    Args:
        factor: the budget as a multiple of the plan's.
        budget_bytes: that budget, whole device.
        best: the fastest plan made for this budget or a tighter one (it fits this one too);
            ``None`` when none of them fits.
        made_for: the factor of the budget ``best`` was made for (``factor``: its own).
        minimum_bytes: when nothing fits, the smallest peak the strategy reached here.
    """

    factor: float
    budget_bytes: int
    best: WhatIf | None
    made_for: float | None = None
    minimum_bytes: int | None = None

    @property
    def borrowed(self) -> bool:
        """Whether the planner's own plan for this budget was slower than a tighter one's."""
        return self.best is not None and self.made_for != self.factor


@dataclass(frozen=True)
class ModuleTotal:
    """Decided tensors of one module path (cut to a depth), and what they cost. The counts and
    bytes are of saved tensors (``Tally``'s population); the times include the re-runs of values
    rebuilt on the way to them."""

    scope: str
    swapped: int = 0
    swapped_bytes: int = 0
    recomputed: int = 0
    recomputed_bytes: int = 0
    kept: int = 0
    exposed_s: float = 0.0
    recompute_s: float = 0.0


@dataclass(frozen=True)
class Explanation:
    """Everything ``Plan.explain()`` prints. Device figures (peaks, budgets) include
    ``outside_bytes``, the bytes outside the graph (existing ``.grad``) at planning time."""

    graph: str
    hardware: str
    budget_bytes: int | None
    outside_bytes: int
    saved_tensors: int
    baseline_peak_bytes: int
    baseline_step_time_s: float
    peak_bytes: int
    step_time_s: float
    exposed_transfer_s: float
    recompute_s: float
    rows: tuple[TensorRow, ...] = ()
    what_if: tuple[WhatIf, ...] = ()
    tally: Tally | None = None  # None in a plan saved before tallies were recorded

    def what_if_table(self) -> list[BudgetRow]:
        """The what-if budgets and this plan's, tightest first, each with the fastest plan found
        at or under it, so a looser budget never shows a slower step.

        Note:
            The strategies are heuristics: re-planned for a looser budget, one may find a
            slower plan than for a tighter one. That tighter plan
            fits the looser budget too, so its row shows it and says whose it is.
        """
        if self.budget_bytes is None:
            return []
        this = WhatIf(1.0, self.budget_bytes, self.peak_bytes, self.step_time_s,
                      self.exposed_transfer_s, self.recompute_s)
        table: list[BudgetRow] = []
        fitted: list[WhatIf] = []  # the plans of the tighter budgets
        for case in sorted((*self.what_if, this), key=lambda c: c.factor):
            tighter = [c for c in fitted if (c.peak_bytes or 0) <= case.budget_bytes]
            own = [case] if case.fits else []
            best = min(own + tighter, key=lambda c: c.step_time_s or 0.0, default=None)
            table.append(BudgetRow(case.factor, case.budget_bytes, best,
                                   best.factor if best else None,
                                   None if best else case.minimum_bytes))
            fitted += own
        return table

    def by_module(self, depth: int = 3) -> list[ModuleTotal]:
        """Totals per module path cut to its first ``depth`` parts, in first-seen row order."""
        totals: dict[str, dict[str, Any]] = {}
        for row in self.rows:
            scope = ".".join(row.scope.split(".")[:depth]) if row.scope else ""
            total = totals.setdefault(scope or "(top level)", {})
            if row.decision == "swap" and row.saved:
                _add(total, swapped=1, swapped_bytes=row.size_bytes)
            elif row.decision == "recompute" and row.saved:
                _add(total, recomputed=1, recomputed_bytes=row.size_bytes)
            elif row.decision == "keep":
                _add(total, kept=1)
            _add(total, exposed_s=row.exposed_s, recompute_s=row.recompute_s)
        return [ModuleTotal(scope, **fields) for scope, fields in totals.items()]

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping) -> Explanation:
        rows = tuple(
            TensorRow(**{**row, "prefetch_after": tuple(row.get("prefetch_after", ())),
                         "prefetch_scopes": tuple(row.get("prefetch_scopes", ()))})
            for row in data.get("rows", ())
        )
        what_if = tuple(WhatIf(**row) for row in data.get("what_if", ()))
        counted = data.get("tally")
        fields = {k: v for k, v in data.items() if k not in ("rows", "what_if", "tally")}
        return Explanation(**fields, rows=rows, what_if=what_if,
                           tally=Tally(**counted) if counted is not None else None)


def _add(total: dict[str, Any], **amounts: float) -> None:
    for key, amount in amounts.items():
        total[key] = total.get(key, 0) + amount
