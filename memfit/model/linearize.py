"""Reorder the forward pass "as late as possible" (the article's ``linearize``).

Executing each op as soon as its inputs are ready (the order a trace records) can hold values
long before they are used: a chain of matmuls that each read a cheap random tensor made up front
holds all those tensors at once, memory proportional to the chain length. Running each op just
before its first user needs a constant amount instead.

Note:
    Only forward ops move, into the positions forward ops held; backward and update ops stay
    where they are, and every forward op stays before the ops that read it. Ops whose kind names
    a random draw (``rand``, ``dropout``, ``bernoulli``) keep their relative order, so each draws
    the same numbers from the generator as before.

    As-late-as-possible is a heuristic and can *raise* the peak: an op that turns a large value
    into a small one (a reduction, a loss term) is moved to just before its late user, keeping
    its large input alive all the way there. ``linearize`` therefore keeps the original order
    whenever the new one has a higher ``Keep`` peak.
"""

from __future__ import annotations

import heapq

from memfit.data.costgraph import CostGraph, Op
from memfit.data.plan import Plan
from memfit.model.schedule import peak_bytes

# Substrings of the kinds of ops that draw from the random generator. A false match only pins
# an op's order among the random ops, which is always safe; a miss could change the numbers.
RANDOM_MARKERS = (
    "rand",  # rand, randn, randint, randperm, *_like, inductor_random
    "dropout",
    "bernoulli",
    "uniform",
    "normal",  # aten.normal, log_normal
    "multinomial",
    "poisson",
    "exponential",
    "geometric",
    "cauchy",
    "rrelu",
)


def is_random(op: Op) -> bool:
    """Whether ``op`` draws from the random generator (``aten.rand*``, dropout, bernoulli, ...)."""
    kind = op.kind.lower()
    return any(marker in kind for marker in RANDOM_MARKERS)


def linearize(graph: CostGraph) -> CostGraph:
    """``graph`` with each forward op moved as late as possible, or ``graph`` itself.

    Ops are placed from the last forward position backwards: at each position, among the forward
    ops whose users are all placed, the one that has waited longest (whose first user comes
    latest) goes there; ties (inputs of one user) put the op with the fewest bytes of its own
    plus its inputs last, nearest its user (the article's ``memsorted``), then keep the original
    order. So a cheap leaf runs right before the op that reads it.

    Returns:
        A new graph with the same ops and tensors in the new order, or ``graph`` unchanged when
        the order does not change, when it cannot respect a forward op that reads a backward
        op's value, or when it would raise the peak of keeping everything (see the module note).

    Example:
        A chain ``m{i} = mm(m{i-1}, r{i})`` whose random leaves were traced first,
        ``r1 r2 m0 m1 m2``, becomes ``r1 m0 m1 r2 m2``: ``r2`` is drawn just before ``m2``.
    """
    order = as_late_as_possible_order(graph)
    if order is None or order == tuple(op.name for op in graph.ops):
        return graph
    reordered = CostGraph.build(
        (graph.op(name) for name in order), graph.tensors.values(), graph.name, graph.compiler
    )
    if peak_bytes(reordered, Plan("keep")) > peak_bytes(graph, Plan("keep")):
        return graph
    return reordered


def _waiting_on(graph: CostGraph) -> dict[str, set[str]]:
    """For each forward op, the forward ops that must be placed after it.

    Its forward readers, and the next random forward op (which keeps the random ops in order).
    """
    forward = [op for op in graph.ops if op.phase == "forward"]
    is_forward = {op.name for op in forward}
    waiting = {op.name: {u for u in graph.users[op.name] if u in is_forward} for op in forward}
    random_ops = [op.name for op in forward if is_random(op)]
    for earlier, later in zip(random_ops, random_ops[1:], strict=False):
        waiting[earlier].add(later)
    return waiting


def _working_bytes(graph: CostGraph, op: Op) -> int:
    """Bytes an op holds while it runs: its outputs and the activations it reads."""
    tensors = graph.tensors
    own = sum(tensors[t].size_bytes for t in op.outputs)
    return own + sum(tensors[t].size_bytes for t in op.inputs if tensors[t].producer is not None)


def as_late_as_possible_order(graph: CostGraph) -> tuple[str, ...] | None:
    """The op names in as-late-as-possible order (see ``linearize``), with no peak check.

    ``None`` if no forward order fits around the fixed ops (a forward op that reads a backward
    op's value placed after it, say).
    """
    index = graph.index
    slots = [i for i, op in enumerate(graph.ops) if op.phase == "forward"]
    waiting = _waiting_on(graph)
    fixed_readers = {
        name: [index[u] for u in graph.users[name] if u not in waiting] for name in waiting
    }
    deadline = {name: min(found, default=len(graph.ops)) for name, found in fixed_readers.items()}
    release = {
        name: max((index[d] for d in graph.op(name).depends_on if d not in waiting), default=-1)
        for name in waiting
    }
    pending = {name: len(after) for name, after in waiting.items()}
    placed_before: dict[str, list[str]] = {name: [] for name in waiting}  # reverse of waiting
    for name, after in waiting.items():
        for later in after:
            placed_before[later].append(name)
    first_reader = dict(deadline)  # position of the first reader placed so far
    ready: list[tuple[int, int, int, str]] = []

    def make_ready(name: str) -> None:
        key = (-first_reader[name], _working_bytes(graph, graph.op(name)), -index[name], name)
        heapq.heappush(ready, key)

    for name, count in pending.items():
        if count == 0:
            make_ready(name)
    order = [op.name for op in graph.ops]
    for slot in reversed(slots):
        deferred = []
        while ready and deadline[ready[0][3]] <= slot:  # a backward reader still comes before
            deferred.append(heapq.heappop(ready))
        if not ready or release[ready[0][3]] >= slot:
            return None
        name = heapq.heappop(ready)[3]
        for item in deferred:
            heapq.heappush(ready, item)
        order[slot] = name
        reads = set(graph.op(name).depends_on)
        for source in placed_before[name]:
            if source in reads:  # a data reader, not just the next random op
                first_reader[source] = min(first_reader[source], slot)
            pending[source] -= 1
            if pending[source] == 0:
                make_ready(source)
    return tuple(order)
