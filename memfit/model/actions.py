"""``Action``: one step of a lowered plan (``memfit.model.schedule.lower``), in a module of its
own so that the passes that read a schedule's actions (``memfit.model.inlining``) need not import
the schedule."""

from __future__ import annotations

from typing import Literal, NamedTuple

ActionKind = Literal["compute", "swap_out", "swap_in", "wait", "recompute"]


class Action(NamedTuple):
    """One step of the rewritten program.

    A named tuple, not a dataclass: ``lower`` makes tens of thousands per simulated plan, and a
    frozen dataclass costs several times as much to build.

    Args:
        kind: ``"compute"`` runs ``op``; ``"swap_out"`` copies ``tensor`` to the host after its
            producer ``op``; ``"swap_in"`` issues copy number ``copy`` of ``tensor`` after the control
            op ``op``; ``"wait"`` makes the compute stream wait for that copy before ``op``.
        reads: device buffers the action reads.
        allocates: device buffers the action allocates.
    """

    kind: ActionKind
    op: str
    tensor: str = ""
    copy: int = -1
    reads: tuple[str, ...] = ()
    allocates: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "compute":
            return self.op
        if self.kind == "recompute":
            return f"recompute({self.op}#{self.copy})"
        suffix = f"#{self.copy}" if self.copy >= 0 else ""
        return f"{self.kind}({self.tensor}{suffix})"
