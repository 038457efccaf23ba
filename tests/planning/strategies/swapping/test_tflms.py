"""The TFLMS swap strategy on synthetic graphs: each Table 2 parameter, Figure 4, the filters,
validation (control ops: test_swap_control.py; tuning and random graphs: test_swap_tune.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Plan, Swap
from memfit.model.schedule import lower, peak_bytes
from memfit.model.synthetic import Node, chain, from_forward, multi_tower, resnet_like
from memfit.planning.strategies import get_strategy, strategy_names
from memfit.planning.strategies.swapping.tflms import plan as swap
from tests.planning.strategies.swapping.swap_graphs import HW, MIB, control_ops, swapped


def with_module_types(graph: CostGraph, module_type: dict[str, str]) -> CostGraph:
    """The same graph with ``Op.module_type`` set from op kind -> class name."""
    ops = [replace(op, module_type=module_type.get(op.kind, "")) for op in graph.ops]
    tensors = [replace(t, consumers=()) for t in graph.tensors.values()]
    return CostGraph.build(ops, tensors, name=graph.name)



# ---- registration and the plan's metadata --------------------------------------------------------


def test_registered_and_plan_metadata():
    assert "swap" in strategy_names()
    graph = chain(6)
    plan = get_strategy("swap")(graph, HW)
    assert plan.strategy == "swap" and plan.graph_hash == graph.structure_hash
    assert plan.hardware == HW.name and plan.budget_bytes is None
    assert plan.params["threshold"] == 1 and plan.params["ctrld_strategy"] == "chain_rule"
    assert Plan.from_json(plan.to_json()).decisions == plan.decisions
    assert all("ops apart" in d.reason for d in plan.decisions.values())


def test_default_swaps_every_saved_activation_of_a_chain():
    plan = swap(chain(8), HW)
    assert swapped(plan) == {f"f{i}" for i in range(7)}  # f7 is read by the loss only
    assert peak_bytes(chain(8), plan) < peak_bytes(chain(8), get_strategy("keep")(chain(8), HW))


# ---- Figure 4 ------------------------------------------------------------------------------------


def figure4() -> CostGraph:
    """Figure 4: op ``e`` (order 10) feeds ``f`` (order 11), ``g`` (18) and ``h`` (25).

    Ops 0..12 are a forward chain, 13..26 a backward chain; only ``e`` has far consumers.
    """
    names = [f"n{i}" for i in range(27)]
    names[10], names[11], names[18], names[25] = "e", "f", "g", "h"
    ops = []
    for i, name in enumerate(names):
        phase = "forward" if i <= 12 else "backward"
        depends = (names[i - 1],) if i else ()
        if name in ("f", "g", "h"):
            depends = tuple(dict.fromkeys((*depends, "e")))
        inputs = tuple(f"t_{d}" for d in depends)
        ops.append(Op(name, "aten.mm", phase, inputs=inputs, outputs=(f"t_{name}",),
                      depends_on=depends, time_s=1e-3))
    tensors = [Tensor(f"t_{name}", MIB, "activation" if i <= 12 else "gradient",
                      is_output=(i == 26)) for i, name in enumerate(names)]
    return CostGraph.build(ops, tensors, name="figure4")


def test_figure4_rewrites_the_two_long_edges():
    graph = figure4()
    plan = swap(graph, HW, threshold=3, ctrld_strategy="direct_order", lb=3)
    assert swapped(plan) == {"t_e"}  # one tensor, so one (fused) swap-out
    decision = plan.decision("t_e")
    assert isinstance(decision, Swap)
    # e -> f is 1 op apart (not rewritten: f reads the original); e -> g, e -> h are 8 and 15.
    assert [s.consumers for s in decision.swap_ins] == [("g",), ("h",)]
    # direct-order with lb=3: the swap-ins follow the ops 3 before g (order 15) and h (order 22).
    assert control_ops(plan, "t_e") == ["n15", "n22"]
    kinds = [a.kind for a in lower(graph, plan).actions]
    assert kinds.count("swap_out") == 1 and kinds.count("swap_in") == 2


def test_figure4_fused_swap_in_serves_both_consumers():
    graph = figure4()
    fused = swap(graph, HW, threshold=3, ctrld_strategy="direct_order", lb=3, fuse_swapins=True)
    decision = fused.decision("t_e")
    assert isinstance(decision, Swap)
    assert [(s.after, s.consumers) for s in decision.swap_ins] == [("n15", ("g", "h"))]
    assert [a.kind for a in lower(graph, fused).actions].count("swap_in") == 1
    apart = swap(graph, HW, threshold=3, fuse_swapins=True, fuse_distance=6)  # g, h are 7 apart
    assert apart.swap_in_count == 2


# ---- threshold, n_tensors, starting point ----------------------------------------------------------


def test_threshold_rewrites_only_edges_longer_than_it():
    # f{i} is read by f{i+1}_backward, 16 - 2i ops later
    assert swapped(swap(chain(8), HW, threshold=8)) == {"f0", "f1", "f2", "f3"}
    assert swapped(swap(chain(8), HW, threshold=0)) == {f"f{i}" for i in range(7)}
    assert swapped(swap(chain(8), HW, threshold=16)) == set()


def test_n_tensors_counts_in_breadth_first_order():
    assert list(swap(chain(8), HW, n_tensors=3).swapped) == ["f0", "f1", "f2"]
    assert swapped(swap(chain(8), HW, n_tensors=0)) == set()
    assert len(swap(chain(8), HW, n_tensors=100).swapped) == 7
    # execution order is stem, t0_0, t0_1, t0_2, t1_0, ...; BFS goes level by level
    towers = multi_tower(2, 3)
    assert list(swap(towers, HW, n_tensors=3).swapped) == ["stem", "t0_0", "t1_0"]
    assert list(swap(towers, HW, n_tensors=5).swapped) == ["stem", "t0_0", "t1_0", "t0_1", "t1_1"]


def test_starting_scope_and_op_names_limit_to_reachable_tensors():
    assert swapped(swap(chain(8), HW, starting_scope="layers.5")) == {"f5", "f6"}
    assert swapped(swap(chain(8), HW, starting_op_names=["f4"])) == {"f4", "f5", "f6"}
    towers = multi_tower(2, 3)
    assert swapped(swap(towers, HW, starting_scope="tower1*")) == {"t1_0", "t1_1", "t1_2"}
    both = swap(towers, HW, starting_scope="tower1*", starting_op_names="t0_2")
    assert swapped(both) == {"t1_0", "t1_1", "t1_2", "t0_2"}
    assert list(swap(chain(8), HW, starting_scope="layers.5", n_tensors=1).swapped) == ["f5"]


def test_starting_point_that_names_nothing_is_an_error():
    with pytest.raises(ValueError, match="not ops of this graph"):
        swap(chain(4), HW, starting_op_names=["nope"])
    with pytest.raises(ValueError, match="name no forward op"):
        swap(chain(4), HW, starting_scope="encoder.*")


# ---- include / exclude filters ---------------------------------------------------------------------


def test_scopes_filter_producers_and_exclusion_wins():
    all_saved = {f"f{i}" for i in range(7)}
    assert swapped(swap(chain(8), HW, excl_scopes=["layers.1", "layers.2"])) == all_saved - {
        "f1", "f2"}
    assert swapped(swap(chain(8), HW, incl_scopes=["layers.[0-3]"])) == {"f0", "f1", "f2", "f3"}
    assert swapped(swap(chain(8), HW, incl_scopes="layers.*", excl_scopes="layers.2")) == (
        all_saved - {"f2"})


def test_scope_globs_match_submodules():
    nodes = [Node("wte", (), scope="transformer.wte"),
             Node("attn3", ("wte",), scope="transformer.h.3.attn"),
             Node("mlp3", ("attn3",), scope="transformer.h.3.mlp"),
             Node("attn10", ("mlp3",), scope="transformer.h.10.attn"),
             Node("head", ("attn10",), scope="lm_head")]
    graph = from_forward(nodes)
    assert swapped(swap(graph, HW, incl_scopes=["transformer.h.*"])) == {"attn3", "mlp3", "attn10"}
    # a plain module path covers what is under it, and only that ("h.1" is not "h.10")
    assert swapped(swap(graph, HW, incl_scopes=["transformer.h.3"])) == {"attn3", "mlp3"}
    assert swapped(swap(graph, HW, excl_scopes=["transformer"])) == set()


def test_types_match_op_kinds_in_every_spelling():
    graph = resnet_like(2)
    convs = {"stem", "b0_conv1", "b0_conv2", "b1_conv1", "b1_conv2"}
    for spelling in ("convolution", "aten.convolution", "aten.convolution.default"):
        assert swapped(swap(graph, HW, incl_types=[spelling])) == convs
    no_relu = swapped(swap(graph, HW, excl_types=["aten.relu.default"]))
    assert no_relu and not {"b0_relu", "b1_relu"} & no_relu
    assert swapped(swap(graph, HW, incl_types=["relu"], excl_types=["relu"])) == set()


def test_types_match_module_class_names():
    graph = with_module_types(resnet_like(2), {"aten.convolution": "Conv2d", "aten.relu": "ReLU"})
    convs = {"stem", "b0_conv1", "b0_conv2", "b1_conv1", "b1_conv2"}
    assert swapped(swap(graph, HW, incl_types=["Conv2d"])) == convs
    assert swapped(swap(graph, HW, incl_types=["Conv2d", "relu"])) == convs | {"b0_relu", "b1_relu"}
    assert not {"b0_relu", "b1_relu"} & swapped(swap(graph, HW, excl_types=["ReLU"]))


# ---- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "message"), [
    ({"threshold": -1}, "threshold must be an int >= 0"),
    ({"threshold": 1.5}, "threshold must be an int"),
    ({"threshold": True}, "threshold must be an int"),
    ({"n_tensors": -2}, "n_tensors must be an int >= -1"),
    ({"lb": -1}, "lb must be an int >= 0"),
    ({"ub": "10"}, "ub must be an int"),
    ({"lb": 5, "ub": 3}, r"lb \(5\) must not exceed ub \(3\)"),
    ({"ctrld_strategy": "random"}, r"one of \['chain_rule', 'direct_order'\]"),
    ({"fuse_swapins": "yes"}, "fuse_swapins must be True or False"),
    ({"swap_branches": 1}, "swap_branches must be True or False"),
    ({"fuse_distance": -1}, "fuse_distance must be an int >= 0"),
    ({"branch_threshold": -3}, "branch_threshold must be an int >= 0"),
    ({"starting_scope": 3}, "starting_scope must be a glob string or None"),
    ({"starting_op_names": [1]}, "starting_op_names must be a string or a list of strings"),
    ({"incl_scopes": 5}, "incl_scopes must be a string or a list of strings"),
    ({"excl_types": {"a": 1}}, "excl_types must be a string or a list of strings"),
    ({"incl_types": [None]}, "incl_types must be a string or a list of strings"),
    ({"excl_scopes": 2.0}, "excl_scopes must be a string or a list of strings"),
    ({"optimizer_scopes": ["adam"]}, r"^strategy 'swap' got unknown parameters \['optimizer_scopes'\]; "
                                     r"it accepts threshold=, n_tensors=, .* and branch_threshold=$"),
])
def test_bad_parameters_are_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        swap(chain(4), HW, **params)


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GiB"])
def test_bad_budget_is_rejected(budget):
    with pytest.raises(ValueError, match="budget_bytes must be a positive int or None"):
        swap(chain(4), HW, budget_bytes=budget)
