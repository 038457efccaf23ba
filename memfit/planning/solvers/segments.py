"""Least recomputation under a byte budget for whole captured steps: a DP over separator blocks.

Checkmate's MILP (``memfit.planning.solvers.milp``) is exact but has one binary per (stage, op) pair, so
it stops at a few hundred ops; a captured transformer or ResNet step has a thousand. This reduces
the step to a chain, as the gradient-checkpointing article does: nested graph separators cut the
forward pass into *blocks*, and a plan is a split of the blocks into *segments*. A segment is
either kept whole, or rebuilt in one go from the kept separator before it, recomputing all its
tensors (``"all"``: Chen's sqrt(n) segments) or only the cheap ones (``"cheap"``: matmul, conv
and attention outputs inside stay kept, the openai package's "speed" mode inside one segment).

Pricing. Every candidate segment is priced once, exactly, by the memory model
(``BaseProfile``: the change to the Keep profile of the plan that recomputes that segment alone): its recompute time, its ``need`` (the
highest live bytes at the positions its blocks own: their forward ops, and the backward ops and
re-runs that read their tensors) and its ``carried`` change (the most it adds to memory while
other blocks run; negative: the bytes it frees). Since a kept separator cuts every path, the
profile of a whole plan is the Keep profile plus each segment's change, and at a position owned
by segment ``s`` the segments before ``s`` contribute their carried change. So a plan fits when,
for every segment, ``need + sum(carried of the segments before it) <= budget``: a knapsack-like
chain DP over (block, carried bytes) with Pareto fronts, no discretisation of the budget.

The decomposition is exact when segments touch only their own positions; where a graph breaks
that (a value read across a separator in the backward pass only), the optimal-recompute strategy
checks the assembled plan with the exact memory model and tightens the budget by the excess until it
fits (``memfit.planning.tighten``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.model import separators
from memfit.model.plan_memo import remembered_result
from memfit.model.profile import BaseProfile

OPTIONS = ("all", "cheap")


@dataclass(frozen=True)
class Blocks:
    """The forward pass cut at nested separators.

    Args:
        separators: the cuts, input side first; block ``b`` ends with ``separators[b]`` and the
            last block (``len(separators)``) holds the loss.
        droppable: per block, the storages a segment may recompute: made by the block's forward
            ops, not its closing separator's, not step outputs, not made from data alone.
        closing: per block, the storages its closing separator holds (neighbouring separator
            sets may share some: a tower that did not advance between two cuts).
        owner: per op of the graph, the block whose segment prices that position.
    """

    separators: tuple[tuple[str, ...], ...]
    droppable: tuple[frozenset[str], ...]
    closing: tuple[frozenset[str], ...]
    owner: np.ndarray

    @property
    def count(self) -> int:
        return len(self.droppable)


@dataclass(frozen=True, eq=False)
class Segment:
    """Blocks ``first..last`` recomputed with ``option`` (``"keep"``: nothing recomputed).

    Args:
        need_bytes: the most bytes live at the positions the segment owns (see module note).
        carried_bytes: the most it changes memory at positions later segments own.
        own_positions, own_delta: the ops the segment owns and what it adds to the base
            profile there (``need_bytes`` is their most on top of the Keep plan's).
        touched: the tensors it recomputes or its re-runs read; a base plan that swaps one
            of them cannot take this segment.
    """

    first: int
    last: int
    option: str
    recomputed: frozenset[str]
    recompute_s: float
    need_bytes: int
    carried_bytes: int
    own_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    own_delta: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    touched: frozenset[str] = frozenset()


def find_blocks(graph: CostGraph, max_blocks: int | None = None) -> Blocks:
    """Cut the forward pass at nested separator sets (``separators.separator_sets``).

    Args:
        max_blocks: merge neighbouring blocks (dropping the separators between the blocks with
            the fewest droppable bytes) until at most this many remain; the table of segments
            grows with its square.
    """
    undirected = separators.separation_graph(graph)
    nested, entered = _nested(undirected, separators.separator_sets(graph))
    storage_owner = separators.op_storage_owners(graph)
    block_of = _block_of_storage_owner(undirected, entered, range(len(nested)))
    if max_blocks is not None and len(nested) + 1 > max_blocks:
        keep = _thinned(graph, nested, storage_owner, block_of, max_blocks - 1)
        nested = [nested[i] for i in keep]
        block_of = _block_of_storage_owner(undirected, entered, keep)
    count = len(nested) + 1
    op_block = {
        op.name: block_of[owner]
        for op in graph.forward_ops
        if (owner := storage_owner[op.name]) is not None and owner in block_of
    }
    droppable: list[set[str]] = [set() for _ in range(count)]
    closing: list[set[str]] = [set() for _ in range(count)]
    for number, separator in enumerate(nested):
        for name in separator:
            closing[number] |= {t for t in graph.op(name).outputs if not graph.tensors[t].is_output}
    for op in graph.forward_ops:
        block = op_block.get(op.name)
        if block is None:
            continue
        for tensor in op.outputs:
            if not graph.tensors[tensor].is_output and tensor not in closing[block]:
                droppable[block].add(tensor)
    return Blocks(tuple(nested), tuple(frozenset(d) for d in droppable),
                  tuple(frozenset(c) for c in closing), _position_owners(graph, op_block))


def _nested(undirected: nx.Graph, candidates: Sequence[tuple[str, ...]]
            ) -> tuple[list[tuple[str, ...]], dict[str, int]]:
    """The candidates that form a chain of cuts, each strictly further from the input, and per
    node the first of them whose closure holds it.

    A candidate's closure is the input's component once its ops are removed, plus its ops.
    Closures grow along the chain, so each is found by growing the last accepted one's
    interior (``_grown``), and a closure is never copied: ``entered`` holds them all (node ->
    the first cut whose closure holds it): a whole-graph search or a copy per candidate would be
    quadratic in the chain's length.
    """
    nested: list[tuple[str, ...]] = []
    entered: dict[str, int] = {}  # the last accepted closure is entered's keys
    interior: set[str] = set()  # the input's component without the last accepted cut
    for separator in candidates:
        if separators.INPUT in separator:
            continue
        previous = nested[-1] if nested else ()
        added, whole = _grown(undirected, interior, previous, separator)
        members = set(separator)
        fresh = [n for n in (*added, *separator) if n not in entered]
        if separators.LOSS in added or separators.LOSS in members or not fresh:
            continue  # reaches the loss, or is not strictly further
        # the last closure is the interior (kept when grown) and the previous cut
        if any(n not in added and n not in members and (whole or n not in interior)
               for n in (entered if whole else previous)):
            continue  # does not hold the last accepted closure
        for node in fresh:
            entered.setdefault(node, len(nested))
        nested.append(separator)
        if whole:
            interior = added
        else:
            interior.update(added)
    return nested, entered


def _grown(undirected: nx.Graph, interior: set[str], previous: Sequence[str],
           separator: Sequence[str]) -> tuple[set[str], bool]:
    """The input's component of ``undirected`` without ``separator``, grown from ``interior``
    (that component without ``previous``): the nodes it adds to ``interior``, and ``False``;
    or the whole component and ``True`` when it had to be searched from the input.

    The interior stays connected to the input when the new cut misses it, and its only
    neighbours are ``previous``'s ops: so the search starts from those of them the new cut
    leaves, and visits only what lies between the two cuts. A cut reaching into the interior
    gets a search from the input.
    """
    blocked = set(separator)
    if not interior or not blocked.isdisjoint(interior):
        return set(nx.node_connected_component(undirected.subgraph(set(undirected) - blocked),
                                               separators.INPUT)), True
    pending = [node for node in previous if node not in blocked
               and any(neighbour in interior for neighbour in undirected[node])]
    added = set(pending)
    while pending:
        node = pending.pop()
        for neighbour in undirected[node]:
            if neighbour not in interior and neighbour not in added and neighbour not in blocked:
                added.add(neighbour)
                pending.append(neighbour)
    return added, False


def _block_of_storage_owner(undirected: nx.Graph, entered: Mapping[str, int],
                            cuts: Sequence[int]) -> dict[str, int]:
    """Storage owner op (``separators.op_storage_owners``) -> the first block whose closure holds
    it (the last block otherwise), when the forward pass is cut at ``cuts`` (indices of
    ``_nested``'s cuts, in order)."""
    last = len(cuts)
    return {
        node: bisect.bisect_left(cuts, entered[node]) if node in entered else last
        for node in undirected if node not in (separators.INPUT, separators.LOSS)
    }


def _thinned(graph: CostGraph, nested: Sequence[tuple[str, ...]],
             storage_owner: Mapping[str, str | None], block_of: Mapping[str, int],
             cuts: int) -> list[int]:
    """Indices of ``cuts`` separators to keep: merge the lightest neighbouring blocks first.

    Blocks are merged in order of the bytes of the pair (ties: the pair nearer the input),
    found with a heap whose stale pairs are skipped (a linear scan per merge would be
    quadratic).
    """
    span_bytes = [0] * (len(nested) + 1)  # span (named by its first block) -> its bytes
    for op in graph.forward_ops:
        owner = storage_owner[op.name]
        if owner is not None and owner in block_of:
            span_bytes[block_of[owner]] += sum(graph.tensors[t].size_bytes for t in op.outputs)
    following = {span: span + 1 for span in range(len(nested))}  # span -> the span after it
    preceding = {span + 1: span for span in range(len(nested))}
    pairs = [(span_bytes[span] + span_bytes[span + 1], span) for span in range(len(nested))]
    heapq.heapify(pairs)
    kept = set(range(len(nested)))  # cut c lies between block c and block c + 1
    while len(kept) > max(cuts, 0):
        pair_bytes, span = heapq.heappop(pairs)
        after = following.get(span)
        if after is None or span_bytes[span] + span_bytes[after] != pair_bytes:
            continue  # stale: a neighbour was merged since
        kept.discard(after - 1)
        span_bytes[span] += span_bytes[after]
        preceding.pop(after)
        beyond = following.pop(after, None)
        if beyond is None:
            following.pop(span)
        else:
            following[span], preceding[beyond] = beyond, span
            heapq.heappush(pairs, (span_bytes[span] + span_bytes[beyond], span))
        if (before := preceding.get(span)) is not None:
            heapq.heappush(pairs, (span_bytes[before] + span_bytes[span], before))
    return sorted(kept)


def _position_owners(graph: CostGraph, op_block: Mapping[str, int]) -> np.ndarray:
    """Per op, the block pricing its position (see the module note)."""
    producer_block = {
        tensor: op_block[op.name]
        for op in graph.forward_ops if op.name in op_block for tensor in op.outputs
    }
    owner = np.zeros(len(graph.ops), dtype=np.int64)
    previous = 0
    for index, op in enumerate(graph.ops):
        if op.phase == "forward":
            previous = op_block.get(op.name, previous)
            owner[index] = previous
    following = 0
    for index in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[index]
        if op.phase == "forward":
            continue
        read = [producer_block[t] for t in op.inputs if t in producer_block]
        if read:
            following = max(read)
        owner[index] = following
    return owner


def segment_table(graph: CostGraph, blocks: Blocks, cheap_kept: Iterable[str],
                  max_length: int | None = None) -> list[Segment]:
    """Every candidate segment, priced (see the module note).

    Args:
        cheap_kept: the storages a ``"cheap"`` segment keeps (expensive ops' outputs).
        max_length: the longest segment in blocks (default: about twice sqrt(blocks), the
            article's segment length with room to spare: a longer ``"all"`` segment rebuilds
            more at once than it saves in kept separators). A ``"cheap"`` segment's rebuilds
            are short chains whose cost does not grow with its length, but two neighbouring
            ones price the same plan as one spanning both, save the separator between them:
            so the same bound loses little (rarely a plan that recomputes slightly more) and
            keeps the table near ``4 * blocks**1.5`` entries
            instead of ``blocks**2``.
    """
    pricing = _Pricing(BaseProfile.of(graph), blocks)
    cheap_kept = frozenset(cheap_kept)
    longest = max_length or max(4, math.ceil(2 * math.sqrt(blocks.count)) + 1)
    table: list[Segment] = []
    for first in range(blocks.count):
        table.append(pricing.priced(first, first, "keep", frozenset()))
        for last in range(first, min(first + longest, blocks.count)):
            everything = frozenset().union(
                *blocks.droppable[first: last + 1], *blocks.closing[first: last]
            ) - blocks.closing[last] - (blocks.closing[first - 1] if first else frozenset())
            for option, recomputed in (("all", everything), ("cheap", everything - cheap_kept)):
                if recomputed:
                    table.append(pricing.priced(first, last, option, recomputed))
    return table


class _Pricing:
    """Prices segments from the memory model's sparse reads (``BaseProfile.change_at`` and
    ``most_change`` of the segment's ``recomputes``): only the ops a segment owns are read, and
    the ops of later segments through the change's steps, so a segment costs its own tensors'
    walk, not a pass over the whole step (the table has ~1,300 segments on a 48-layer GPT-2).

    Args:
        model: the graph's memory model (the Keep plan's profile).
        blocks: the blocks the segments span.
    """

    def __init__(self, model: BaseProfile, blocks: Blocks) -> None:
        self.model, self.blocks = model, blocks
        owner = blocks.owner
        self._owned = [np.nonzero(owner == block)[0] for block in range(blocks.count)]
        # per last block: how many of ops 0..i-1 a later segment owns
        self._later = [np.concatenate(([0], np.cumsum(owner > last))) for last in range(blocks.count)]
        graph = model.graph  # tensor -> what its producer reads (a segment's re-runs read them)
        self._producer_inputs = {name: graph.op(t.producer).inputs
                                 for name, t in graph.tensors.items() if t.producer}

    def priced(self, first: int, last: int, option: str, recomputed: frozenset[str]) -> Segment:
        model = self.model
        own = np.sort(np.concatenate(self._owned[first: last + 1]))
        if recomputed:
            delta = model.recomputes(recomputed)
            own_delta, time_s = model.change_at(delta, own), delta.recompute_s
            carried = model.most_change(delta, self._later[last]) or 0
        else:
            own_delta, time_s, carried = np.zeros(len(own), dtype=np.int64), 0.0, 0
        need = int((model.high_bytes[own] + own_delta).max(initial=0))
        producer_inputs = self._producer_inputs
        read = set().union(*(producer_inputs[name] for name in recomputed
                             if name in producer_inputs))
        return Segment(first, last, option, recomputed, time_s, need, carried, own, own_delta,
                       frozenset(recomputed | read))


@dataclass
class _Front:
    """The DP states reaching one block, as parallel arrays: bytes carried in, recompute time
    so far, and how each was reached (the segment's index in the table, the state's index in
    the front of the segment's first block)."""

    carried_bytes: np.ndarray
    time_s: np.ndarray
    segment: np.ndarray
    previous: np.ndarray

    @classmethod
    def joined(cls, parts: list[_Front]) -> _Front:
        if not parts:
            return cls(*(np.zeros(0, dtype=kind) for kind in (np.int64, float, np.int64, np.int64)))
        return cls(*(np.concatenate([getattr(p, name) for p in parts])
                     for name in ("carried_bytes", "time_s", "segment", "previous")))


def solve_segments(table: Sequence[Segment], count: int, budget_bytes: int
                   ) -> tuple[Segment, ...] | None:
    """The segments covering blocks ``0..count-1`` with the least recompute time whose priced
    peak fits ``budget_bytes``; ``None`` if none does (once per table, count and budget inside
    ``memfit.model.plan_memo.plans_remembered``: the candidates of ``auto`` ask for the same
    budget more than once)."""
    return remembered_result("solve_segments", (table,), (count, budget_bytes),
                             lambda: _solved(table, count, budget_bytes))


def _solved(table: Sequence[Segment], count: int, budget_bytes: int
            ) -> tuple[Segment, ...] | None:
    starting: dict[int, list[int]] = {}
    for index, segment in enumerate(table):
        starting.setdefault(segment.first, []).append(index)
    arriving: list[list[_Front]] = [[] for _ in range(count + 1)]
    start = np.zeros(1, dtype=np.int64)
    arriving[0] = [_Front(start, np.zeros(1), start - 1, start - 1)]
    fronts: list[_Front] = []
    quantum = max(1, budget_bytes // 4096)  # carried bytes closer than this count as equal
    for first in range(count):
        front = _pareto(_Front.joined(arriving[first]), quantum)
        fronts.append(front)
        for index in starting.get(first, ()):
            segment = table[index]
            # a front is sorted by carried bytes: the states that fit are a prefix of it
            fits = int(np.searchsorted(front.carried_bytes, budget_bytes - segment.need_bytes,
                                       side="right"))
            if fits:
                arriving[segment.last + 1].append(_Front(
                    front.carried_bytes[:fits] + segment.carried_bytes,
                    front.time_s[:fits] + segment.recompute_s,
                    np.full(fits, index), np.arange(fits)))
    final = _Front.joined(arriving[count])
    if not final.time_s.size:
        return None
    best = int(np.argmin(final.time_s))
    chosen: list[Segment] = []
    segment_index, previous = int(final.segment[best]), int(final.previous[best])
    while segment_index >= 0:
        segment = table[segment_index]
        chosen.append(segment)
        front = fronts[segment.first]
        segment_index, previous = int(front.segment[previous]), int(front.previous[previous])
    return tuple(reversed(chosen))


def _pareto(states: _Front, quantum: int) -> _Front:
    """The states no other beats on both carried bytes (to within ``quantum``) and time.

    Of states whose carried bytes round up to the same multiple of ``quantum``, the fastest
    stands for all, with the rounded-up bytes: a little pessimistic, never over the budget.
    """
    if not states.time_s.size:
        return states
    bucket = -(-states.carried_bytes // quantum)
    order = np.argsort(bucket, kind="stable")  # within a bucket, in the states' order
    sorted_bucket, time_s = bucket[order], states.time_s[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_bucket[1:] != sorted_bucket[:-1])))
    fastest_s = np.minimum.reduceat(time_s, starts)  # per bucket, in bucket order
    group = np.repeat(np.arange(starts.size), np.diff(np.append(starts, time_s.size)))
    at_fastest = np.flatnonzero(time_s == fastest_s[group])
    first = at_fastest[np.concatenate(([True], group[at_fastest][1:] != group[at_fastest][:-1]))]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], fastest_s[:-1])))
    kept = order[first[fastest_s < best_before]]  # each bucket's first fastest state
    return _Front(bucket[kept] * quantum, states.time_s[kept], states.segment[kept],
                  states.previous[kept])
