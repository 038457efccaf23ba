"""The decisions of a ``Plan``: what happens to each saved tensor. Frozen data only.

A decision is a small closed sum type. ``Keep`` leaves the tensor on the device. ``Swap`` copies
it to host memory right after its producer (one swap-out per tensor: swap-outs are always fused)
and back in one or more times: each ``SwapIn`` is issued right after its *control op* and serves
the consumers it names. Consumers that no ``SwapIn`` names read the original device buffer, which
therefore lives until the last of them.

A swap-in may also feed recomputation (Capuchin's swap + recompute): naming a forward reader that
runs at or before the control op means *that op's re-runs* (``Recompute`` and ``Plan.reruns``
re-run forward ops in the backward pass) placed after the control op. A checkpoint can so leave
the device in the forward pass and come back just before the re-runs that rebuild from it.

They live apart from ``Plan`` (``memfit.data.plan``, which imports them and names them again)
so that the JSON schema and the plan's text (``plan_json``, ``plan_text``), which ``Plan``'s
methods call, can read them without importing ``Plan``'s module: no import loop.
"""

from __future__ import annotations

from dataclasses import dataclass


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
