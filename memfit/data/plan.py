"""Plan: what happens to every saved tensor, and why. Frozen, typed, JSON-serialisable.

The decisions (``Keep``, ``Swap`` with its ``SwapIn``s, ``Recompute``) and explicit re-runs
(``Rerun``) are defined in ``memfit.data.decisions`` and importable from here. ``Plan``'s methods
are its own: ``explain`` renders with ``memfit.data.plan_text``, ``to_json``/``from_json``/
``save``/``load`` follow the schema of ``memfit.data.plan_json``; both sit in the data layer
beside it, below every layer that builds or reads a plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from memfit.data.decisions import KEEP, Decision, Keep, Recompute, Rerun, Swap, SwapIn
from memfit.data.errors import PlanError
from memfit.data.files import write_text
from memfit.data.plan_json import FORMAT, FORMAT_VERSION, jsonable, plan_fields
from memfit.data.plan_text import explain_text

if TYPE_CHECKING:
    from memfit.data.costgraph import CostGraph
    from memfit.data.explanation import Explanation

__all__ = ["FORMAT_VERSION", "KEEP", "Decision", "Keep", "Plan", "Recompute", "Rerun", "Swap",
           "SwapIn", "topology_hash"]


@dataclass(frozen=True)
class Plan:
    """The decisions for one captured graph.

    Args:
        strategy: the registered name of the strategy that made it.
        decisions: tensor name -> decision; a tensor not named is kept.
        graph_hash: ``CostGraph.structure_hash`` of the graph it was made for.
        params: the strategy parameters actually used (after any tuning).
        budget_bytes: the device budget it was made for, if any.
        hardware: the name of the ``Hardware`` profile it was made for.
        reruns: explicit re-runs, in program order (schedules from the optimal solvers); each
            ``Recompute`` decision adds its own re-run on top.
        topology_hash: ``topology_hash`` of the graph (its ops and edges, not its sizes), so that
            a plan used on another graph can say whether the model or only the shapes differ.
        explanation: why each decision was made and what it costs (``memfit.model.explain``),
            filled where the plan is made; it travels with the plan, so a loaded one explains
            itself. Not part of the plan's identity (``==`` ignores it).
        regions: for a step that Dynamo compiles as several regions (graph breaks), each
            region's plan, in the order the regions run; each was made under the whole budget
            beside the bytes the regions before it still hold. Such a plan decides nothing
            itself: ``swapped``, ``recomputed`` and ``swap_in_count`` gather its regions', and
            ``decision`` asks which region. Empty for a step of one region.

    Example:
        >>> plan = memfit.plan(model, loss_fn, *meta_inputs, budget="20GiB", hardware="gh200")
        >>> print(plan.explain())
        >>> plan.save("step.plan.json")
        >>> step = memfit.compile(model, loss_fn, plan=memfit.Plan.load("step.plan.json"))
    """

    strategy: str
    decisions: Mapping[str, Decision] = field(default_factory=dict)
    graph_hash: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    hardware: str = ""
    reruns: tuple[Rerun, ...] = ()
    topology_hash: str = field(default="", compare=False)
    explanation: Explanation | None = field(default=None, compare=False, repr=False)
    regions: tuple[Plan, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        if self.regions and self.decisions:
            raise ValueError("a plan of several regions decides nothing itself: its regions' "
                             "plans hold the decisions")

    def decision(self, tensor: str) -> Decision:
        if self.regions:  # tensor names repeat from one region's graph to the next
            raise ValueError(f"this plan has {len(self.regions)} regions (graph breaks): ask "
                             f"plan.regions[i].decision({tensor!r})")
        return self.decisions.get(tensor, KEEP)

    @property
    def swapped(self) -> tuple[str, ...]:
        """Names of swapped tensors (of every region: a name may repeat across regions)."""
        if self.regions:
            return tuple(name for region in self.regions for name in region.swapped)
        return tuple(name for name, d in self.decisions.items() if isinstance(d, Swap))

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Names of recomputed tensors (of every region: a name may repeat across regions)."""
        if self.regions:
            return tuple(name for region in self.regions for name in region.recomputed)
        return tuple(name for name, d in self.decisions.items() if isinstance(d, Recompute))

    @property
    def swap_in_count(self) -> int:
        if self.regions:
            return sum(region.swap_in_count for region in self.regions)
        return sum(len(d.swap_ins) for d in self.decisions.values() if isinstance(d, Swap))

    def for_graph(self, graph: CostGraph, hardware: str) -> Plan:
        """The plan made for ``graph`` on ``hardware``: this one, or the region's of that graph.

        Raises:
            PlanError: as ``check_for`` (for a plan of several regions, as the first region's
                would), where none was made for it.
        """
        for region in self.regions:
            if region.graph_hash == graph.structure_hash:
                region.check_for(graph, hardware)
                return region
        (self.regions[0] if self.regions else self).check_for(graph, hardware)
        return self

    def check_for(self, graph: CostGraph, hardware: str) -> None:
        """Raise ``PlanError`` unless this plan was made for ``graph`` on ``hardware``.

        The message says what differs: the hardware profile, the input shapes (same ops, other
        tensor sizes) or the graph itself, and what to do about it. A plan with a blank
        ``graph_hash`` is refused: without it nothing says the plan fits this step.
        """
        again = "plan again with memfit.plan(...) for this model and input shape"
        if self.hardware and self.hardware != hardware:
            raise PlanError(
                f"this plan was made for hardware {self.hardware!r}, but the step is planned for "
                f"{hardware!r}: pass hardware={self.hardware!r} to memfit.compile, or {again} "
                f"with hardware={hardware!r}"
            )
        if not self.graph_hash.strip():  # no hash is no proof: never run such a plan unchecked
            raise PlanError(f"this plan names no graph (its graph_hash is blank), so it cannot be "
                            f"checked against this step: {again}")
        if self.graph_hash == graph.structure_hash:
            return
        if self.topology_hash and self.topology_hash == topology_hash(graph):
            raise PlanError(
                f"this plan was made for other input shapes: the ops are the same but tensor "
                f"sizes differ (graph {self.graph_hash}, this step's {graph.structure_hash}); "
                f"{again}"
            )
        raise PlanError(
            f"this plan was made for another graph ({self.graph_hash}, this step's is "
            f"{graph.structure_hash}): another model, loss function, input shape, "
            f"linearize= setting, or another device's step (memfit.plan for a GPU profile "
            f"captures that GPU's attention kernels, and autocast= its dtypes: such a plan runs "
            f"only there, not on this CPU); {again}"
        )

    # ---- text and the JSON file form ------------------------------------------------------------

    def explain(self, depth: int = 3, width: int = 100, rows: int | None = 40) -> str:
        """The decisions grouped by module, the time each costs, and what-if budgets, as text.

        Args:
            depth: module-path parts to group by (``transformer.h.3``: 3); deeper paths are cut.
            width: terminal columns; wide tables turn on their side.
            rows: the most per-tensor rows to print, most costly first (``None``: all).
        """
        return explain_text(self, depth=depth, width=width, rows=rows)

    def to_json(self) -> dict:
        """The plan's JSON form (``memfit.data.plan_json`` holds the schema it is read against);
        a plan of several regions adds ``regions``, each region's own form."""
        regions = {"regions": [region.to_json() for region in self.regions]} if self.regions else {}
        return regions | {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "topology_hash": self.topology_hash,
            "explanation": self.explanation.to_json() if self.explanation else None,
            "strategy": self.strategy,
            "graph_hash": self.graph_hash,
            "params": jsonable(dict(self.params)),
            "budget_bytes": self.budget_bytes,
            "hardware": self.hardware,
            "decisions": {name: {"type": type(d).__name__, **asdict(d)}
                          for name, d in self.decisions.items()},
            "reruns": [[r.op, r.before] for r in self.reruns],
        }

    @staticmethod
    def from_json(data: object, source: str = "the saved plan") -> Plan:
        """A plan from its JSON form, checked against the schema first.

        The strategy is read as a name, not looked up in the registry (a saved plan runs as it
        is, never planned again).

        Raises:
            ValueError: naming the field that is missing, unknown, or of the wrong type or value
                (a blank strategy, a budget that is not a positive int, a blank ``graph_hash``);
                for a plan of another format version (made by another memfit).
        """
        checked = plan_fields(data, source)
        regions = tuple(Plan.from_json(region, f"{source} regions[{i}]")
                        for i, region in enumerate(checked.pop("regions")))
        return Plan(**checked, regions=regions)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically: an existing file is replaced only when complete."""
        write_text(path, json.dumps(self.to_json(), indent=1))

    @staticmethod
    def load(path: str | Path) -> Plan:
        """Read a plan ``save`` wrote. ``memfit.compile(..., plan=plan)`` checks that it fits.

        Raises:
            ValueError: if the file is not a memfit plan, is one of another format version, or
                breaks the schema (the message names the field; see ``from_json``).
            OSError: if the file cannot be read.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not a memfit plan (not JSON: {error})") from None
        return Plan.from_json(data, source=str(path))


def topology_hash(graph: CostGraph) -> str:
    """A hash of ``graph``'s ops and edges without tensor sizes: equal for two input shapes."""
    payload = [(op.name, op.kind, op.phase, op.inputs, op.outputs, op.depends_on)
               for op in graph.ops]
    roles = sorted((t.name, t.role, t.is_output) for t in graph.tensors.values())
    return hashlib.sha256(json.dumps([payload, roles]).encode()).hexdigest()[:16]
