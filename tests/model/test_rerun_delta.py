"""The memory model's re-run figures (``BaseProfile.folded`` of ``recomputes`` / ``plan``) equal
``memory_profile(lower(...))`` folded onto the graph's ops, and the sparse reads the segment DP
prices with (``change_at``, ``most_change``) equal the dense figures."""

import random

import numpy as np
import pytest

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Recompute, Rerun
from memfit.model import synthetic
from memfit.model.profile import BaseProfile
from memfit.model.recompute import memory_poor_reruns
from memfit.model.schedule import lower, memory_profile
from memfit.planning.strategies import get_strategy


def folded_profile(graph, recomputed, base=None, reruns=()):
    """High bytes per op (its re-runs, waits and copies folded in), live bytes after its last
    action, and the peak: the slow way, by lowering the whole plan."""
    schedule = lower(graph, joint_plan(recomputed, base, reruns))
    profile = memory_profile(schedule)
    high = np.zeros(len(graph.ops), dtype=np.int64)
    live = np.zeros(len(graph.ops), dtype=np.int64)
    rerun_high = 0  # re-runs belong to the op they precede
    for action, high_bytes, live_bytes in zip(schedule.actions, profile.high_bytes,
                                              profile.live_bytes, strict=True):
        if action.kind == "recompute":
            rerun_high = max(rerun_high, high_bytes)
            continue
        op = graph.index[action.op]
        high[op] = max(high[op], high_bytes, rerun_high)
        live[op] = live_bytes
        rerun_high = 0
    return high, live, profile.peak_bytes


def joint_plan(recomputed, base=None, reruns=()):
    decisions = dict(base.decisions) if base else {}
    decisions.update({name: Recompute() for name in recomputed})
    return Plan("test", decisions, reruns=tuple(reruns))


def check_folded(model, delta, truth):
    high, live, peak = truth
    got = model.folded(delta)
    assert got.high_bytes.tolist() == high.tolist()
    assert got.live_bytes.tolist() == live.tolist()
    assert got.peak_bytes == peak
    return got


def recomputable(graph):
    return [
        name for name, t in graph.tensors.items()
        if t.producer is not None and graph.op(t.producer).phase == "forward" and not t.is_output
    ]


GRAPHS = {
    "chain": lambda: synthetic.chain(24),
    "resnet_like": lambda: synthetic.resnet_like(5),
    "towers": lambda: synthetic.multi_tower(3, 6),
    "random_dag": lambda: synthetic.random_dag(40, seed=7),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_equals_lowering_on_random_plans(name):
    graph = GRAPHS[name]()
    model = BaseProfile.of(graph)
    candidates = recomputable(graph)
    rng, picks = random.Random(0), random.Random(2)
    for _ in range(25):
        chosen = rng.sample(candidates, rng.randint(1, len(candidates)))
        truth = folded_profile(graph, chosen)
        got = check_folded(model, model.recomputes(chosen), truth)
        check_folded(model, model.plan(joint_plan(chosen)), truth)  # the whole-plan builder
        check_delta(model, model.recomputes(chosen), got, chosen, picks)


def test_nothing_recomputed_is_the_keep_profile():
    graph = synthetic.resnet_like(3)
    model = BaseProfile.of(graph)
    profile = check_folded(model, model.recomputes([]), folded_profile(graph, []))
    assert profile.reruns == 0 and profile.recompute_s == 0
    check_delta(model, model.recomputes([]), profile, [], random.Random(0))


def test_recompute_time_is_the_reruns_time():
    graph = synthetic.chain(8, time_s=2e-3)
    model = BaseProfile.of(graph)
    profile = model.folded(model.recomputes(["f2", "f3"]))
    reruns = [a for a in lower(graph, Plan("t", {"f2": Recompute(), "f3": Recompute()})).actions
              if a.kind == "recompute"]
    assert profile.reruns == len(reruns) == 2
    assert profile.recompute_s == pytest.approx(2 * 2e-3)


def on_a_swap_plan(name):
    """The graph, a swap plan on it, its model, and the tensors a plan on top may recompute
    (not swapped, not made from a swapped value)."""
    graph = GRAPHS[name]()
    base = get_strategy("swap")(graph, get_hardware("h100-pcie"), n_tensors=4)
    assert base.swapped
    swapped = set(base.swapped)
    candidates = [
        t for t in recomputable(graph)
        if t not in swapped and not swapped & set(graph.op(graph.tensors[t].producer).inputs)
    ]
    return graph, base, BaseProfile.of(graph), candidates


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_equals_lowering_on_top_of_a_swap_plan(name):
    graph, base, model, candidates = on_a_swap_plan(name)
    swapped = set(base.swapped)
    swap_base = model.folded(model.plan(base))  # the swap plan alone
    assert swap_base.high_bytes.tolist() == folded_profile(graph, [], base)[0].tolist()
    rng, picks = random.Random(1), random.Random(3)
    priced = 0
    for _ in range(20):
        chosen = [t for t in rng.sample(candidates, rng.randint(1, len(candidates)))
                  if not swapped & set(graph.op(graph.tensors[t].producer).inputs)]
        try:
            delta = model.plan(joint_plan(chosen, base))
        except ValueError:  # a chain of re-runs reaches a swapped value: refused (step 3)
            continue
        truth = folded_profile(graph, chosen, base)
        got = check_folded(model, delta, truth)
        check_folded(model, model.plan(base) + model.recomputes(chosen), truth)  # composed
        check_delta(model, delta, got, chosen, picks)
        priced += 1
    assert priced >= 5


def test_a_rerun_that_reads_a_swapped_value_is_refused():
    graph = synthetic.chain(6)
    base = get_strategy("swap")(graph, get_hardware("h100-pcie"), n_tensors=2)
    reading = [t for t in recomputable(graph) if t not in base.swapped
               and set(base.swapped) & set(graph.op(graph.tensors[t].producer).inputs)]
    assert reading
    with pytest.raises(ValueError, match="swapped tensors"):
        BaseProfile.of(graph).plan(joint_plan(reading[:1], base))


def check_delta(model, delta, profile, chosen, rng):
    """The sparse reads equal the dense profile's change to the Keep plan's high bytes, at every
    op and as the largest change over a random set of ops (an interval, as segments own, and
    scattered); the quick recompute time equals the walked one."""
    dense = profile.high_bytes - model.high_bytes
    ops = len(dense)
    assert model.change_at(delta, np.arange(ops)).tolist() == dense.tolist()
    scattered = np.asarray(sorted(rng.sample(range(ops), rng.randint(0, ops))), dtype=np.int64)
    assert model.change_at(delta, scattered).tolist() == dense[scattered].tolist()
    low = rng.randrange(ops)
    for members in (scattered, np.arange(low, rng.randrange(low, ops) + 1), np.arange(0)):
        chosen_mask = np.zeros(ops, dtype=bool)
        chosen_mask[members] = True
        counted = np.concatenate(([0], np.cumsum(chosen_mask)))
        expected = int(dense[chosen_mask].max()) if members.size else None
        assert model.most_change(delta, counted) == expected
    if chosen is not None:
        assert model.rerun_time_s(chosen) == pytest.approx(profile.recompute_s, rel=1e-12)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_explicit_reruns_equal_lowering(name):
    """``Plan.reruns``: random re-runs (a value rebuilt several times, re-runs of re-runs'
    inputs, some before forward ops), alone and with ``Recompute`` decisions."""
    graph = GRAPHS[name]()
    model = BaseProfile.of(graph)
    forward = [op.name for op in graph.forward_ops if op.outputs]
    rng, picks = random.Random(5), random.Random(6)
    for trial in range(20):
        reruns = sorted(
            (Rerun(rng.choice(forward), rng.choice(graph.ops[1:]).name)
             for _ in range(rng.randint(1, 12))),
            key=lambda r: graph.index[r.before])
        reruns = [r for r in reruns if graph.index[r.op] < graph.index[r.before]]
        chosen = rng.sample(recomputable(graph), rng.randint(0, 6)) if trial % 2 else []
        delta = model.plan(joint_plan(chosen, reruns=reruns))
        got = check_folded(model, delta, folded_profile(graph, chosen, reruns=reruns))
        lowered = [a for a in lower(graph, joint_plan(chosen, reruns=reruns)).actions
                   if a.kind == "recompute"]
        assert got.reruns == len(lowered)
        assert got.recompute_s == pytest.approx(sum(graph.op(a.op).time_s for a in lowered))
        check_delta(model, delta, got, None, picks)


def test_memory_poor_reruns_equal_lowering():
    """Memory-poor's plan rebuilds every forward value before each backward op: many rebuilds
    of one tensor, each read by the next re-runs only."""
    graph = synthetic.chain(12)
    model = BaseProfile.of(graph)
    reruns = [Rerun(op, before) for op, before in memory_poor_reruns(graph)]
    delta = model.plan(joint_plan([], reruns=reruns))
    got = check_folded(model, delta, folded_profile(graph, [], reruns=reruns))
    assert got.peak_bytes < model.keep_peak_bytes  # it saves memory: not a vacuous plan
    check_delta(model, delta, got, None, random.Random(0))
