"""Host memory of a plan, torch-free: the interval model against the lowered program, and the
greedy admission that keeps a strategy's swaps within ``host_bytes``.

What is checked: ``host_peak_bytes`` (op-position intervals from the plan) equals a walk of
``lower(graph, plan)``'s actions (a copy on the host from its swap-out to its last swap-in) on
plans of every swapping strategy, re-run-fed swap-ins included; ``simulate`` reports it;
``within_host`` and ``host_prefix`` never let the host peak pass the limit and drop nothing
without one; a ``Timeline`` keeps its host peak through JSON.
"""

from __future__ import annotations

import pytest

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Swap
from memfit.data.timeline import Timeline
from memfit.model import synthetic
from memfit.model.host_memory import host_peak_bytes, host_prefix, within_host
from memfit.model.schedule import lower, peak_bytes
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.auto import _swapped_checkpoints
from memfit.planning.strategies.swapping import _just_in_time_swap

GRAPHS = {
    "chain": lambda: synthetic.chain(10),
    "resnet_like": lambda: synthetic.resnet_like(4),
    "multi_tower": lambda: synthetic.multi_tower(3, 4),
    "random_dag": lambda: synthetic.random_dag(40, seed=3),
}
SWAPPING = ("swap", "vdnn_all", "vdnn_dyn", "jit-swap")
H100 = get_hardware("h100-pcie").with_(host_bytes=None)


def host_peak_by_actions(graph: CostGraph, plan: Plan) -> int:
    """The host peak read off the lowered program: a copy joins at its swap-out and leaves
    right after its last swap-in action."""
    actions = lower(graph, plan).actions
    last_in = {action.tensor: index for index, action in enumerate(actions)
               if action.kind == "swap_in"}
    held = peak = 0
    for index, action in enumerate(actions):
        if action.kind == "swap_out":
            held += graph.tensors[action.tensor].size_bytes
        peak = max(peak, held)
        for tensor, last in last_in.items():
            if last == index:
                held -= graph.tensors[tensor].size_bytes
    return peak


def swap_plan(graph: CostGraph, strategy: str) -> Plan:
    """A plan that swaps: TFLMS's and vDNN's defaults, the just-in-time candidate, and vdnn_dyn
    at vdnn_all's peak (where vdnn_all fits, vdnn_dyn does)."""
    if strategy == "jit-swap":
        return _just_in_time_swap.plan(graph, H100)
    if strategy == "vdnn_dyn":
        budget_bytes = simulate(graph, swap_plan(graph, "vdnn_all"), H100).peak_bytes
        return get_strategy(strategy)(graph, H100, budget_bytes)
    return get_strategy(strategy)(graph, H100)


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("strategy", SWAPPING)
def test_the_interval_model_is_the_lowered_program(graph_name, strategy):
    graph = GRAPHS[graph_name]()
    made = swap_plan(graph, strategy)
    expected = host_peak_by_actions(graph, made)
    assert host_peak_bytes(graph, made) == expected
    assert simulate(graph, made, H100).host_peak_bytes == expected
    assert (expected > 0) == bool(made.swapped)


@pytest.mark.parametrize(("graph", "fraction"), [(synthetic.chain(16), 0.5),
                                                 (synthetic.resnet_like(6), 0.4)])
def test_swap_ins_that_feed_reruns_are_counted_to_the_last_copy(graph, fraction):
    """auto's swapped checkpoints: a checkpoint's host copy lives until the swap-in before its
    re-runs (a ``SwapIn`` naming a forward reader), which the interval model must reach."""
    made = _swapped_checkpoints(graph, H100, int(fraction * peak_bytes(graph, Plan("keep"))))
    assert made is not None and made.recomputed
    feeds_reruns = [swap_in for decision in made.decisions.values() if isinstance(decision, Swap)
                    for swap_in in decision.swap_ins
                    if any(graph.index[c] <= graph.index[swap_in.after] for c in swap_in.consumers)]
    assert feeds_reruns
    assert host_peak_bytes(graph, made) == host_peak_by_actions(graph, made) > 0


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_greedy_admission_stays_within_the_limit(graph_name):
    graph = GRAPHS[graph_name]()
    made = get_strategy("vdnn_all")(graph, H100)
    unlimited = host_peak_bytes(graph, made)
    assert within_host(graph, made.decisions, None) == (dict(made.decisions), ())
    swaps = [(t, d) for t, d in made.decisions.items() if isinstance(d, Swap)]
    assert host_prefix(graph, swaps, None) == len(swaps)
    for limit in (0, unlimited // 3, unlimited // 2, unlimited - 1, unlimited):
        kept, dropped = within_host(graph, made.decisions, limit)
        trimmed = Plan("vdnn_all", kept, graph_hash=graph.structure_hash)
        assert host_peak_bytes(graph, trimmed) <= limit
        assert set(kept) | set(dropped) == set(made.decisions)
        assert bool(dropped) == (limit < unlimited)
        count = host_prefix(graph, swaps, limit)
        prefix = Plan("swap", dict(swaps[:count]), graph_hash=graph.structure_hash)
        assert host_peak_bytes(graph, prefix) <= limit
        if count < len(swaps):  # one more would not fit
            longer = Plan("swap", dict(swaps[:count + 1]), graph_hash=graph.structure_hash)
            assert host_peak_bytes(graph, longer) > limit


def test_a_timeline_keeps_its_host_peak_through_json():
    graph = synthetic.chain(8)
    timeline = simulate(graph, get_strategy("vdnn_all")(graph, H100), H100)
    assert timeline.host_peak_bytes > 0
    assert Timeline.from_json(timeline.to_json()).host_peak_bytes == timeline.host_peak_bytes
