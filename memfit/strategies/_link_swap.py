"""Swaps the link carries for free: the hybrid planner's swap half.

A swap costs nothing while its two copies hide behind compute: the copy out must run on the
device-to-host stream after its producer, the copy back on the host-to-device stream after the
copy out and before the first backward reader, and each stream is a FIFO. This module replays
those two queues on the unplanned compute timeline (op times back to back) and keeps a tensor
only if both copies fit with no stall. Copies back are issued as late as they can be (just in
time, after the last backward op that ends early enough) so each copy on the device lives
briefly: prefetching earlier would only raise the backward pass's memory.

Candidates go in order of production: the earliest forward values have the whole rest of the
forward pass to leave, and the backward pass reads them last.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from memfit.core.costgraph import CostGraph
from memfit.core.hardware import Hardware
from memfit.core.plan import Swap, SwapIn


@dataclass(frozen=True)
class _Candidate:
    tensor: str
    size_bytes: int
    ready_s: float  # its producer's end
    need_index: int  # its first backward reader
    consumers: tuple[str, ...]  # its backward readers


def free_swaps(graph: CostGraph, hardware: Hardware, exclude: Iterable[str] = (),
               min_bytes: int = 0) -> dict[str, Swap]:
    """The swaps whose copies both hide behind compute on ``hardware`` (none stalls the step).

    Args:
        exclude: tensors not to swap (recomputed ones, say).
        min_bytes: skip tensors smaller than this (each copy pays the link's latency).
    """
    if not hardware.async_copies:
        return {}  # every copy stalls the step: nothing is free
    start_s, end_s = _compute_times(graph)
    candidates = _candidates(graph, set(exclude), min_bytes, end_s)
    copied_out = _copies_out(candidates, hardware)
    return _copies_back(graph, candidates, copied_out, hardware, start_s, end_s)


def _compute_times(graph: CostGraph) -> tuple[list[float], list[float]]:
    start, end, clock = [], [], 0.0
    for op in graph.ops:
        start.append(clock)
        clock += op.time_s
        end.append(clock)
    return start, end


def _candidates(graph: CostGraph, exclude: set[str], min_bytes: int,
                end_s: list[float]) -> list[_Candidate]:
    """Forward values read by the backward pass, in order of production."""
    index = graph.index
    found = []
    for name, tensor in graph.tensors.items():
        if (tensor.producer is None or tensor.is_output or name in exclude
                or tensor.size_bytes < max(min_bytes, 1)
                or graph.op(tensor.producer).phase != "forward"):
            continue
        late = sorted((c for c in tensor.consumers if graph.op(c).phase != "forward"),
                      key=index.__getitem__)
        if late:
            found.append(_Candidate(name, tensor.size_bytes, end_s[index[tensor.producer]],
                                    index[late[0]], tuple(late)))
    return sorted(found, key=lambda c: (c.ready_s, c.tensor))


def _copies_out(candidates: list[_Candidate], hardware: Hardware) -> dict[str, float]:
    """When each copy out lands, the device-to-host stream a FIFO in production order."""
    landed, free_s = {}, 0.0
    for candidate in candidates:
        free_s = max(candidate.ready_s, free_s) + hardware.d2h_time_s(candidate.size_bytes)
        landed[candidate.tensor] = free_s
    return landed


def _copies_back(graph: CostGraph, candidates: list[_Candidate], copied_out: dict[str, float],
                 hardware: Hardware, start_s: list[float], end_s: list[float]) -> dict[str, Swap]:
    """Just-in-time copies back, in order of need; a copy that would land late is not made."""
    swaps: dict[str, Swap] = {}
    free_s = 0.0
    for candidate in sorted(candidates, key=lambda c: (c.need_index, c.ready_s)):
        duration_s = hardware.h2d_time_s(candidate.size_bytes)
        latest_s = start_s[candidate.need_index] - duration_s
        if latest_s < max(free_s, copied_out[candidate.tensor]):
            continue  # the link cannot have it back in time: a stall
        control = bisect.bisect_right(end_s, latest_s, hi=candidate.need_index) - 1
        if control < 0 or graph.ops[control].phase == "forward":
            continue  # it would have to come back during the forward pass: nothing to gain
        begin_s = max(end_s[control], free_s, copied_out[candidate.tensor])
        free_s = begin_s + duration_s
        swaps[candidate.tensor] = Swap(
            (SwapIn(graph.ops[control].name, candidate.consumers),), reason="free on the link")
    return swaps
