"""The TFLMS swap strategy's control ops: direct order and the chain rule within [lb, ub], fused
swap-ins and forward branches."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Swap
from memfit.model.schedule import peak_bytes
from memfit.model.synthetic import chain, multi_tower, random_dag, resnet_like
from memfit.planning.strategies.swapping._swap_control import OpGraph, _sorted_unique, chain_rule
from memfit.planning.strategies.swapping.tflms import plan as swap
from tests.planning.strategies.swapping.swap_graphs import HW, MIB, control_ops, swapped, unet

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
