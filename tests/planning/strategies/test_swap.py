"""The TFLMS swap strategy on synthetic graphs: each Table 2 parameter, Figure 4, tuning, validation."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.errors import BudgetError
from memfit.data.hardware import PROFILES
from memfit.data.plan import Plan, Swap
from memfit.model.schedule import check_plan, lower, memory_profile, peak_bytes
from memfit.model.simulate import simulate
from memfit.model.synthetic import Node, chain, from_forward, multi_tower, random_dag, resnet_like
from memfit.planning.strategies import get_strategy, strategy_names
from memfit.planning.strategies._swap_control import OpGraph, _sorted_unique, chain_rule
from memfit.planning.strategies._swap_tune import PeakModel, step_time_s
from memfit.planning.strategies.swap import plan as swap

HW = PROFILES["h100-pcie"]
MIB = 1 << 20


def swapped(plan: Plan) -> set[str]:
    return set(plan.swapped)


def control_ops(plan: Plan, tensor: str) -> list[str]:
    decision = plan.decision(tensor)
    assert isinstance(decision, Swap)
    return [swap_in.after for swap_in in decision.swap_ins]


def with_module_types(graph: CostGraph, module_type: dict[str, str]) -> CostGraph:
    """The same graph with ``Op.module_type`` set from op kind -> class name."""
    ops = [replace(op, module_type=module_type.get(op.kind, "")) for op in graph.ops]
    tensors = [replace(t, consumers=()) for t in graph.tensors.values()]
    return CostGraph.build(ops, tensors, name=graph.name)


def unet(depth: int = 3, skip_bytes: int = 8 * MIB) -> CostGraph:
    """A U-Net: big encoder outputs read again by the decoder through long forward skip edges.

    Gradients are made small (1 MiB) so that the forward phase, holding every skip tensor, sets
    the peak: the case TFLMS's swap_branches is for.
    """
    nodes, previous = [], ()
    for i in range(depth):
        nodes.append(Node(f"enc{i}", previous, skip_bytes, scope=f"down.{i}"))
        for j in range(2):
            nodes.append(Node(f"enc{i}_c{j}", (nodes[-1].name,), MIB, scope=f"down.{i}"))
        previous = (nodes[-1].name,)
    nodes.append(Node("mid", previous, MIB, scope="mid"))
    for i in reversed(range(depth)):
        nodes.append(Node(f"dec{i}", (nodes[-1].name, f"enc{i}"), MIB, kind="aten.cat",
                          scope=f"up.{i}"))
        for j in range(2):
            nodes.append(Node(f"dec{i}_c{j}", (nodes[-1].name,), MIB, scope=f"up.{i}"))
    graph = from_forward(nodes, name="unet")
    tensors = [replace(t, consumers=(), size_bytes=min(t.size_bytes, MIB))
               if t.role == "gradient" else replace(t, consumers=()) for t in graph.tensors.values()]
    return CostGraph.build(graph.ops, tensors, name="unet")


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


# ---- control ops: direct order and chain rule within [lb, ub] --------------------------------------


def test_direct_order_walks_back_lb_ops_from_the_consumer():
    # chain(8): f0 is read by f1_backward (index 16); index 16 - lb is f{lb+1}_backward
    graph = chain(8)
    for lb, expected in ((1, "f2_backward"), (3, "f4_backward"), (5, "f6_backward")):
        plan = swap(graph, HW, ctrld_strategy="direct_order", lb=lb)
        assert control_ops(plan, "f0") == [expected]
        assert f"at lb={lb} (direct_order)" in plan.decision("f0").reason


def test_chain_rule_walks_down_the_forward_ops():
    # level L from f0 is f{L}; its backward reader is f{L+1}_backward (it saved f{L})
    graph = chain(8)
    for lb, expected in ((1, "f2_backward"), (2, "f3_backward"), (4, "f5_backward")):
        plan = swap(graph, HW, lb=lb)
        assert control_ops(plan, "f0") == [expected]
        assert f"at lb={lb} (chain_rule)" in plan.decision("f0").reason


def walked_chain_rule(ops: OpGraph, producer: int, target: int, lb: int, ub: int) -> int | None:
    """Algorithm 2 walked afresh at every call (no remembered levels)."""
    for level in range(lb, ub + 1):
        frontier = ops.forward_level(producer, level)
        if not frontier:
            return None
        found = [user for op in frontier for user in ops.backward_users[op]
                 if producer < user < target and ops.reaches(user, target)]
        if found:
            return max(found)
    return None


@pytest.mark.parametrize("graph", [chain(12), resnet_like(4), multi_tower(3, 5),
                                   random_dag(30, seed=4)], ids=lambda g: g.name)
def test_chain_rule_remembers_levels_without_changing_an_answer(graph):
    ops, fresh = OpGraph(graph), OpGraph(graph)
    forward = [i for i, phase in enumerate(ops.phase) if phase == "forward"]
    backward = [i for i, phase in enumerate(ops.phase) if phase == "backward"]
    queries = [(p, t, lb, ub) for p in forward for t in backward[::3]
               for lb, ub in ((1, 3), (2, 40), (5, 8), (1, 1000))]
    random.Random(0).shuffle(queries)  # ladders ask in any order; the cache must not care
    for producer, target, lb, ub in queries:
        assert chain_rule(ops, producer, target, lb, ub) == walked_chain_rule(
            fresh, producer, target, lb, ub)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-5, 40), max_size=60))
def test_sorted_unique_is_numpy_unique(values):
    array = np.asarray(values, dtype=np.int64)
    assert _sorted_unique(array).tolist() == np.unique(array).tolist()


def test_out_of_range_bounds_fall_back_to_the_latest_swap_in():
    graph = chain(8)  # f6 (index 6) is read by f7_backward (index 10)
    direct = swap(graph, HW, ctrld_strategy="direct_order", lb=3, ub=3)
    assert control_ops(direct, "f6") == ["f7"]  # 10 - 3 = 7, after the producer
    direct = swap(graph, HW, ctrld_strategy="direct_order", lb=5, ub=8)
    assert control_ops(direct, "f6") == ["loss_backward"]  # 10 - 5 <= 6: nothing in range
    assert "right before f7_backward: direct_order found no control op in [lb=5, ub=8]" in (
        direct.decision("f6").reason)
    chained = swap(graph, HW, lb=3)  # level 3 from f6 is past the last forward op
    assert control_ops(chained, "f6") == ["loss_backward"]
    assert "found no control op in [lb=3, ub=10000]" in chained.decision("f6").reason
    narrow = swap(graph, HW, lb=2, ub=2)
    assert control_ops(narrow, "f0") == ["f3_backward"]


def test_control_op_never_precedes_the_last_read_of_the_original():
    # enc0 is read by dec0 (index 16, a forward skip edge: not rewritten by default) and by
    # dec0_backward (index 23); direct order with lb 8 picks index 15, while the original is
    # still alive: the swap-in is clamped to right after dec0
    graph = unet()
    assert (graph.index["dec0"], graph.index["dec0_backward"]) == (16, 23)
    plan = swap(graph, HW, ctrld_strategy="direct_order", lb=8)
    assert control_ops(plan, "enc0")[0] == "dec0"
    assert "the original's last use (direct_order chose an earlier op)" in (
        plan.decision("enc0").reason)


def test_rewritten_consumer_before_a_later_reader_of_the_original_reads_the_original():
    # t is read by a backward op 5 ops after its producer and again by an update op later: the
    # original stays alive until the update anyway, so copying it in for the backward op would
    # only add memory; t is not swapped
    names = ["a", "b", "f1", "f2", "g1", "g2", "c", "u"]
    phases = ["forward", "forward", "forward", "forward", "backward", "backward", "backward",
              "update"]
    ops = [Op(name, "aten.mm", phase, inputs=(("t",) if name in ("b", "c", "u") else ()),
              outputs=(() if name == "a" else (f"o_{name}",)) + (("t",) if name == "a" else ()),
              depends_on=((names[i - 1],) if i else ()))
           for i, (name, phase) in enumerate(zip(names, phases, strict=True))]
    tensors = [Tensor("t", MIB, "activation")] + [
        Tensor(f"o_{name}", MIB, "activation", is_output=True) for name in names[1:]]
    graph = CostGraph.build(ops, tensors)
    assert swapped(swap(graph, HW, threshold=3)) == set()


# ---- fusing swap-ins and forward branches ----------------------------------------------------------


def test_fuse_swapins_merges_close_consumers():
    graph = resnet_like(3)
    plain, fused = swap(graph, HW), swap(graph, HW, fuse_swapins=True)
    assert swapped(plain) == swapped(fused)
    assert plain.swap_in_count > fused.swap_in_count
    # each block input is read by the block's add and conv1 backward ops, a few ops apart
    assert len(control_ops(plain, "b0_add")) == 2 and len(control_ops(fused, "b0_add")) == 1
    assert swap(graph, HW, fuse_swapins=True, fuse_distance=0).swap_in_count == plain.swap_in_count


def test_swap_branches_rewrites_long_forward_skip_edges():
    graph = unet()
    default = swap(graph, HW)
    served = {c for name in default.swapped for s in default.decision(name).swap_ins
              for c in s.consumers}
    assert served and all(graph.op(c).phase == "backward" for c in served)
    branches = swap(graph, HW, swap_branches=True, branch_threshold=2)
    decision = branches.decision("enc0")
    assert isinstance(decision, Swap)
    assert decision.swap_ins[0].consumers == ("dec0",)  # the skip edge, 16 ops long
    assert decision.reason.startswith("saved for forward branch, 16 ops apart")
    # enc0 -> enc0_c0 is 1 op apart and keeps the original, so the copy comes after it
    assert graph.index[decision.swap_ins[0].after] >= graph.index["enc0_c0"]
    assert peak_bytes(graph, branches) < peak_bytes(graph, default)
    # with a branch threshold above every skip edge, nothing in the forward phase is rewritten
    long = swap(graph, HW, swap_branches=True, branch_threshold=100)
    assert long.decisions == default.decisions


# ---- tuning to a budget ----------------------------------------------------------------------------


@pytest.mark.parametrize("size_bytes", [MIB, 64 * MIB])  # copies hidden; copies stall compute
def test_budget_between_swap_all_and_keep_fits_and_is_no_slower(size_bytes):
    graph = chain(64, size_bytes=size_bytes)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    swap_all = swap(graph, HW)
    floor = peak_bytes(graph, swap_all)
    for budget in (floor, (floor + keep_peak) // 2, keep_peak - 1):
        plan = swap(graph, HW, budget_bytes=budget)
        assert memory_profile(lower(graph, plan)).peak_bytes <= budget
        assert simulate(graph, plan, HW).step_time_s <= simulate(graph, swap_all, HW).step_time_s
        assert plan.budget_bytes == budget
        assert swap(graph, HW, **plan.params).decisions == plan.decisions  # params reproduce it
    assert 0 < swap(graph, HW, budget_bytes=(floor + keep_peak) // 2).params["n_tensors"] < 63


def test_budget_above_the_unplanned_peak_swaps_nothing():
    graph = chain(16)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    plan = swap(graph, HW, budget_bytes=keep_peak)
    assert plan.swapped == () and plan.params["n_tensors"] == 0


def test_budget_below_the_minimum_raises_with_the_swap_all_peak():
    graph = chain(32)
    floor = peak_bytes(graph, swap(graph, HW))
    with pytest.raises(BudgetError) as error:
        swap(graph, HW, budget_bytes=floor - 1)
    assert error.value.minimum_bytes == floor and error.value.strategy == "swap"
    assert error.value.dominant and error.value.dominant[0][1] == MIB


def test_tuning_keeps_given_parameters():
    graph = chain(64)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    budget = (peak_bytes(graph, swap(graph, HW)) + keep_peak) // 2
    plan = swap(graph, HW, budget_bytes=budget, lb=3, ctrld_strategy="direct_order")
    assert plan.params["lb"] == 3 and plan.params["ctrld_strategy"] == "direct_order"
    assert peak_bytes(graph, plan) <= budget
    fixed = swap(graph, HW, budget_bytes=budget, n_tensors=-1)
    assert fixed.params["n_tensors"] == -1 and len(fixed.swapped) == 63
    with pytest.raises(BudgetError):  # too few tensors to fit, and n_tensors is not tuned
        swap(graph, HW, budget_bytes=budget, n_tensors=2)
    narrow = swap(graph, HW, budget_bytes=budget, ub=2)
    assert narrow.params["lb"] <= 2


def test_tuning_turns_on_swap_branches_only_when_needed():
    graph = unet()
    without = peak_bytes(graph, swap(graph, HW))
    with_branches = peak_bytes(graph, swap(graph, HW, swap_branches=True, branch_threshold=1))
    assert with_branches < without
    plan = swap(graph, HW, budget_bytes=(without + with_branches) // 2)
    assert plan.params["swap_branches"] is True and plan.params["branch_threshold"] == 1
    assert peak_bytes(graph, plan) <= (without + with_branches) // 2
    assert swap(graph, HW, budget_bytes=without).params["swap_branches"] is False
    with pytest.raises(BudgetError) as error:
        swap(graph, HW, budget_bytes=without - 1, swap_branches=False)
    assert error.value.minimum_bytes == without
    with pytest.raises(BudgetError) as error:
        swap(graph, HW, budget_bytes=with_branches - 1)
    assert error.value.minimum_bytes == with_branches


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
    ({"optimizer_scopes": ["adam"]}, r"unknown parameter\(s\) \['optimizer_scopes'\]; accepted"),
])
def test_bad_parameters_are_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        swap(chain(4), HW, **params)


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GiB"])
def test_bad_budget_is_rejected(budget):
    with pytest.raises(ValueError, match="budget_bytes must be a positive int or None"):
        swap(chain(4), HW, budget_bytes=budget)


# ---- properties on random graphs ------------------------------------------------------------------

PARAMS = st.fixed_dictionaries({}, optional={
    "threshold": st.integers(0, 8),
    "n_tensors": st.integers(-1, 40),
    "lb": st.integers(0, 6),
    "ctrld_strategy": st.sampled_from(["chain_rule", "direct_order"]),
    "fuse_swapins": st.booleans(),
    "fuse_distance": st.integers(0, 12),
    "swap_branches": st.booleans(),
    "branch_threshold": st.integers(0, 5),
    "excl_types": st.sampled_from([[], ["relu"], ["aten.add"]]),
    "incl_scopes": st.sampled_from([[], ["block1*"], ["block0", "block2"]]),
})


def check_swap_ins(graph: CostGraph, plan: Plan) -> None:
    """Every swap-in runs after the original's last read and before each consumer it serves."""
    check_plan(graph, plan)
    for name in plan.swapped:
        tensor, decision = graph.tensors[name], plan.decision(name)
        assert isinstance(decision, Swap)
        served = {c: s.after for s in decision.swap_ins for c in s.consumers}
        original_last = max([graph.index[str(tensor.producer)],
                             *(graph.index[c] for c in tensor.consumers if c not in served)])
        for consumer, after in served.items():
            assert original_last <= graph.index[after] < graph.index[consumer]
        for consumer in tensor.consumers:  # backward readers: a copy issued before, or the original
            if graph.op(consumer).phase == "backward" and consumer not in served:
                assert graph.index[consumer] <= original_last


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), params=PARAMS)
def test_random_plans_are_valid_and_the_tuner_models_are_exact(size, seed, params):
    graph = random_dag(size, seed=seed)
    params = dict(params)
    if params.get("lb", 1) > 1 and "ub" not in params:
        params["ub"] = params["lb"] + seed % 4
    plan = swap(graph, HW, **params)
    check_swap_ins(graph, plan)
    model = PeakModel(graph)
    assert model.peak(model.events(list(plan.decisions.items())), len(plan.decisions)) == (
        peak_bytes(graph, plan))
    slow_link = HW.with_(d2h_bytes_per_s=1e8, h2d_bytes_per_s=1e8)  # copies stall compute
    for hardware in (HW, PROFILES["cpu"], slow_link, slow_link.with_(duplex=False)):
        assert step_time_s(graph, plan, hardware) == simulate(graph, plan, hardware).step_time_s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), fraction=st.floats(0.5, 1.1),
       params=PARAMS)
def test_random_budgets_fit_or_raise(size, seed, fraction, params):
    graph = random_dag(size, seed=seed)
    budget = max(1, int(fraction * peak_bytes(graph, get_strategy("keep")(graph, HW))))
    try:
        plan = swap(graph, HW, budget_bytes=budget, **params)
    except BudgetError as error:
        assert error.minimum_bytes > budget
        return
    check_swap_ins(graph, plan)
    assert simulate(graph, plan, HW).peak_bytes <= budget
    assert memory_profile(lower(graph, plan)).peak_bytes <= budget


@settings(max_examples=30, deadline=None)
@given(size=st.integers(2, 60), seed=st.integers(0, 10_000), fan_in=st.integers(1, 4))
def test_forward_levels_are_breadth_first_levels(size, seed, fan_in):
    ops = OpGraph(random_dag(size, seed=seed, max_inputs=fan_in))
    for producer, phase in enumerate(ops.phase):
        if phase != "forward":
            continue
        level, seen, depth = [producer], {producer}, 0
        while level:
            assert sorted(ops.forward_level(producer, depth)) == level
            level = sorted({u for op in level for u in ops.forward_users[op]} - seen)
            seen.update(level)
            depth += 1
        assert ops.forward_level(producer, depth) == ops.forward_level(producer, depth + 9) == []


def test_tuning_scales_to_ten_thousand_ops():
    """A loose bound that catches a quadratic slip, not noise (about 1 s here)."""
    graph = chain(5000)
    keep_peak = peak_bytes(graph, get_strategy("keep")(graph, HW))
    budget = (peak_bytes(graph, swap(graph, HW)) + keep_peak) // 2
    start = time.perf_counter()
    plan = swap(graph, HW, budget_bytes=budget)
    assert time.perf_counter() - start < 20
    assert simulate(graph, plan, HW, record_intervals=False).peak_bytes <= budget
