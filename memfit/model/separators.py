"""Checkpoint candidates on the forward graph: articulation points, separator sets, sqrt(n) picks.

A checkpoint set is useful when keeping it lets the ops after it be recomputed without
recomputing anything before it: in graph terms it must *separate* the input side of the forward
pass from the loss (openai/gradient-checkpointing; Chen et al.). A chain or a ResNet has single
separators (articulation points); a multi-tower net or a U-Net needs separator *sets*, read off a
tree decomposition of the undirected forward graph (the article's min-fill suggestion).

Note:
    The algorithms run on the *separation graph* (``separation_graph``), not on raw ops:

    - A view, ``detach`` or ``getitem`` allocates nothing: keeping it keeps the storage it aliases.
      Each such op is merged into the forward op that allocated that storage (a ``getitem`` into
      its multi-output op), and one that aliases only resident data (``t(weight)``) is dropped:
      it can always be recomputed for free, and it links no two layers.
    - Ops computed from data alone (a label one-hot, an attention mask, position ids, a random
      leaf) are dropped, as openai's package does by walking forward from the parameters: they
      can be recomputed from resident inputs (and the saved random state) at any time, and
      keeping them would link every layer that reads them (a causal mask links all layers).
      Only ops that read a parameter, or depend on one that does, remain.
    - Ops computed from parameters and buffers alone (a weight's autocast copy) are dropped too:
      joined to ``memfit_input`` they would be shortcuts into every layer, and they can be
      recomputed from resident data at any time.
    - A virtual ``memfit_input`` node joins the ops that remain with no forward inputs (the
      first layer; not each op that reads a user input: the loss reads the targets, and joining
      it would make a shortcut past every layer).
    - A virtual ``memfit_loss`` node joins the op that makes the loss (the last forward-made step
      output). It is *not* joined to every forward leaf: layer-norm statistics, dropout masks and
      BatchNorm running stats are forward leaves read only by backward, and joining them to the
      sink would make shortcuts past every later layer.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import TypeVar

import networkx as nx
import numpy as np
from networkx.algorithms.approximation.treewidth import treewidth_decomp
from scipy.sparse.csgraph import breadth_first_order

from memfit.data.costgraph import CostGraph
from memfit.model.linearize import linearize

__all__ = [
    "INPUT",
    "LOSS",
    "articulation_points",
    "evenly_spaced",
    "forward_graph",
    "linearize",
    "separation_graph",
    "separator_sets",
    "sqrt_checkpoints",
]

INPUT = "memfit_input"
LOSS = "memfit_loss"
Item = TypeVar("Item")
_TOO_WIDE = 1 << 62  # the fill-in given to a node whose bag would exceed ``max_degree + 1``
Analysis = TypeVar("Analysis")


def _per_graph(analysis: Callable[..., Analysis]) -> Callable[..., Analysis]:
    """Remember ``analysis(graph, *args)`` on the graph itself.

    Why: a plan search asks for the same separators many times (each candidate planner, each
    budget of a sweep), and on a 10,000-op step building the separation graph and its tree
    decomposition takes seconds (see ``CostGraph.remembered``). networkx results are frozen,
    so no caller can change what the next one reads.
    """

    @functools.wraps(analysis)
    def remembered(graph: CostGraph, *args, **kwargs) -> Analysis:
        def make() -> Analysis:
            found = analysis(graph, *args, **kwargs)
            return nx.freeze(found) if isinstance(found, nx.Graph) else found

        return graph.remembered((analysis.__name__, args, tuple(sorted(kwargs.items()))), make)

    return remembered


def forward_graph(graph: CostGraph) -> nx.DiGraph:
    """The forward ops as a DAG, with an edge ``u -> v`` for each forward ``u`` in ``v.depends_on``.

    Node attributes: ``size_bytes`` (bytes of the storages the op allocates, 0 for a view),
    ``time_s`` and ``index`` (position in execution order). No virtual nodes: see
    ``separation_graph`` for the graph the separator searches use.
    """
    dag = nx.DiGraph()
    for op in graph.forward_ops:
        size_bytes = sum(graph.tensors[tensor].size_bytes for tensor in op.outputs)
        dag.add_node(op.name, size_bytes=size_bytes, time_s=op.time_s, index=graph.index[op.name])
    for op in graph.forward_ops:
        dag.add_edges_from((source, op.name) for source in op.depends_on if source in dag)
    return dag


def op_storage_owners(graph: CostGraph) -> dict[str, str | None]:
    """For each forward op, the forward op whose storage it stands for (``None``: resident only).

    An op that allocates stands for itself; a view for the op that allocated what it aliases; a
    view of several ops' storages (rare) stays itself, with no bytes of its own.
    """
    owners: dict[str, str | None] = {}
    for op in graph.forward_ops:
        if op.outputs:
            owners[op.name] = op.name
            continue
        producers = {graph.tensors[tensor].producer for tensor in op.inputs}
        forward = sorted(p for p in producers if p is not None and graph.op(p).phase == "forward")
        owners[op.name] = forward[0] if len(forward) == 1 else (op.name if forward else None)
    return owners


@_per_graph
def _owner_dag(graph: CostGraph) -> nx.DiGraph:
    """``forward_graph`` with views merged into their owners, data-only ops dropped, and the
    virtual input and loss (see the module note)."""
    full = forward_graph(graph)
    owners = op_storage_owners(graph)
    dag = nx.DiGraph()
    dag.add_nodes_from((o, full.nodes[o]) for o in dict.fromkeys(owners.values()) if o is not None)
    for source, target in full.edges:
        owner_source, owner_target = owners[source], owners[target]
        if owner_source and owner_target and owner_source != owner_target:
            dag.add_edge(owner_source, owner_target)
    dag = dag.subgraph(_learned(graph, dag, owners) - _from_resident(graph)).copy()
    roots = [node for node in dag if dag.in_degree(node) == 0]
    dag.add_node(INPUT, size_bytes=0, time_s=0.0, index=-1)
    dag.add_edges_from((INPUT, root) for root in roots)
    dag.add_node(LOSS, size_bytes=0, time_s=0.0, index=len(graph.ops))
    dag.add_edges_from((loss, LOSS) for loss in loss_ops(graph) if loss in dag)
    return dag


def _from_resident(graph: CostGraph) -> set[str]:
    """The forward ops computed from parameters and buffers alone, such as a weight's autocast
    copy (``_to_copy(weight)`` in a bf16 step): each would be a root joined to the input, a
    shortcut into the middle of the step past every earlier layer (a bf16 GPT-2 had no
    articulation point at all), and it can be recomputed from resident data at any time."""
    derived: set[str] = set()
    for op in graph.forward_ops:
        sources = [graph.tensors[tensor] for tensor in op.inputs]
        if op.outputs and sources and all(tensor.role in ("parameter", "buffer")
                                          or tensor.producer in derived for tensor in sources):
            derived.add(op.name)
    return derived


def _learned(graph: CostGraph, dag: nx.DiGraph, owners: Mapping[str, str | None]) -> set[str]:
    """The owner ops that read a parameter or depend on one that does (all, if that is none)."""
    parameters = {t.name for t in graph.tensors.values() if t.role == "parameter"}
    seeds = {
        owner
        for op in graph.forward_ops
        if (owner := owners[op.name]) is not None and parameters.intersection(op.inputs)
    }
    marked = dag.copy()
    marked.add_edges_from(("memfit_parameters", seed) for seed in seeds)
    learned: set[str] = nx.descendants(marked, "memfit_parameters") if seeds else set()
    if not learned.intersection(loss_ops(graph)):
        return set(dag)  # the loss does not depend on a parameter: keep every op
    return learned


def loss_ops(graph: CostGraph) -> tuple[str, ...]:
    """The op that makes the loss: the last forward op that allocates a step output.

    Falls back to every forward op no forward op reads when no forward op makes a step output.
    """
    phase = {op.name: op.phase for op in graph.ops}
    made = [
        t.producer
        for t in graph.tensors.values()
        if t.is_output and t.producer is not None and phase[t.producer] == "forward"
    ]
    if made:
        return (max(made, key=graph.index.__getitem__),)
    users = graph.users
    return tuple(
        op.name
        for op in graph.forward_ops
        if not any(phase[u] == "forward" for u in users[op.name])
    )


@_per_graph
def separation_graph(graph: CostGraph) -> nx.Graph:
    """The undirected forward graph the separator searches run on (see the module note)."""
    return _owner_dag(graph).to_undirected()


def _candidate(undirected: nx.Graph, node: str, losses: Iterable[str]) -> bool:
    """Whether ``node`` can be a checkpoint: a real op that allocates, and not the loss itself."""
    return node not in (INPUT, LOSS, *losses) and undirected.nodes[node]["size_bytes"] > 0


def _connected(undirected: nx.Graph) -> bool:
    return INPUT in undirected and LOSS in undirected and nx.has_path(undirected, INPUT, LOSS)


@_per_graph
def articulation_points(graph: CostGraph) -> tuple[str, ...]:
    """Forward ops whose removal disconnects the input from the loss, in execution order.

    These are the cut vertices on the input-to-loss path of the block-cut tree: every path from
    the input to the loss passes through each of them. On ``synthetic.chain(n)`` that is every
    forward op but the loss; on ``resnet_like`` the stem and the block outputs (the adds); on
    ``multi_tower`` the stem and the join.

    Example:
        >>> articulation_points(synthetic.chain(3))
        ('f0', 'f1', 'f2')
    """
    undirected = separation_graph(graph)
    if not _connected(undirected):
        return ()
    cut_vertices = set(nx.articulation_points(undirected))
    tree = nx.Graph()  # the block-cut tree
    ends: dict[str, object] = {INPUT: INPUT, LOSS: LOSS}
    for number, block in enumerate(nx.biconnected_components(undirected)):
        tree.add_node(("block", number))
        tree.add_edges_from((("block", number), vertex) for vertex in block & cut_vertices)
        for end in (INPUT, LOSS):
            if end in block and end not in cut_vertices:
                ends[end] = ("block", number)
    path = nx.shortest_path(tree, ends[INPUT], ends[LOSS])
    losses = loss_ops(graph)
    found = [v for v in path if isinstance(v, str) and _candidate(undirected, v, losses)]
    return tuple(sorted(found, key=graph.index.__getitem__))


class MinFillAlong:
    """Networkx's min-fill elimination heuristic, ties broken by ``rank`` (depth, then order).

    A callable for ``treewidth_decomp``. Fill-ins live in a heap and only the nodes within two
    steps of the last eliminated node are rescored (only their fill can change): networkx's
    ``min_fill_in_heuristic`` rescans every node at every step, quadratic in the graph's size
    (seconds at a thousand ops, where this takes a fraction of one).

    Note:
        Networkx breaks ties by degree, which on a two-tower graph eats one tower first and gives
        bags that all share one node of the other tower. Eliminating equal-fill nodes from the
        input side instead sweeps both towers together, so adjacent bags meet in one node per
        tower at every depth: the separators the article draws.
    """

    def __init__(self, rank: Mapping[str, tuple], max_degree: int | None = None) -> None:
        self.rank = rank
        self.max_degree = max_degree  # stop when every node left has more neighbours
        self.fill: dict[str, int] = {}
        self.heap: list[tuple[int, tuple, str]] = []
        self.touched: set[str] | None = None  # nodes to rescore; None: all (first call)

    def __call__(self, graph_dict: dict[str, set[str]]) -> str | None:
        for node in graph_dict if self.touched is None else self.touched & graph_dict.keys():
            neighbours = graph_dict[node]
            if self.max_degree is not None and len(neighbours) > self.max_degree:
                fill = _TOO_WIDE  # its bag would be too big to use: skip the quadratic count
            else:
                fill = sum(len(neighbours - graph_dict[n]) - 1 for n in neighbours) // 2
            if self.fill.get(node) != fill or self.touched is None:
                self.fill[node] = fill
                heapq.heappush(self.heap, (fill, self.rank[node], node))
        while self.heap:
            fill, _, node = heapq.heappop(self.heap)
            if node in graph_dict and self.fill[node] == fill:
                break
        else:
            return None
        if fill == _TOO_WIDE or (fill == 0 and len(graph_dict[node]) == len(graph_dict) - 1):
            return None  # the rest is one bag: too wide to split usefully, or a clique
        neighbours = graph_dict[node]
        self.touched = set(neighbours).union(*(graph_dict[n] for n in neighbours)) - {node}
        return node


def _tree_path_separators(
    undirected: nx.Graph, rank: Mapping[str, tuple], max_size: int
) -> list[frozenset]:
    """Intersections of adjacent bags on the decomposition path from the input to the loss.

    In a tree decomposition, the intersection of two adjacent bags separates the nodes seen only
    on one side of that tree edge from those seen only on the other; so on the tree path between
    a bag holding the input and one holding the loss, every intersection that holds neither is an
    input/loss separator, with no search. (A bag on that path holds such an intersection, so
    bags add only larger sets.) Elimination stops once every bag left would exceed
    ``2 * max_size`` nodes: the rest becomes one bag.
    """
    _, tree = treewidth_decomp(undirected, MinFillAlong(rank, max_degree=2 * max_size))
    start = next(bag for bag in tree if INPUT in bag)
    end = next(bag for bag in tree if LOSS in bag)
    path = nx.shortest_path(tree, start, end)
    sets = (a & b for a, b in pairwise(path))
    return [s for s in dict.fromkeys(sets) if s and INPUT not in s and LOSS not in s]


def _level_cuts(undirected: nx.Graph, depth: Mapping[str, int], max_size: int) -> list[frozenset]:
    """For each depth ``d``, the nodes at depth ``d`` or less with a neighbour deeper than ``d``.

    Removing such a cut leaves no edge between the shallower and the deeper nodes, so it
    separates the input (depth 0) from the loss (the deepest) whenever it holds neither. It finds
    what min-fill misses on three or more towers, where min-fill first contracts each tower's
    chain (fill 1) and never meets the towers level by level (fill 2 or more): the cut at each
    depth is one node per tower. Cuts of more than ``2 * max_size`` nodes are skipped.
    """
    enters: dict[int, list[str]] = {}
    leaves: dict[int, list[str]] = {}
    for node in undirected:
        reach = max((depth[n] for n in undirected[node]), default=0)
        if reach > depth[node]:  # in the cuts of depths depth[node] .. reach - 1
            enters.setdefault(depth[node], []).append(node)
            leaves.setdefault(reach, []).append(node)
    cuts: list[frozenset] = []
    active: set[str] = set()
    for level in range(max(depth.values(), default=0)):
        active.update(enters.get(level, ()))
        active.difference_update(leaves.get(level, ()))
        if len(active) <= 2 * max_size and INPUT not in active and LOSS not in active:
            cuts.append(frozenset(active))
    return cuts


class _Adjacency:
    """``undirected`` as a sparse matrix, for the many searches that remove a few nodes.

    Why: each candidate separator needs the component of one end once its members are removed;
    on a 10,000-op step that is a thousand searches over the whole graph, and networkx's
    restricted views filter every edge in Python (seconds), where scipy's breadth-first search
    over the kept rows and columns runs in C.
    """

    def __init__(self, undirected: nx.Graph) -> None:
        self.nodes = list(undirected)
        self.position = {node: i for i, node in enumerate(self.nodes)}
        self.matrix = nx.to_scipy_sparse_array(undirected, nodelist=self.nodes, weight=None,
                                               format="csr")

    def next_to(self, separator: frozenset, end: str) -> frozenset:
        """The members of ``separator`` next to ``end``'s component once ``separator`` is removed."""
        kept = np.ones(len(self.nodes), dtype=bool)
        kept[[self.position[v] for v in separator]] = False
        start = int(np.count_nonzero(kept[:self.position[end]]))  # its row once rows are dropped
        reached = breadth_first_order(self.matrix[kept][:, kept], start, directed=False,
                                      return_predecessors=False)
        on_side = np.zeros(len(self.nodes), dtype=bool)
        on_side[np.flatnonzero(kept)[reached]] = True
        indptr, indices = self.matrix.indptr, self.matrix.indices
        return frozenset(
            v for v in separator
            if on_side[indices[indptr[self.position[v]]:indptr[self.position[v] + 1]]].any()
        )

    def minimal(self, separator: frozenset, minimal: bool) -> frozenset:
        """The members of ``separator`` next to the loss side, then (``minimal``) the input side.

        Each member kept in both passes touches both sides, so none can be dropped; after the
        first pass alone, each member is still read by what comes after it (see
        ``separator_sets``).
        """
        near_loss = self.next_to(separator, LOSS)
        return self.next_to(near_loss, INPUT) if minimal else near_loss


@_per_graph
def separator_sets(
    graph: CostGraph, max_size: int = 4, minimal: bool = True
) -> tuple[tuple[str, ...], ...]:
    """Small sets of forward ops that separate the input from the loss, ordered along the graph.

    Found from a min-fill tree decomposition of ``separation_graph`` (intersections of adjacent
    bags on the input-to-loss path) and from cuts between depth levels (``_level_cuts``), each
    shrunk to a minimal separator, plus the articulation points as sets of one (with
    ``minimal``, a set holding one is dropped: that op alone does better). Each set is sorted in
    execution order; sets are ordered by their last, then their first member's position.

    Args:
        max_size: the largest set returned (default 4). Keeping a set keeps all of it, so large
            sets cost memory for little recomputation saved; the article's multi-tower example
            needs one node per tower.
        minimal: return minimal separators only (default). A U-Net's outermost skip makes its
            two ends the only minimal separators of everything between them; with ``False``,
            sets are only trimmed to the members the rest of the pass reads, which keeps the
            nested cuts (``{d0, d1, d2}``: the skip sources so far and the current level).

    Example:
        >>> separator_sets(synthetic.multi_tower(2, 3))[1]
        ('t0_0', 't1_0')
    """
    undirected = separation_graph(graph)
    if not _connected(undirected):
        return ()
    dag = _owner_dag(graph)
    depth = {
        node: level for level, nodes in enumerate(nx.topological_generations(dag)) for node in nodes
    }
    rank = {node: (depth[node], undirected.nodes[node]["index"], node) for node in undirected}
    losses = loss_ops(graph)
    points = articulation_points(graph)
    found = {frozenset((point,)) for point in points}
    candidates = _tree_path_separators(undirected, rank, max_size)
    adjacency = _Adjacency(undirected)
    for candidate in dict.fromkeys([*candidates, *_level_cuts(undirected, depth, max_size)]):
        if (minimal and not candidate.isdisjoint(points)) or len(candidate) > 2 * max_size:
            continue  # an articulation point alone does better; a huge bag hides no small set
        short = minimal and len(candidate) <= 2  # no point inside: already minimal
        trimmed = candidate if short else adjacency.minimal(candidate, minimal)
        if len(trimmed) <= max_size and all(_candidate(undirected, v, losses) for v in trimmed):
            found.add(trimmed)
    index = graph.index
    ordered = [tuple(sorted(s, key=index.__getitem__)) for s in found if s]
    return tuple(sorted(ordered, key=lambda s: (index[s[-1]], index[s[0]], s)))


def evenly_spaced(candidates: Sequence[Item], count: int) -> tuple[Item, ...]:
    """``count`` of ``candidates`` spread evenly, leaving equal gaps before the first and after the last.

    The ends are not favoured: a checkpoint at the very start or end of the forward pass saves
    little (the first segment is cheap to keep, the last is needed at once by backward), so
    ``count`` picks cut ``candidates`` into ``count + 1`` runs of about equal length.

    Example:
        >>> evenly_spaced(range(10), 2)  # runs 0-2, 4-5, 7-9
        (3, 6)
    """
    items = tuple(candidates)
    return tuple(items[position] for position in evenly_spaced_positions(len(items), count))


def evenly_spaced_positions(length: int, count: int) -> np.ndarray:
    """The positions ``evenly_spaced`` picks from ``length`` candidates (all when ``count`` is
    ``length`` or more), for callers that price many counts with arrays."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    if count >= length:
        return np.arange(length, dtype=np.int64)
    step = (length + 1) / (count + 1)
    return (np.arange(1, count + 1, dtype=np.int64) * step + 0.5).astype(np.int64) - 1


def sqrt_checkpoints(graph: CostGraph) -> tuple[tuple[str, ...], ...]:
    """About sqrt(n) checkpoint sets evenly spaced along the forward pass (openai's 'memory' mode).

    ``n`` is the number of forward ops that allocate. Articulation points are used when there are
    at least sqrt(n) of them (each set then has one op); otherwise minimal separator sets
    (``separator_sets``), which include the articulation points.

    Example:
        >>> len(sqrt_checkpoints(synthetic.chain(100)))
        10
    """
    allocating = sum(1 for op in graph.forward_ops if op.outputs)
    count = max(1, round(math.sqrt(allocating)))
    points = articulation_points(graph)
    if len(points) >= count:
        return tuple((point,) for point in evenly_spaced(points, count))
    return evenly_spaced(separator_sets(graph), count)
