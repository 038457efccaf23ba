"""auto's just-in-time swap candidate (vDNN with zero lookahead), on synthetic graphs, no torch.

What is checked: every swap-in is issued after the op right before its first reader; every
feature map is swapped except those whose original lives up to that op; the plan passes
``check_plan``; its peak is never above vdnn_all's (one layer of lookahead) and falls below it
where layers span several ops; with a budget it fits or raises ``BudgetError`` whose minimum
itself fits; and auto's smallest peak with the candidate is never above auto's without it, and
lower on transformer-like blocks, whose inputs are read by backward ops far apart.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Swap
from memfit.model import synthetic
from memfit.model.schedule import check_plan
from memfit.model.simulate import simulate
from memfit.planning.strategies import auto, get_strategy
from memfit.planning.strategies.swapping import _just_in_time_swap
from memfit.planning.strategies.swapping._vdnn_layers import LayerView
from tests.model.tiny import tiny_graph

HARDWARE = ("cpu", "h100-pcie")
LAYER_OPS = 3  # forward ops per module scope in the layered chain


def layered_chain(length: int = 12) -> CostGraph:
    """``synthetic.chain`` whose ops carry module scopes, ``LAYER_OPS`` chain links per module
    (forward and backward alike), so that vDNN's layers span several ops as on a transformer."""
    graph = synthetic.chain(length)
    ops = []
    for op in graph.ops:
        link = op.name.removesuffix("_backward").removeprefix("f")
        scope = f"block{int(link) // LAYER_OPS}" if link.isdigit() else ""
        ops.append(replace(op, scope=scope))
    return CostGraph.build(ops, list(graph.tensors.values()), name="layered_chain")


def attention_blocks(blocks: int = 2, scores_ratio: int = 2) -> CostGraph:
    """Transformer-like blocks: q, k, v read the residual stream, scores (``scores_ratio`` times
    larger) from q and k, softmax, context from probabilities and v, a residual add. Each
    block's input is read by four forward ops, so four backward ops far apart read it again."""
    mebibyte = 1 << 20
    nodes = [synthetic.Node("embed", (), mebibyte, scope="embed")]
    stream = "embed"
    for block in range(blocks):
        scope = f"layer.{block}"
        q, k, v, s, p, o = (f"{name}{block}" for name in "qkvspo")
        nodes += [
            synthetic.Node(q, (stream,), mebibyte, scope=f"{scope}.query"),
            synthetic.Node(k, (stream,), mebibyte, scope=f"{scope}.key"),
            synthetic.Node(v, (stream,), mebibyte, scope=f"{scope}.value"),
            synthetic.Node(s, (q, k), scores_ratio * mebibyte, kind="aten.bmm", scope=f"{scope}.core"),
            synthetic.Node(p, (s,), scores_ratio * mebibyte, kind="aten._softmax", scope=f"{scope}.core"),
            synthetic.Node(o, (p, v), mebibyte, kind="aten.bmm", scope=f"{scope}.core"),
            synthetic.Node(f"h{block}", (o, stream), mebibyte, kind="aten.add", scope=f"{scope}.out"),
        ]
        stream = f"h{block}"
    return synthetic.from_forward(nodes, name=f"attention{blocks}")


GRAPHS = {
    "tiny": tiny_graph,
    "attention": attention_blocks,
    "chain": lambda: synthetic.chain(16),
    "layered_chain": layered_chain,
    "resnet_like": lambda: synthetic.resnet_like(4),
    "towers": lambda: synthetic.multi_tower(3, 4),
    "random_dag": lambda: synthetic.random_dag(40, seed=3),
}


def peak(graph: CostGraph, made: Plan, profile: str = "cpu") -> int:
    return simulate(graph, made, get_hardware(profile), record_intervals=False).peak_bytes


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_each_copy_comes_back_right_before_its_run_of_readers(name):
    """Per feature map: each copy back is issued after the op right before the first reader it
    serves and serves a run of adjacent readers; different copies' runs have an op between
    them; readers no copy serves form the run right after the last forward read (served by
    the original); a map with no other run is not swapped."""
    graph = GRAPHS[name]()
    made = _just_in_time_swap.plan(graph, get_hardware("cpu"))
    check_plan(graph, made)
    maps = LayerView(graph).maps
    for feature in maps:
        decision = made.decisions.get(feature.tensor)
        served = [[graph.index[c] for c in swap_in.consumers]
                  for swap_in in (decision.swap_ins if isinstance(decision, Swap) else ())]
        for swap_in, run in zip(decision.swap_ins if decision else (), served, strict=True):
            assert graph.index[swap_in.after] == run[0] - 1 > feature.floor
            assert run == list(range(run[0], run[-1] + 1))
        for earlier, later in pairwise(served):
            assert later[0] - earlier[-1] > 1
        by_original = sorted(set(feature.consumers) - {c for run in served for c in run})
        assert by_original == list(range(feature.floor + 1, feature.floor + 1 + len(by_original)))
        if decision is None:
            assert by_original == list(feature.consumers)
    assert made.decisions and set(made.decisions) <= {feature.tensor for feature in maps}
    assert any(len(d.swap_ins) > 1 for d in made.decisions.values() if isinstance(d, Swap)) \
        or name in ("tiny", "chain", "layered_chain"), "a value read by backward ops far apart"


@pytest.mark.parametrize("profile", HARDWARE)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_never_above_vdnn_all_and_below_it_where_layers_span_ops(name, profile):
    graph = GRAPHS[name]()
    hardware = get_hardware(profile)
    just_in_time = peak(graph, _just_in_time_swap.plan(graph, hardware), profile)
    one_layer_ahead = peak(graph, get_strategy("vdnn_all")(graph, hardware), profile)
    assert just_in_time <= one_layer_ahead <= peak(graph, Plan("keep"), profile)
    if name == "layered_chain":
        assert just_in_time < one_layer_ahead


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_with_a_budget_it_fits_or_names_a_minimum_that_fits(name):
    graph, hardware = GRAPHS[name](), get_hardware("cpu")
    lowest = peak(graph, _just_in_time_swap.plan(graph, hardware))
    with pytest.raises(BudgetError) as refused:
        _just_in_time_swap.plan(graph, hardware, lowest - 1)
    assert refused.value.minimum_bytes == lowest
    made = _just_in_time_swap.plan(graph, hardware, refused.value.minimum_bytes)
    assert peak(graph, made) <= refused.value.minimum_bytes


def auto_minimum_bytes(graph: CostGraph, profile: str) -> int:
    with pytest.raises(BudgetError) as refused:
        auto.plan(graph, get_hardware(profile), 1)
    return refused.value.minimum_bytes


@pytest.mark.parametrize("profile", HARDWARE)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_auto_floor_never_rises_and_falls_where_readers_are_far_apart(name, profile, monkeypatch):
    graph = GRAPHS[name]()
    with_candidate = auto_minimum_bytes(graph, profile)
    assert with_candidate <= peak(graph, _just_in_time_swap.plan(graph, get_hardware(profile)),
                                  profile)
    made = auto.plan(graph, get_hardware(profile), with_candidate)  # auto fits at its minimum
    assert peak(graph, made, profile) <= with_candidate
    # auto as it was: the candidate makes no plan
    monkeypatch.setattr(_just_in_time_swap, "plan", lambda *_args, **_named: None)
    without = auto_minimum_bytes(graph, profile)
    assert with_candidate <= without
    if name == "attention":  # the DP and TFLMS keep a block's input through its backward
        assert with_candidate < without
