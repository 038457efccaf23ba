"""Plan: what happens to every saved tensor, and why. Frozen, typed, JSON-serialisable.

A decision is a small closed sum type. ``Keep`` leaves the tensor on the device. ``Swap`` copies
it to host memory right after its producer (one swap-out per tensor: swap-outs are always fused)
and back in one or more times: each ``SwapIn`` is issued right after its *control op* and serves
the consumers it names. Consumers that no ``SwapIn`` names read the original device buffer, which
therefore lives until the last of them.

A swap-in may also feed recomputation (Capuchin's swap + recompute): naming a forward reader that
runs at or before the control op means *that op's re-runs* (``Recompute`` and ``Plan.reruns``
re-run forward ops in the backward pass) placed after the control op. A checkpoint can so leave
the device in the forward pass and come back just before the re-runs that rebuild from it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from memfit.data.errors import PlanError

if TYPE_CHECKING:
    from pathlib import Path

    from memfit.data.costgraph import CostGraph
    from memfit.data.explanation import Explanation

FORMAT_VERSION = 1  # of the JSON form; bump when a saved plan would be read differently

@dataclass(frozen=True)
class Keep:
    """Leave the tensor on the device for its whole lifetime."""

    reason: str = ""


@dataclass(frozen=True)
class SwapIn:
    """One host-to-device copy of a swapped tensor.

    Args:
        after: the control op; the copy is issued right after it runs.
        consumers: the ops that read this copy, in execution order. An op that runs after
            ``after`` reads the copy itself. A forward op that runs at or before ``after`` stands
            for its re-runs: each re-run of it placed after ``after`` (a re-run "before B" runs
            right before op B) reads the copy of the latest swap-in naming it issued before it.

    Note:
        Why the op stands for its re-runs: a re-run has no name of its own (it is the op run
        again), and the op itself cannot read a copy issued after it ran, so the position of the
        control op says which is meant without a new field. Once an op's re-runs are served by a
        swap-in, every re-run of it must be (``check_plan`` rejects a re-run that comes before
        every swap-in naming its op: the copy would arrive too late).
    """

    after: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class Swap:
    """Offload the tensor after its producer and bring it back before the consumers named.

    A consumer may be a re-run of a forward reader (see ``SwapIn``): a kept checkpoint of a
    recompute plan can be swapped out in the forward pass and back in before its re-runs.
    """

    swap_ins: tuple[SwapIn, ...]
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.swap_ins:
            raise ValueError("a Swap needs at least one SwapIn; use Keep for a tensor not swapped")


@dataclass(frozen=True)
class Recompute:
    """Free the tensor after its last forward use and rebuild it for the backward pass.

    Its producer is re-run once, just before the first backward op that needs the tensor
    (directly, or to rebuild another recomputed tensor); the rebuilt copy lives until its last
    backward reader. The producer's inputs must then be alive: graph inputs, kept tensors (whose
    lifetimes stretch to the rebuild: they are the *checkpoints*), tensors recomputed too, or
    swapped tensors whose ``SwapIn`` names the producer (brought back for the re-run).
    """

    reason: str = ""


Decision = Keep | Swap | Recompute
KEEP = Keep()


@dataclass(frozen=True)
class Rerun:
    """Re-run forward op ``op`` right before op ``before``: a new instance of its outputs.

    Later readers of those outputs read the newest instance, and each instance is freed after its
    last reader, so a sequence of re-runs can express any recomputation schedule: a value rebuilt
    several times (revolve, the memory-poor chain), or rebuilt in the forward pass.
    """

    op: str
    before: str


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

    # ---- methods that reach above the data layer, attached by ``memfit/__init__.py`` ----
    # (the bodies and their docstrings: ``memfit.plan_methods``; declared here for type checkers)

    if TYPE_CHECKING:
        def explain(self, depth: int = 3, width: int = 100, rows: int | None = 40) -> str: ...

        def to_json(self) -> dict: ...

        @staticmethod
        def from_json(data: Mapping, source: str = "the saved plan") -> Plan: ...

        def save(self, path: str | Path) -> None: ...

        @staticmethod
        def load(path: str | Path) -> Plan: ...


def topology_hash(graph: CostGraph) -> str:
    """A hash of ``graph``'s ops and edges without tensor sizes: equal for two input shapes."""
    payload = [(op.name, op.kind, op.phase, op.inputs, op.outputs, op.depends_on)
               for op in graph.ops]
    roles = sorted((t.name, t.role, t.is_output) for t in graph.tensors.values())
    return hashlib.sha256(json.dumps([payload, roles]).encode()).hexdigest()[:16]
