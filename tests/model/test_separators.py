"""Checkpoint candidates (articulation points, separator sets, sqrt(n)) and linearize, torch-free.

Separation is checked against a graph built here, independently of ``separation_graph``: the
undirected forward graph of a synthetic step, an input node joined to the ops that read ``x``
and a loss node joined to the ``loss`` op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Plan
from memfit.model import synthetic
from memfit.model.linearize import as_late_as_possible_order, is_random, linearize
from memfit.model.schedule import peak_bytes
from memfit.model.separators import (
    INPUT,
    LOSS,
    articulation_points,
    evenly_spaced,
    forward_graph,
    separation_graph,
    separator_sets,
    sqrt_checkpoints,
)
from memfit.model.synthetic import Node

UNIT = 1 << 20
PROPERTY = settings(max_examples=50, deadline=None)


# ---- helpers -------------------------------------------------------------------------------------


def reference_graph(graph: CostGraph) -> nx.Graph:
    """Undirected forward graph of a synthetic step, with input and loss nodes."""
    undirected = forward_graph(graph).to_undirected()
    undirected.add_edges_from((INPUT, op.name) for op in graph.forward_ops if "x" in op.inputs)
    undirected.add_edge("loss", LOSS)
    return undirected


def separates(graph: CostGraph, nodes: Iterable[str]) -> bool:
    rest = reference_graph(graph)
    rest.remove_nodes_from(nodes)
    return not nx.has_path(rest, INPUT, LOSS)


def single_separators(graph: CostGraph) -> set[str]:
    """Brute force: every forward op but the loss whose removal cuts the input from the loss."""
    return {
        op.name for op in graph.forward_ops if op.name != "loss" and separates(graph, [op.name])
    }


def keep_peak(graph: CostGraph) -> int:
    return peak_bytes(graph, Plan("keep"))


def names(graph: CostGraph) -> list[str]:
    return [op.name for op in graph.ops]


def forward_only(nodes: Sequence[Node], name: str = "forward") -> CostGraph:
    """An inference graph (the article's pebble game): values die after their last reader.

    A node with no inputs reads nothing (a random or constant leaf); values no node reads are
    the outputs.
    """
    read = {source for node in nodes for source in node.inputs}
    ops = [
        Op(n.name, n.kind, "forward", inputs=n.inputs, outputs=(n.name,), depends_on=n.inputs)
        for n in nodes
    ]
    tensors = [
        Tensor(n.name, n.size_bytes, "activation", is_output=n.name not in read) for n in nodes
    ]
    return CostGraph.build(ops, tensors, name=name)


def leaf_chain(length: int, leaves_first: bool = True) -> CostGraph:
    """The article's chain: matmul ``m{i}`` reads ``m{i-1}`` and a cheap random leaf ``r{i}``."""
    leaves = [Node(f"r{i}", (), UNIT, kind="aten.rand") for i in range(1, length + 1)]
    chain = [Node("m0", (), UNIT)] + [
        Node(f"m{i}", (f"m{i - 1}", f"r{i}"), UNIT) for i in range(1, length + 1)
    ]
    return forward_only(leaves + chain if leaves_first else chain + leaves, name="leaf_chain")


# ---- forward graph -------------------------------------------------------------------------------


def test_forward_graph_has_forward_ops_edges_and_attributes():
    graph = synthetic.chain(3)
    dag = forward_graph(graph)
    assert list(dag.nodes) == ["f0", "f1", "f2", "loss"]
    assert set(dag.edges) == {("f0", "f1"), ("f1", "f2"), ("f2", "loss")}
    assert dag.nodes["f1"] == {"size_bytes": UNIT, "time_s": 1e-3, "index": 1}
    assert dag.nodes["loss"]["size_bytes"] == 4


# ---- articulation points -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "graph, expected",
    [
        (synthetic.chain(6), ("f0", "f1", "f2", "f3", "f4", "f5")),
        (synthetic.resnet_like(3), ("stem", "b0_add", "b1_add", "b2_add")),
        (synthetic.multi_tower(2, 8), ("stem", "join")),
        (synthetic.multi_tower(3, 4), ("stem", "join")),
    ],
    ids=["chain", "resnet", "two_towers", "three_towers"],
)
def test_articulation_points_by_hand(graph, expected):
    assert articulation_points(graph) == expected
    assert set(expected) == single_separators(graph)


@PROPERTY
@given(size=st.integers(2, 40), seed=st.integers(0, 10_000), max_inputs=st.integers(1, 3))
def test_articulation_points_are_exactly_the_single_separators(size, seed, max_inputs):
    graph = synthetic.random_dag(size, seed, max_inputs)
    points = articulation_points(graph)
    assert set(points) == single_separators(graph)
    assert list(points) == sorted(points, key=graph.index.__getitem__)


def view_step() -> CostGraph:
    """``a = mm(x, w)``; ``v = view(a)``; ``wt = t(w)``; ``ln`` makes (out, mean); ``g0``/``g1`` pick
    them; ``b = mm(g0, wt)``; ``loss = sum(b)``; backward reads ``mean`` through ``g1``.

    Views and getitems allocate nothing; ``g1`` is a forward leaf read only by backward.
    """
    ops = [
        Op("a", "aten.mm", "forward", inputs=("x", "w"), outputs=("a",)),
        Op("v", "aten.view", "forward", inputs=("a",), depends_on=("a",)),
        Op("wt", "aten.t", "forward", inputs=("w",)),
        Op("ln", "aten.native_layer_norm", "forward", inputs=("a",), outputs=("ln", "ln.1"),
           depends_on=("v",)),
        Op("g0", "getitem", "forward", inputs=("ln", "ln.1"), depends_on=("ln",)),
        Op("g1", "getitem", "forward", inputs=("ln", "ln.1"), depends_on=("ln",)),
        Op("b", "aten.mm", "forward", inputs=("ln", "w"), outputs=("b",), depends_on=("g0", "wt")),
        Op("loss", "aten.sum", "forward", inputs=("b",), outputs=("loss",), depends_on=("b",)),
        Op("db", "aten.expand", "backward", inputs=("loss",), outputs=("db",), depends_on=("loss",)),
        Op("dln", "aten.ln_backward", "backward", inputs=("db", "ln", "ln.1", "a"), outputs=("dw",),
           depends_on=("db", "g1", "g0", "v")),
    ]  # fmt: skip
    tensors = [
        Tensor("x", 8, "input"),
        Tensor("w", 8, "parameter"),
        *(Tensor(name, 100, "activation") for name in ("a", "ln", "ln.1", "b")),
        Tensor("loss", 4, "activation", is_output=True),
        Tensor("db", 100, "gradient"),
        Tensor("dw", 8, "gradient", is_output=True),
    ]
    return CostGraph.build(ops, tensors, name="views")


def test_views_merge_into_the_storage_they_alias():
    graph = view_step()
    undirected = separation_graph(graph)
    assert set(undirected) == {INPUT, "a", "ln", "b", "loss", LOSS}  # v, g0, g1 merged; wt dropped
    assert {frozenset(edge) for edge in undirected.edges} == {
        frozenset(edge)
        for edge in [(INPUT, "a"), ("a", "ln"), ("ln", "b"), ("b", "loss"), ("loss", LOSS)]
    }
    # neither the weight view (which every layer has) nor the statistics read only by backward
    # make shortcuts: every op that allocates is a separator, the loss excepted
    assert articulation_points(graph) == ("a", "ln", "b")


def test_values_computed_from_data_alone_link_no_layers():
    """A mask made from the input ids is read by every layer and the targets by the loss; both
    are resident-derived, so neither hides the layers' separators (openai walks forward from
    the parameters for the same reason)."""
    ops = [Op("mask", "aten.lt", "forward", inputs=("ids",), outputs=("mask",))]
    ops.append(Op("h0", "aten.mm", "forward", inputs=("x", "w0"), outputs=("h0",)))
    ops += [
        Op(f"h{i}", "aten.mm", "forward", inputs=(f"h{i - 1}", f"w{i}", "mask"),
           outputs=(f"h{i}",), depends_on=(f"h{i - 1}", "mask"))
        for i in range(1, 4)
    ]  # fmt: skip
    ops.append(Op("loss", "aten.sub", "forward", inputs=("h3", "y"), outputs=("loss",),
                  depends_on=("h3",)))  # fmt: skip
    tensors = [Tensor(name, 8, "input") for name in ("ids", "x", "y")]
    tensors += [Tensor(f"w{i}", 8, "parameter") for i in range(4)]
    tensors += [Tensor(name, 64, "activation") for name in ("mask", "h0", "h1", "h2", "h3")]
    tensors.append(Tensor("loss", 4, "activation", is_output=True))
    graph = CostGraph.build(ops, tensors, name="masked")
    assert "mask" not in separation_graph(graph)
    assert articulation_points(graph) == ("h0", "h1", "h2", "h3")


# ---- separator sets ------------------------------------------------------------------------------


def assert_minimal_separators(graph: CostGraph, sets: Sequence[tuple[str, ...]]) -> None:
    for found in sets:
        assert separates(graph, found), found
        for member in found:
            assert len(found) == 1 or not separates(graph, set(found) - {member}), found
    assert len(set(sets)) == len(sets)
    positions = [(graph.index[s[-1]], graph.index[s[0]]) for s in sets]
    assert positions == sorted(positions)


def test_two_towers_have_one_node_per_tower_at_every_depth():
    graph = synthetic.multi_tower(2, 8)
    sets = separator_sets(graph)
    assert sets[0] == ("stem",) and sets[-1] == ("join",)
    for depth in range(8):
        assert (f"t0_{depth}", f"t1_{depth}") in sets
    assert all(len(s) == 2 and s[0].startswith("t0") and s[1].startswith("t1") for s in sets[1:-1])
    assert len(sets) == 17  # stem, t0_d|t1_d for d in 0..7, t0_d+1|t1_d for d in 0..6, join
    assert_minimal_separators(graph, sets)


def test_three_towers_have_one_node_per_tower_at_every_depth():
    """Min-fill contracts each tower first here; the cuts between depth levels find the sets."""
    graph = synthetic.multi_tower(3, 4)
    sets = separator_sets(graph)
    assert sets == (
        ("stem",),
        *((f"t0_{d}", f"t1_{d}", f"t2_{d}") for d in range(4)),
        ("join",),
    )
    assert_minimal_separators(graph, sets)
    assert separator_sets(graph, max_size=2) == (("stem",), ("join",))


def unet(levels: int) -> CostGraph:
    """Down ``d0..``, a middle, up ``..u0``; each ``u{i}`` also reads the skip ``d{i}``."""
    nodes = [Node("stem", ())]
    previous = "stem"
    for name in [*(f"d{i}" for i in range(levels)), "mid"]:
        nodes.append(Node(name, (previous,)))
        previous = name
    for i in reversed(range(levels)):
        nodes.append(Node(f"u{i}", (previous, f"d{i}")))
        previous = f"u{i}"
    nodes.append(Node("head", (previous,)))
    return synthetic.from_forward(nodes, name="unet")


def test_unet_nested_cuts_need_non_minimal_sets():
    graph = unet(4)
    # the outer skip d0 -> u0 spans everything between: its ends are the only minimal separators
    assert separator_sets(graph) == (("stem",), ("d0",), ("u0",), ("head",))
    sets = separator_sets(graph, minimal=False)
    for depth in range(1, 4):
        assert tuple(f"d{i}" for i in range(depth + 1)) in sets  # skip sources so far + level
    assert ("d0", "d1", "u2") in sets
    for found in sets:
        assert separates(graph, found)
        after = reference_graph(graph)
        after.remove_nodes_from(found)
        loss_side = nx.node_connected_component(after, LOSS)
        # every member is read by what is recomputed after it: none is dead weight
        assert all(not loss_side.isdisjoint(reference_graph(graph)[v]) for v in found), found


def test_separator_sets_of_chains_and_resnets_are_their_articulation_points():
    for graph in (synthetic.chain(12), synthetic.resnet_like(4)):
        assert separator_sets(graph) == tuple((p,) for p in articulation_points(graph))


def test_max_size_bounds_the_sets():
    graph = synthetic.multi_tower(2, 8)
    assert separator_sets(graph, max_size=1) == (("stem",), ("join",))


@PROPERTY
@given(size=st.integers(2, 40), seed=st.integers(0, 10_000), max_inputs=st.integers(1, 3))
def test_separator_sets_of_random_dags_are_minimal_separators(size, seed, max_inputs):
    graph = synthetic.random_dag(size, seed, max_inputs)
    sets = separator_sets(graph, max_size=3)
    assert all(1 <= len(s) <= 3 for s in sets)
    assert {s[0] for s in sets if len(s) == 1} == set(articulation_points(graph))
    assert_minimal_separators(graph, sets)
    for found in separator_sets(graph, max_size=3, minimal=False):
        assert separates(graph, found), found


# ---- sqrt(n) -------------------------------------------------------------------------------------


def test_evenly_spaced_leaves_equal_gaps_at_both_ends():
    assert evenly_spaced(range(10), 2) == (3, 6)  # runs 0-2 | 4-5 | 7-9
    assert evenly_spaced("abc", 5) == ("a", "b", "c")
    assert evenly_spaced("abc", 0) == ()
    assert evenly_spaced(range(7), 3) == (1, 3, 5)


def test_sqrt_checkpoints_of_a_chain_of_100():
    picks = sqrt_checkpoints(synthetic.chain(100))  # 101 forward ops allocate: sqrt -> 10
    layers = [int(name[1:]) for (name,) in picks]
    assert layers == [8, 17, 27, 36, 45, 54, 63, 72, 82, 91]
    gaps = [b - a for a, b in zip([-1, *layers], [*layers, 100], strict=True)]
    assert max(gaps) - min(gaps) <= 1


def test_sqrt_checkpoints_of_two_towers_use_separator_sets():
    graph = synthetic.multi_tower(2, 8)  # 19 allocating forward ops -> 4 sets; 2 points only
    picks = sqrt_checkpoints(graph)
    assert len(picks) == 4
    assert all(len(p) == 2 and separates(graph, p) for p in picks)
    assert picks == (("t0_1", "t1_1"), ("t0_3", "t1_2"), ("t0_5", "t1_4"), ("t0_6", "t1_6"))


# ---- linearize: the article's examples -----------------------------------------------------------


@pytest.mark.parametrize("length", [4, 8, 32])
def test_leaf_chain_needs_constant_memory_as_late_as_possible(length):
    """The article's chain of matmuls, each with a random_uniform leaf made up front."""
    graph = leaf_chain(length)
    assert keep_peak(graph) == (length + 2) * UNIT  # all leaves, then m0 and m1 at once
    linear = linearize(graph)
    assert keep_peak(linear) == 3 * UNIT  # m{i-1}, r{i}, m{i}: the article's 3 units
    assert names(linear)[:5] == ["r1", "m0", "m1", "r2", "m2"]
    assert names(linear)[-2:] == [f"r{length}", f"m{length}"]


def test_article_first_example_needs_three_pebbles_not_four():
    """x3 = f(x1, x2); x5 = g(x3, x4): computing leaf x4 early holds it across x3."""
    nodes = [
        Node("x1", (), UNIT, kind="aten.full"),
        Node("x2", (), UNIT, kind="aten.full"),
        Node("x4", (), UNIT, kind="aten.full"),
        Node("x3", ("x1", "x2"), UNIT),
        Node("x5", ("x3", "x4"), UNIT),
    ]
    graph = forward_only(nodes)
    linear = linearize(graph)
    assert names(linear) == ["x1", "x2", "x3", "x4", "x5"]
    assert (keep_peak(graph), keep_peak(linear)) == (4 * UNIT, 3 * UNIT)


def noisy_chain_step(length: int, noise_units: int = 4) -> CostGraph:
    """A training step: ``m{i} = m{i-1} + noise{i}`` with all the noise drawn up front.

    The backward of ``m{i}`` reads ``m{i-1}`` (saved) but not the noise, so the noise dies in
    the forward pass: ASAP holds all of it at once, ALAP one at a time.
    """
    noise = [f"r{i}" for i in range(1, length + 1)]
    ops = [Op(r, "aten.rand", "forward", outputs=(r,)) for r in noise]
    ops.append(Op("m0", "aten.mm", "forward", inputs=("x",), outputs=("m0",)))
    ops += [
        Op(f"m{i}", "aten.add", "forward", inputs=(f"m{i - 1}", f"r{i}"), outputs=(f"m{i}",),
           depends_on=(f"m{i - 1}", f"r{i}"))
        for i in range(1, length + 1)
    ]  # fmt: skip
    ops.append(Op("loss", "aten.sum", "forward", inputs=(f"m{length}",), outputs=("loss",),
                  depends_on=(f"m{length}",)))  # fmt: skip
    ops.append(Op("dloss", "aten.expand", "backward", inputs=("loss",), outputs=(f"d{length}",),
                  depends_on=("loss",)))  # fmt: skip
    for i in range(length, 0, -1):
        grad_op = "dloss" if i == length else f"g{i + 1}"
        ops.append(Op(f"g{i}", "aten.add_backward", "backward", inputs=(f"d{i}", f"m{i - 1}"),
                      outputs=(f"d{i - 1}",), depends_on=(grad_op, f"m{i - 1}")))  # fmt: skip
    tensors = [Tensor("x", UNIT, "input"), Tensor("loss", 4, "activation", is_output=True)]
    tensors += [Tensor(r, noise_units * UNIT, "activation") for r in noise]
    tensors += [Tensor(f"m{i}", UNIT, "activation") for i in range(length + 1)]
    tensors += [Tensor(f"d{i}", UNIT, "gradient", is_output=i == 0) for i in range(length + 1)]
    return CostGraph.build(ops, tensors, name="noisy_chain")


def test_noise_drawn_up_front_is_drawn_just_in_time_in_a_training_step():
    graph = noisy_chain_step(8)
    linear = linearize(graph)
    # ASAP, while m1 runs: x, 8 noise tensors of 4 units, m0, m1
    assert keep_peak(graph) == (1 + 8 * 4 + 2) * UNIT
    # ALAP, while m8 runs: x, m0..m7 (saved for backward), r8 (4 units), m8
    assert keep_peak(linear) == (1 + 8 + 4 + 1) * UNIT
    assert [n for n in names(linear) if n.startswith("r")] == [f"r{i}" for i in range(1, 9)]


def test_a_step_that_saves_every_input_gains_nothing():
    """``from_forward`` saves each op's inputs for backward, so every leaf lives to backward in
    any order: the peak at the end of forward is the same."""
    leaves = [Node(f"r{i}", (), UNIT, 1e-5, "aten.rand") for i in range(1, 9)]
    chain = [Node("m0", (), UNIT)] + [
        Node(f"m{i}", (f"m{i - 1}", f"r{i}"), UNIT) for i in range(1, 9)
    ]
    graph = synthetic.from_forward(leaves + chain)
    assert keep_peak(linearize(graph)) == keep_peak(graph)


def test_linearize_keeps_the_order_when_as_late_as_possible_raises_the_peak():
    """``s = sum(big)`` is read only by the loss: ALAP moves it to the end, and ``big`` (10
    units) lives across the whole chain instead of dying at ``a1``."""
    nodes = [Node("big", (), 10 * UNIT), Node("s", ("big",), UNIT)]
    nodes += [Node("a1", ("big",), 5 * UNIT)]
    nodes += [Node(f"a{i}", (f"a{i - 1}",), 5 * UNIT) for i in range(2, 6)]
    nodes += [Node("out", ("a5", "s"), UNIT)]
    graph = forward_only(nodes)
    order = as_late_as_possible_order(graph)
    assert order is not None and order.index("s") > order.index("a2")
    alap = CostGraph.build((graph.op(n) for n in order), graph.tensors.values())
    assert (keep_peak(graph), keep_peak(alap)) == (16 * UNIT, 20 * UNIT)
    assert linearize(graph) is graph


def test_a_forward_op_after_a_backward_op_keeps_its_place():
    ops = [
        Op("a", "aten.mm", "forward", inputs=("x",), outputs=("a",)),
        Op("b", "aten.mm", "backward", inputs=("a",), outputs=("b",), depends_on=("a",)),
        Op("c", "aten.mm", "forward", inputs=("b",), outputs=("c",), depends_on=("b",)),
        Op("d", "aten.mm", "backward", inputs=("c",), outputs=("d",), depends_on=("c",)),
    ]
    tensors = [Tensor("x", 1, "input")] + [Tensor(n, 1, "activation") for n in "abcd"]
    graph = CostGraph.build(ops, tensors)
    assert linearize(graph) is graph


# ---- linearize: properties -----------------------------------------------------------------------

RANDOM_KINDS = ["aten.native_dropout", "aten.bernoulli", "aten.randn_like"]


@st.composite
def forward_nodes(draw) -> list[Node]:
    """Cheap leaves first (as a tracer records them), then random ops reading earlier ones."""
    nodes = [
        Node(f"leaf{j}", (), draw(st.integers(1, 8)) << 10,
             kind=draw(st.sampled_from(["aten.rand", "aten.full", "aten.randn"])))
        for j in range(draw(st.integers(0, 6)))
    ]  # fmt: skip
    for i in range(draw(st.integers(1, 25))):
        earlier = [n.name for n in nodes]
        inputs = (
            draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True)) if earlier else []
        )
        kind = draw(st.sampled_from(["aten.mm", "aten.relu", "aten.sum", *RANDOM_KINDS]))
        nodes.append(Node(f"v{i}", tuple(inputs), draw(st.integers(1, 64)) << 10, kind=kind))
    return nodes


def assert_valid_reordering(graph: CostGraph, linear: CostGraph) -> None:
    assert sorted(linear.ops, key=lambda op: op.name) == sorted(graph.ops, key=lambda op: op.name)
    for op in linear.ops:
        assert all(linear.index[d] < linear.index[op.name] for d in op.depends_on)
    for op in graph.ops:
        if op.phase != "forward":
            assert linear.index[op.name] == graph.index[op.name]
    random_order = [op.name for op in graph.ops if is_random(op)]
    assert [op.name for op in linear.ops if is_random(op)] == random_order
    assert keep_peak(linear) <= keep_peak(graph)


@PROPERTY
@given(nodes=forward_nodes(), training=st.booleans())
def test_linearize_is_a_valid_reordering_that_never_raises_the_peak(nodes, training):
    graph = synthetic.from_forward(nodes) if training else forward_only(nodes)
    assert_valid_reordering(graph, linearize(graph))


@PROPERTY
@given(size=st.integers(2, 40), seed=st.integers(0, 10_000))
def test_linearize_random_dags(size, seed):
    graph = synthetic.random_dag(size, seed)
    assert_valid_reordering(graph, linearize(graph))


def test_linearize_lowers_forward_peaks_somewhere():
    """On random inference graphs with leaves made up front, ALAP often helps and never hurts."""
    lowered = 0
    for seed in range(30):
        graph = synthetic.random_dag(30, seed)
        forward = forward_only(
            [
                Node(op.name, op.depends_on, graph.tensors[op.name].size_bytes)
                for op in graph.forward_ops[:-1]
            ]
        )
        lowered += keep_peak(linearize(forward)) < keep_peak(forward)
    assert lowered > 0
