"""Swaps the link carries for free: the hybrid planner's swap half.

A swap costs nothing while its two copies hide behind compute: the copy out must run on the
device-to-host stream after its producer, the copy back on the host-to-device stream after the
copy out and before the first backward reader, and each stream is a FIFO (one stream for both
directions on a half-duplex link). This module replays those queues on the unplanned compute
timeline (op times back to back, ``BaseProfile.compute_clock``) with the memory model's queue
(``memfit.model.clock.CopyLink``, the one ``simulate``'s clock and ``step_time_s`` follow), copies
out in program order as ``lower`` issues them, and keeps a tensor only if both copies fit with no
stall. Copies back are issued as late as they can be (just in
time, after the last backward op that ends early enough) so each copy on the device lives
briefly: prefetching earlier would only raise the backward pass's memory.

Candidates go in order of production (program order: producer, then its outputs' order): the
earliest forward values have the whole rest of the forward pass to leave, and the backward pass
reads them last.

Given a recompute plan's re-runs, a value that re-runs read (a checkpoint) is needed by the first
of them, and the copy back names the re-run ops (``SwapIn`` then feeds their re-runs): the
checkpoints a recompute plan keeps leave the device during the forward pass, when the link is
idle, and come back just before the re-runs that rebuild from them (Capuchin's swap + recompute).
The re-runs' time is on the compute timeline, which only gives the copies more room.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Swap, SwapIn
from memfit.model.clock import CopyLink
from memfit.model.host_memory import within_host
from memfit.model.profile import BaseProfile
from memfit.model.recompute import PlannedRerun


@dataclass(frozen=True)
class _SwapCandidate:
    tensor: str
    size_bytes: int
    ready_s: float  # its producer's end
    issued: tuple[int, int]  # its copy out's place in program order: (producer, output rank)
    need_index: int  # its first backward reader
    consumers: tuple[str, ...]  # its backward readers, and forward readers re-run later


def free_swaps(graph: CostGraph, hardware: Hardware, exclude: Iterable[str] = (),
               min_bytes: int = 0,
               reruns: Mapping[str, Sequence[PlannedRerun]] | None = None,
               packed: bool = False) -> dict[str, Swap]:
    """The swaps whose copies both hide behind compute on ``hardware`` (none stalls the step).

    Args:
        exclude: tensors not to swap (recomputed ones, say).
        min_bytes: skip tensors smaller than this (each copy pays the link's latency).
        reruns: a recompute plan's re-runs (``planned_reruns``) to swap alongside: values they
            read come back before the first of them, for them. ``None`` (default): no re-runs.
        packed: queue out only values that can come back in time, and pack the copies back
            as late as the link allows, latest need first (``_copies_back_packed``): more bytes
            where the link is the bottleneck (the recomputation's budget relaxes by several
            times more on a large model over PCIe). ``False`` (default): every
            candidate queued out, each copy back just in time in order of need, skipping one
            the link cannot fit behind the previous one. On a half-duplex link both modes
            queue out only values that can come back: every copy back waits for every copy
            out, so a copy out that cannot come back would only delay them all.

    Swaps that would hold more than ``hardware.host_bytes`` on the host at once are left out
    (admitted in order of production).
    """
    if not hardware.async_copies:
        return {}  # every copy stalls the step: nothing is free
    reruns = reruns or {}
    start_s, end_s = BaseProfile.of(graph).compute_clock(reruns)
    candidates = _candidates(graph, set(exclude), min_bytes, end_s, _rerun_needs(graph, reruns))
    backward_s = next((start_s[i] for i, op in enumerate(graph.ops) if op.phase != "forward"),
                      end_s[-1] if end_s else 0.0)
    link = CopyLink(hardware)
    copied_out = _copies_out(candidates, link, start_s,
                             backward_s if packed or not hardware.duplex else None)
    back = _copies_back_packed if packed else _copies_back
    swaps = back(graph, [c for c in candidates if c.tensor in copied_out], copied_out, link,
                 start_s, end_s)
    return _within_host(graph, candidates, swaps, hardware.host_bytes)


def _within_host(graph: CostGraph, candidates: list[_SwapCandidate], swaps: dict[str, Swap],
                 host_bytes: int | None) -> dict[str, Swap]:
    """``swaps`` less those that would take the host past ``host_bytes``, admitted in order of
    production (as the link queues them out); the order of issue kept. Dropping a swap frees
    the link for the others, so the rest stay free."""
    in_production = {c.tensor: swaps[c.tensor] for c in candidates if c.tensor in swaps}
    kept, _ = within_host(graph, in_production, host_bytes)
    return {tensor: swap for tensor, swap in swaps.items() if tensor in kept}


def _rerun_needs(graph: CostGraph, reruns: Mapping[str, Sequence[PlannedRerun]]
                 ) -> dict[str, int]:
    """Forward op -> the position of the op its first re-run is placed before."""
    first: dict[str, int] = {}
    for before, group in reruns.items():
        for rerun in group:
            at = graph.index[before]
            if at < first.get(rerun.op, len(graph.ops)):
                first[rerun.op] = at
    return first


def _candidates(graph: CostGraph, exclude: set[str], min_bytes: int, end_s: list[float],
                rerun_needs: dict[str, int]) -> list[_SwapCandidate]:
    """Forward values read by the backward pass or by re-runs, in order of production."""
    index = graph.index
    found = []
    for name, tensor in graph.tensors.items():
        if (tensor.producer is None or tensor.is_output or name in exclude
                or tensor.size_bytes < max(min_bytes, 1)
                or graph.op(tensor.producer).phase != "forward"):
            continue
        late = sorted((c for c in tensor.consumers if graph.op(c).phase != "forward"),
                      key=index.__getitem__)
        rerun = sorted((c for c in tensor.consumers if c in rerun_needs), key=index.__getitem__)
        needs = [index[c] for c in late[:1]] + [rerun_needs[c] for c in rerun]
        if needs:
            producer = graph.op(tensor.producer)
            found.append(_SwapCandidate(name, tensor.size_bytes, end_s[index[producer.name]],
                                        (index[producer.name], producer.outputs.index(name)),
                                        min(needs), (*rerun, *late)))
    return sorted(found, key=lambda c: c.issued)


def _copies_out(candidates: list[_SwapCandidate], link: CopyLink, start_s: list[float],
                backward_s: float | None) -> dict[str, float]:
    """When each copy out lands, queued on ``link`` in production order.

    Given ``backward_s`` (when the backward pass starts), a value that could not come back in
    time even on an idle link (or only by a copy issued in the forward pass) is not copied
    out: its copy would only delay the others'. ``None``: every candidate is queued (the
    hybrid's conservative queue, which its budget shares were tuned with).
    """
    landed = {}
    for candidate in candidates:
        end_s = link.out_landing_s(candidate.ready_s, candidate.size_bytes)
        latest_s = start_s[candidate.need_index] - link.hardware.h2d_time_s(candidate.size_bytes)
        if backward_s is not None and (latest_s < end_s or latest_s <= backward_s):
            continue
        landed[candidate.tensor] = link.copy_out(candidate.ready_s, candidate.size_bytes)
    return landed


def _copies_back(graph: CostGraph, candidates: list[_SwapCandidate], copied_out: dict[str, float],
                 link: CopyLink, start_s: list[float], end_s: list[float]) -> dict[str, Swap]:
    """Just-in-time copies back, queued on ``link`` after the copies out, in order of need; a
    copy that would land late is not made."""
    swaps: dict[str, Swap] = {}
    for candidate in sorted(candidates, key=lambda c: (c.need_index, c.ready_s)):
        latest_s = start_s[candidate.need_index] - link.hardware.h2d_time_s(candidate.size_bytes)
        if latest_s < max(link.in_free_s, copied_out[candidate.tensor]):
            continue  # the link cannot have it back in time: a stall
        control = bisect.bisect_right(end_s, latest_s, hi=candidate.need_index) - 1
        if control < 0 or graph.ops[control].phase == "forward":
            continue  # it would have to come back during the forward pass: nothing to gain
        link.copy_in(max(end_s[control], copied_out[candidate.tensor]), candidate.size_bytes)
        swaps[candidate.tensor] = Swap(
            (SwapIn(graph.ops[control].name, candidate.consumers),), reason="free on the link")
    return swaps


def _copies_back_packed(graph: CostGraph, candidates: list[_SwapCandidate],
                        copied_out: dict[str, float], link: CopyLink, start_s: list[float],
                        end_s: list[float]) -> dict[str, Swap]:
    """Copies back packed as late as the link allows, latest need first: where the link is the
    bottleneck, it stays busy right up to each need, and the values needed last (off the device
    longest) are the ones kept.

    Note:
        The stream is a FIFO in program order, and each copy is issued after its control op,
        which ends no later than the planned start; by induction every copy then starts (and
        lands) no later than planned, so none stalls. On a half-duplex link every copy back
        also waits for the copies out queued before it (``link.in_free_s``: all of them, as
        they are issued in the forward pass), so none is planned to start earlier.
    """
    swaps: dict[str, Swap] = {}
    next_begin_s = float("inf")  # the planned start of the copy issued after this one
    for candidate in sorted(candidates, key=lambda c: (c.need_index, c.ready_s), reverse=True):
        duration_s = link.hardware.h2d_time_s(candidate.size_bytes)
        begin_s = min(start_s[candidate.need_index], next_begin_s) - duration_s
        if begin_s < max(copied_out[candidate.tensor], link.in_free_s):
            continue  # not on the host yet, or the link busy copying out: it would land late
        control = bisect.bisect_right(end_s, begin_s, hi=candidate.need_index) - 1
        if control < 0 or graph.ops[control].phase == "forward":
            continue  # it would have to come back during the forward pass: nothing to gain
        next_begin_s = begin_s
        swaps[candidate.tensor] = Swap(
            (SwapIn(graph.ops[control].name, candidate.consumers),), reason="free on the link")
    # in order of issue: copies after one control op are issued in the plan's order
    return dict(reversed(swaps.items()))
