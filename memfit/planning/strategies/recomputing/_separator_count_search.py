"""How many separators ``checkpoints="memory"`` keeps under a budget, found without pricing all.

Every count of evenly spaced separators is a plan (recompute every forward tensor but the
kept separators); with a budget the mode wants the count that fits with the least recompute
time. Pricing one count exactly (the memory model, ``BaseProfile.recomputes``) walks its
re-runs, and a long step has a thousand counts, so pricing all of them would dominate planning.
Two cheap lower bounds per count make it a branch and bound, with the same answer as pricing all:

- time: every producer of a recomputed tensor that a backward op reads is re-run, so the sum of
  their times is at most the plan's recompute time (re-runs that rebuild inputs of re-runs
  come on top);
- peak: right after the last forward op a recomputed tensor is already freed and a kept one is
  still live, so the Keep plan's live bytes there, less the recomputed ones live there, is at
  most the plan's peak. Both figures are the incremental memory model's
  (``memfit.model.profile.BaseProfile``: ``live_after`` and the Keep lifetimes), not a copy.

Counts are priced in order of their time bound, skipping those whose peak bound is over the
budget, until the bound passes the best time that fits. Once one fits, a count is priced only if
its exact recompute time (``BaseProfile.rerun_time_s``: which producers re-run, without the
lifetimes, a fraction of the cost) does not rule it out: where the bounds are loose (a deep
transformer, whose rebuilds re-run chains of cheap ops), pricing every count would dominate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memfit.model import separators
from memfit.model.profile import BaseProfile
from memfit.model.rerun_delta import FoldedProfile


def kept_tensors(held: Sequence[frozenset[str]], count: int) -> set[str]:
    """What ``count`` evenly spaced separators keep, given what each separator holds."""
    return set().union(*separators.evenly_spaced(held, min(count, len(held))))


class CountBounds:
    """Lower bounds on the recompute time and the peak of each count's plan.

    When no two separators hold the same tensor and no producer's late outputs are spread over
    two separators (a chain's articulation points, a ResNet's block outputs), each separator's
    share of both bounds is its own, and the bounds of all counts are sums over arrays (pricing
    each count's kept set one by one would be quadratic in the chain's length).

    Args:
        droppable: the tensors a count recomputes unless its separators keep them.
        held: per separator candidate, in order, the tensors it holds.
    """

    def __init__(self, model: BaseProfile, droppable: frozenset[str],
                 held: Sequence[frozenset[str]]) -> None:
        graph = model.graph
        self.model, self.droppable, self.held = model, droppable, tuple(held)
        late = model.first_late_reader
        self._late_outputs = {  # producer -> its droppable outputs a backward op reads
            op.name: frozenset(t for t in op.outputs if t in droppable and t in late)
            for op in graph.forward_ops
        }
        self._all_time_s = sum(graph.op(p).time_s for p, o in self._late_outputs.items() if o)
        boundary = max(graph.index[op.name] for op in graph.forward_ops)
        self._live_at_boundary = model.live_across(droppable, boundary)
        self._all_peak_bytes = int(model.live_after[boundary]) - self._bytes(self._live_at_boundary)
        self._shares = self._separable_shares()

    def kept(self, count: int) -> set[str]:
        return kept_tensors(self.held, count)

    def recomputed(self, count: int) -> frozenset[str]:
        return self.droppable - self.kept(count)

    def priced(self, recomputed: frozenset[str]) -> FoldedProfile:
        """The plan recomputing ``recomputed``, priced exactly by the memory model."""
        return self.model.folded(self.model.recomputes(recomputed))

    def time_s(self, count: int) -> float:
        """At most the recompute time of ``count``'s plan."""
        if self._shares is not None:
            spared_s = float(self._shares[0][self._positions(count)].sum())
            remaining_s = self._all_time_s - spared_s
            return remaining_s if remaining_s > 1e-12 * self._all_time_s else 0.0  # rounding
        kept = self.kept(count)
        spared = {self.model.graph.tensors[t].producer for t in kept if t in self.droppable}
        return self._all_time_s - sum(
            self.model.graph.op(p).time_s for p in spared
            if p is not None and self._late_outputs.get(p) and self._late_outputs[p] <= kept
        )

    def peak_bytes(self, count: int) -> int:
        """At most the peak of ``count``'s plan."""
        if self._shares is not None:
            return self._all_peak_bytes + int(self._shares[1][self._positions(count)].sum())
        return self._all_peak_bytes + self._bytes(self.kept(count) & self._live_at_boundary)

    def _positions(self, count: int) -> np.ndarray:
        return separators.evenly_spaced_positions(len(self.held), count)

    def _separable_shares(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Per separator, the recompute time it spares and its bytes live at the boundary; or
        ``None`` when separators share tensors or producers (their shares would not add up)."""
        owner: dict[str, int] = {}
        for number, tensors in enumerate(self.held):
            for tensor in tensors:
                if owner.setdefault(tensor, number) != number:
                    return None
        graph = self.model.graph
        spared_s = np.zeros(len(self.held))
        for producer, outputs in self._late_outputs.items():
            holders = {owner[t] for t in outputs if t in owner}
            if len(holders) > 1:
                return None
            if holders and outputs <= owner.keys():  # all kept by one separator
                spared_s[holders.pop()] += graph.op(producer).time_s
        live_bytes = np.zeros(len(self.held), dtype=np.int64)
        for tensor in self._live_at_boundary:
            if tensor in owner:
                live_bytes[owner[tensor]] += graph.tensors[tensor].size_bytes
        return spared_s, live_bytes

    def _bytes(self, tensors: set[str]) -> int:
        return sum(self.model.graph.tensors[t].size_bytes for t in tensors)


def least_recompute_fitting(bounds: CountBounds, counts: Sequence[int],
                            budget_bytes: int) -> int | None:
    """The count whose plan fits ``budget_bytes`` with the least recompute time (ties: the
    smaller count), or ``None``."""
    time_bound = {count: bounds.time_s(count) for count in counts}
    best: tuple[float, int] | None = None
    for count in sorted(counts, key=time_bound.__getitem__):
        if best is not None and time_bound[count] > best[0] * (1 + 1e-9):
            break  # no later count can be faster
        if bounds.peak_bytes(count) > budget_bytes:
            continue
        recomputed = bounds.recomputed(count)
        if best is not None and _slower(bounds.model.rerun_time_s(recomputed), best[0]):
            continue  # priced exactly, it could not win: its re-runs alone take longer
        profile = bounds.priced(recomputed)
        if profile.peak_bytes <= budget_bytes and (best is None
                                                   or (profile.recompute_s, count) < best):
            best = (profile.recompute_s, count)
    return best[1] if best else None


def _slower(recompute_s: float, best_s: float) -> bool:
    """Whether a plan whose re-runs take ``recompute_s`` (summed in another order than the
    profile's, so to rounding) is surely slower than ``best_s``: the same slack as the bound's."""
    return recompute_s * (1 - 1e-12) > best_s * (1 + 1e-9)


def lowest_peak(bounds: CountBounds, counts: Sequence[int]) -> int:
    """The count whose plan has the lowest peak (ties: less recompute, then the smaller count)."""
    peak_bound = {count: bounds.peak_bytes(count) for count in counts}
    smallest: tuple[int, float, int] | None = None
    for count in sorted(counts, key=peak_bound.__getitem__):
        if smallest is not None and peak_bound[count] > smallest[0]:
            break
        profile = bounds.priced(bounds.recomputed(count))
        if smallest is None or (profile.peak_bytes, profile.recompute_s, count) < smallest:
            smallest = (profile.peak_bytes, profile.recompute_s, count)
    assert smallest is not None, "no counts"
    return smallest[2]
