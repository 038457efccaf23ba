"""Control ops for TFLMS swap-ins: the direct-order and chain-rule strategies (Algorithms 1 and 2).

A swap-in is issued right after its *control op*. The paper picks it from the ops that run before
the swap-in's first consumer (the *target*) and from which the target is reachable, within a
lower and an upper bound ``[lb, ub]``:

- **direct-order** walks back from the target in execution order: distance ``d = lb .. ub`` ops
  before it, and takes the first (latest) op that reaches the target. It gives up once it would
  go back to the tensor's producer.
- **chain-rule** walks *down* the forward phase from the producer by breadth-first search (level
  0 is the producer); at levels ``lb .. ub`` it looks at the backward ops that read the forward
  ops of that level directly (their gradients, by the chain rule), keeps those that run before the
  target and reach it, and stops at the first level that has one.

Note:
    Where the paper says "randomly get one item", we take the candidate with the largest index
    (the one closest before the target), so plans are deterministic. Like TFLMS's own code, the
    chain rule looks at a whole BFS level before picking, and it falls back to direct-order for a
    target that is not a backward op (a forward branch with ``swap_branches``): no backward op can
    run before a forward target.

    Ops are handled by their execution index throughout. Reachability ("the target is reachable
    from the candidate") uses one ancestor bitset per op, built once in a single pass in execution
    order (a Python int per op): a query is one bit test, and direct-order's "latest ancestor at
    least ``lb`` ops back" is one mask and ``bit_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from memfit.data.costgraph import CostGraph

CtrldStrategy = Literal["chain_rule", "direct_order"]
CTRLD_STRATEGIES: tuple[CtrldStrategy, ...] = ("chain_rule", "direct_order")
EXHAUSTED = -1  # ``OpGraph.chain_level``: the BFS ran out of forward ops (no op has index -1)


@dataclass(frozen=True)
class Control:
    """The op a swap-in is issued after, and how it was found (for the decision's reason)."""

    index: int
    how: Literal["found", "clamped", "fallback"]


class OpGraph:
    """Index-based adjacency of a ``CostGraph`` for the control-op searches, built once per plan."""

    def __init__(self, graph: CostGraph):
        self.graph = graph
        self.index = graph.index
        self.phase = tuple(op.phase for op in graph.ops)
        users = graph.users
        self.forward_users: list[list[int]] = []
        self.backward_users: list[list[int]] = []
        for op in graph.ops:
            found = [self.index[user] for user in users[op.name]]
            self.forward_users.append([u for u in found if self.phase[u] == "forward"])
            self.backward_users.append([u for u in found if self.phase[u] == "backward"])
        # (producer, target, level) -> the level's latest candidate, None, or _EXHAUSTED
        self._chain_levels: dict[tuple[int, int, int], int | None] = {}

    @cached_property
    def ancestors(self) -> list[int]:
        """Bit ``j`` of ``ancestors[i]`` is set when op ``i`` is reachable from op ``j`` (or j == i)."""
        bits: list[int] = []
        for position, op in enumerate(self.graph.ops):
            mask = 1 << position
            for dependency in op.depends_on:
                mask |= bits[self.index[dependency]]
            bits.append(mask)
        return bits

    def reaches(self, source: int, target: int) -> bool:
        return bool(self.ancestors[target] >> source & 1)

    @cached_property
    def _levels(self) -> ForwardLevels:
        return ForwardLevels(self)

    def forward_level(self, producer: int, level: int) -> list[int]:
        """The forward ops ``level`` edges below forward op ``producer`` (see ``ForwardLevels``)."""
        return self._levels.level(producer, level)

    def chain_level(self, producer: int, target: int, level: int) -> int | None:
        """The latest backward reader of an op ``level`` edges below ``producer`` that runs
        between ``producer`` and ``target`` and reaches ``target`` (``None``: none), or
        ``EXHAUSTED`` when that level is empty.

        Remembered: the swap tuner asks for the same swap-ins at every rung of its lb ladder,
        and each rung walks from its lb down, so without it a swap-in whose walk finds nothing
        went down the whole forward pass once per rung (on a 48-layer GPT-2, a third of auto's
        planning time).
        """
        key = (producer, target, level)
        if key not in self._chain_levels:
            self._chain_levels[key] = self._chain_candidate(producer, target, level)
        return self._chain_levels[key]

    def _chain_candidate(self, producer: int, target: int, level: int) -> int | None:
        frontier = self.forward_level(producer, level)
        if not frontier:
            return EXHAUSTED
        backward_users, ancestors = self.backward_users, self.ancestors[target]
        return max((user for op in frontier for user in backward_users[op]
                    if producer < user < target and ancestors >> user & 1), default=None)


class ForwardLevels:
    """Breadth-first levels below every forward op at once, one level at a time, on demand.

    Level 0 of a forward op is the op itself; level ``L + 1`` holds the forward users of level
    ``L`` that no earlier level holds (BFS levels are shortest distances). All searches advance
    together in numpy, so the tuner's ladder of lbs costs a few array operations per level rather
    than a Python loop per op and level (its chain-rule walks go hundreds of levels deep on
    10,000-op graphs).

    Note:
        Memory: an n x n bitmap of visited pairs for n forward ops (100 MB at n = 10,000) plus the
        levels built so far.
    """

    def __init__(self, ops: OpGraph):
        self.forward = np.array([i for i, phase in enumerate(ops.phase) if phase == "forward"],
                                dtype=np.int64)
        self.position = {int(op): k for k, op in enumerate(self.forward)}
        users = [[self.position[u] for u in ops.forward_users[int(op)]] for op in self.forward]
        self.starts = np.cumsum([0] + [len(u) for u in users], dtype=np.int64)
        self.users = np.array([u for found in users for u in found], dtype=np.int64)
        count = len(self.forward)
        self.seen = np.eye(count, dtype=bool)  # seen[search, op]
        everyone = np.arange(count, dtype=np.int64)
        # per level: the ops found, grouped by search, and where each search's group starts
        self.levels: list[tuple[np.ndarray, np.ndarray]] = [(everyone, np.arange(count + 1))]
        self._last = everyone  # the search of each op found at the deepest level

    def level(self, producer: int, level: int) -> list[int]:
        while len(self.levels) <= level and self.levels[-1][0].size:
            self._extend()
        if level >= len(self.levels):
            return []
        found, bounds = self.levels[level]
        k = self.position[producer]
        return self.forward[found[bounds[k]:bounds[k + 1]]].tolist()

    def _extend(self) -> None:
        searches, ops = self._last, self.levels[-1][0]
        degree = self.starts[ops + 1] - self.starts[ops]
        total = int(degree.sum())
        first = np.repeat(self.starts[ops] - (np.cumsum(degree) - degree), degree)
        users = self.users[first + np.arange(total, dtype=np.int64)]
        searches = np.repeat(searches, degree)
        fresh = ~self.seen[searches, users]
        codes = _sorted_unique(searches[fresh] * len(self.forward) + users[fresh])  # by search, op
        searches, users = np.divmod(codes, len(self.forward))
        self.seen[searches, users] = True
        bounds = np.searchsorted(searches, np.arange(len(self.forward) + 1))
        self.levels.append((users, bounds))
        self._last = searches


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by a sort: numpy 2's hash-based ``unique`` is several times slower
    on the level arrays of a deep model, where it would dominate building the levels."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def direct_order(ops: OpGraph, producer: int, target: int, lb: int, ub: int) -> int | None:
    """Algorithm 1: the latest op ``lb .. ub`` ops before ``target`` that reaches it, after ``producer``."""
    highest = target - max(lb, 1)  # the target itself cannot control its own swap-in
    lowest = max(target - ub, producer + 1)
    if highest < lowest:
        return None
    found = (ops.ancestors[target] & ((1 << (highest + 1)) - 1)).bit_length() - 1
    return found if found >= lowest else None


def chain_rule(ops: OpGraph, producer: int, target: int, lb: int, ub: int) -> int | None:
    """Algorithm 2: BFS down the forward ops from ``producer``; at levels ``lb .. ub``, the latest
    backward reader of a level's op that runs before ``target`` and reaches it."""
    if ops.phase[target] != "backward":
        return direct_order(ops, producer, target, lb, ub)
    for level in range(lb, ub + 1):
        found = ops.chain_level(producer, target, level)
        if found is not None:
            return None if found == EXHAUSTED else found
    return None


def control_op(ops: OpGraph, strategy: CtrldStrategy, producer: int, floor: int, target: int,
               lb: int, ub: int) -> Control:
    """The control op for a swap-in whose first consumer is ``target``, valid for this plan.

    A valid control op runs at or after ``floor`` (the last op that reads the original device
    buffer, or the producer when none does: a swap-in issued while the original is alive saves
    nothing) and before ``target``. A choice before ``floor`` is clamped to ``floor``; when the
    strategy finds nothing in ``[lb, ub]`` the swap-in falls back to the op right before the target
    (the latest possible swap-in). The caller guarantees ``floor < target``.
    """
    search = chain_rule if strategy == "chain_rule" else direct_order
    found = search(ops, producer, target, lb, ub)
    if found is None:
        return Control(target - 1, "fallback")
    if found < floor:
        return Control(floor, "clamped")
    return Control(found, "found")
