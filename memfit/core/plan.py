"""Plan: what happens to every saved tensor, and why. Frozen, typed, JSON-serialisable.

A decision is a small closed sum type. ``Keep`` leaves the tensor on the device. ``Swap`` copies
it to host memory right after its producer (one swap-out per tensor: swap-outs are always fused)
and back in one or more times: each ``SwapIn`` is issued right after its *control op* and serves
the consumers it names. Consumers that no ``SwapIn`` names read the original device buffer, which
therefore lives until the last of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Keep:
    """Leave the tensor on the device for its whole lifetime."""

    reason: str = ""


@dataclass(frozen=True)
class SwapIn:
    """One host-to-device copy of a swapped tensor.

    Args:
        after: the control op; the copy is issued right after it runs.
        consumers: the ops that read this copy, in execution order.
    """

    after: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class Swap:
    """Offload the tensor after its producer and bring it back before the consumers named."""

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
    lifetimes stretch to the rebuild: they are the *checkpoints*), or tensors recomputed too.
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
    """

    strategy: str
    decisions: Mapping[str, Decision] = field(default_factory=dict)
    graph_hash: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    hardware: str = ""
    reruns: tuple[Rerun, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def decision(self, tensor: str) -> Decision:
        return self.decisions.get(tensor, KEEP)

    @property
    def swapped(self) -> tuple[str, ...]:
        """Names of swapped tensors."""
        return tuple(name for name, d in self.decisions.items() if isinstance(d, Swap))

    @property
    def recomputed(self) -> tuple[str, ...]:
        """Names of recomputed tensors."""
        return tuple(name for name, d in self.decisions.items() if isinstance(d, Recompute))

    @property
    def swap_in_count(self) -> int:
        return sum(len(d.swap_ins) for d in self.decisions.values() if isinstance(d, Swap))

    # ---- serialisation -------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy,
            "graph_hash": self.graph_hash,
            "params": _jsonable(dict(self.params)),
            "budget_bytes": self.budget_bytes,
            "hardware": self.hardware,
            "decisions": {name: _decision_json(d) for name, d in self.decisions.items()},
            "reruns": [[r.op, r.before] for r in self.reruns],
        }

    @staticmethod
    def from_json(data: Mapping) -> Plan:
        return Plan(
            strategy=data["strategy"],
            graph_hash=data.get("graph_hash", ""),
            params=data.get("params", {}),
            budget_bytes=data.get("budget_bytes"),
            hardware=data.get("hardware", ""),
            decisions={name: _decision_from_json(d) for name, d in data["decisions"].items()},
            reruns=tuple(Rerun(op, before) for op, before in data.get("reruns", ())),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @staticmethod
    def load(path: str | Path) -> Plan:
        return Plan.from_json(json.loads(Path(path).read_text()))


def _decision_json(decision: Decision) -> dict:
    return {"type": type(decision).__name__, **asdict(decision)}


def _decision_from_json(data: Mapping) -> Decision:
    kind = data.get("type")
    if kind == "Keep":
        return Keep(reason=data.get("reason", ""))
    if kind == "Recompute":
        return Recompute(reason=data.get("reason", ""))
    if kind == "Swap":
        swap_ins = tuple(
            SwapIn(after=s["after"], consumers=tuple(s["consumers"])) for s in data["swap_ins"]
        )
        return Swap(swap_ins=swap_ins, reason=data.get("reason", ""))
    raise ValueError(
        f"unknown decision type {kind!r} in a saved plan: expected 'Keep', 'Swap' or 'Recompute'"
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
