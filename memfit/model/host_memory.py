"""Host memory a plan takes: what is swapped out and not yet freed, and keeping it under a limit.

A swapped tensor's host copy is made by its swap-out, right after its producer, and freed after
its last swap-in (the rewritten graph drops the host buffer after its last reader, as
``memfit.model.schedule.lower`` orders the actions). By op position its copy so lives from its
producer to its last swap-in's control op, both included; ``lower`` puts an op's swap-outs before
the swap-ins issued after it, so two copies that share an end position are on the host together
there. The host peak is the largest sum of sizes over those intervals.

``Hardware.host_bytes`` limits it. Strategies that pick swaps one by one add them in their own
order of preference while the host peak stays within the limit (``within_host``, or
``host_prefix`` for a strategy that swaps the first ``n`` of a list), so a tight host limit gives
a plan that keeps (or, in ``auto``, recomputes) what did not fit instead of an error.

Torch-free: numpy over op positions, one array per plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.data.plan import Decision, Plan, Swap


class HostInterval(NamedTuple):
    """A host copy: on the host from op position ``start`` to ``end``, both included."""

    start: int
    end: int
    size_bytes: int


def host_interval(graph: CostGraph, tensor: str, swap: Swap) -> HostInterval:
    """Where ``tensor``'s host copy lives under ``swap`` (producer to last swap-in's control op)."""
    index = graph.index
    start = index[str(graph.tensors[tensor].producer)]  # swapped tensors have a producer
    end = max(start, *(index[swap_in.after] for swap_in in swap.swap_ins))
    return HostInterval(start, end, graph.tensors[tensor].size_bytes)


def host_usage(graph: CostGraph, decisions: Mapping[str, Decision]) -> np.ndarray:
    """Bytes on the host at each op position (its swap-outs and swap-ins included)."""
    change = np.zeros(len(graph.ops) + 1, np.int64)
    for tensor, decision in decisions.items():
        if isinstance(decision, Swap):
            start, end, size = host_interval(graph, tensor, decision)
            change[start] += size
            change[end + 1] -= size
    return np.cumsum(change[:-1])


def host_peak_bytes(graph: CostGraph, plan: Plan) -> int:
    """The most bytes ``plan`` holds on the host at once (0 for a plan that swaps nothing)."""
    if not plan.swapped:
        return 0
    return int(host_usage(graph, plan.decisions).max(initial=0))


class _HostBook:
    """Host bytes per op position of the swaps accepted so far."""

    def __init__(self, graph: CostGraph, host_bytes: int):
        self.graph, self.host_bytes = graph, host_bytes
        self.usage = np.zeros(len(graph.ops), np.int64)

    def admit(self, tensor: str, swap: Swap) -> bool:
        """Add the swap if the host stays within the limit with it; whether it was added."""
        start, end, size = host_interval(self.graph, tensor, swap)
        span = self.usage[start:end + 1]
        if int(span.max(initial=0)) + size > self.host_bytes:
            return False
        span += size
        return True


def within_host(graph: CostGraph, decisions: Mapping[str, Decision],
                host_bytes: int | None) -> tuple[dict[str, Decision], tuple[str, ...]]:
    """``decisions`` with the swaps that would take the host past ``host_bytes`` dropped (those
    tensors are kept), trying the swaps in the mapping's order; and the names dropped.

    Why greedy in the strategy's order: each strategy lists its swaps most useful first (vDNN's
    layers from the input, the link's free swaps in order of production), so stopping before
    the limit keeps the ones it would have picked first. ``None``: no limit, nothing dropped.
    """
    if host_bytes is None or _total_bytes(graph, decisions.items()) <= host_bytes:
        return dict(decisions), ()
    book = _HostBook(graph, host_bytes)
    kept: dict[str, Decision] = {}
    dropped: list[str] = []
    for tensor, decision in decisions.items():
        if isinstance(decision, Swap) and not book.admit(tensor, decision):
            dropped.append(tensor)
            continue
        kept[tensor] = decision
    return kept, tuple(dropped)


def host_prefix(graph: CostGraph, swaps: Sequence[tuple[str, Swap]], host_bytes: int | None) -> int:
    """How many of ``swaps``, taken from the first, fit ``host_bytes`` together (all: no limit).

    For strategies whose knob is "swap the first ``n``" (TFLMS's ``n_tensors``): the host peak
    only grows with ``n``, so the longest prefix that fits bounds ``n``.
    """
    if host_bytes is None or _total_bytes(graph, swaps) <= host_bytes:
        return len(swaps)
    book = _HostBook(graph, host_bytes)
    for count, (tensor, swap) in enumerate(swaps):
        if not book.admit(tensor, swap):
            return count
    return len(swaps)


def _total_bytes(graph: CostGraph, decisions: Iterable[tuple[str, Decision]]) -> int:
    """Every swapped tensor's bytes: the host peak is at most this, so a limit above it binds
    nothing (the common case, checked before any interval)."""
    return sum(graph.tensors[name].size_bytes for name, decision in decisions
               if isinstance(decision, Swap))


def over_host(host_peak: int, host_bytes: int | None) -> bool:
    """Whether a host peak exceeds the limit (``None``: no limit)."""
    return host_bytes is not None and host_peak > host_bytes

