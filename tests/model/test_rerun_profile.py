"""The fast recompute profile equals ``memory_profile(lower(...))``, folded onto the graph's ops,
and the incremental delta the segment DP prices with equals the fast profile."""

import random

import numpy as np
import pytest

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Recompute
from memfit.model import synthetic
from memfit.model.rerun_profile import RerunProfiler
from memfit.model.schedule import lower, memory_profile
from memfit.planning.strategies import get_strategy


def folded_profile(graph, recomputed, base=None):
    """High bytes per op (its re-runs, waits and copies folded in), live bytes after its last
    action, and the peak: the slow way, by lowering the whole plan."""
    decisions = dict(base.decisions) if base else {}
    decisions.update({name: Recompute() for name in recomputed})
    schedule = lower(graph, Plan("test", decisions))
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
    profiler = RerunProfiler(graph)
    candidates = recomputable(graph)
    rng, picks = random.Random(0), random.Random(2)
    for _ in range(25):
        chosen = rng.sample(candidates, rng.randint(1, len(candidates)))
        got = profiler.profile(chosen)
        high, live, peak = folded_profile(graph, chosen)
        assert got.high_bytes.tolist() == high.tolist()
        assert got.live_bytes.tolist() == live.tolist()
        assert got.peak_bytes == peak
        check_delta(profiler, chosen, picks)


def test_nothing_recomputed_is_the_keep_profile():
    graph = synthetic.resnet_like(3)
    profile = RerunProfiler(graph).profile([])
    high, live, peak = folded_profile(graph, [])
    assert profile.high_bytes.tolist() == high.tolist() and profile.peak_bytes == peak
    assert profile.reruns == 0 and profile.recompute_s == 0
    check_delta(RerunProfiler(graph), [], random.Random(0))


def test_recompute_time_is_the_reruns_time():
    graph = synthetic.chain(8, time_s=2e-3)
    profile = RerunProfiler(graph).profile(["f2", "f3"])
    reruns = [a for a in lower(graph, Plan("t", {"f2": Recompute(), "f3": Recompute()})).actions
              if a.kind == "recompute"]
    assert profile.reruns == len(reruns) == 2
    assert profile.recompute_s == pytest.approx(2 * 2e-3)


def on_a_swap_plan(name):
    """The graph, a swap plan on it, its profiler, and the tensors a plan on top may recompute
    (not swapped, not made from a swapped value)."""
    graph = GRAPHS[name]()
    base = get_strategy("swap")(graph, get_hardware("h100-pcie"), n_tensors=4)
    assert base.swapped
    swapped = set(base.swapped)
    candidates = [
        t for t in recomputable(graph)
        if t not in swapped and not swapped & set(graph.op(graph.tensors[t].producer).inputs)
    ]
    return graph, base, RerunProfiler(graph, base), candidates


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_equals_lowering_on_top_of_a_swap_plan(name):
    graph, base, profiler, candidates = on_a_swap_plan(name)
    swapped = set(base.swapped)
    rng, picks = random.Random(1), random.Random(3)
    priced = 0
    for _ in range(20):
        chosen = [t for t in rng.sample(candidates, rng.randint(1, len(candidates)))
                  if not swapped & set(graph.op(graph.tensors[t].producer).inputs)]
        try:
            got = profiler.profile(chosen)
        except ValueError:  # a chain of re-runs reaches a swapped value: refused, as lower does
            with pytest.raises(ValueError):
                profiler.delta(chosen)  # and by the incremental delta
            continue
        high, live, peak = folded_profile(graph, chosen, base)
        assert got.high_bytes.tolist() == high.tolist()
        assert got.live_bytes.tolist() == live.tolist()
        assert got.peak_bytes == peak
        check_delta(profiler, chosen, picks)
        priced += 1
    assert priced >= 5


def test_a_base_that_recomputes_is_refused():
    graph = synthetic.chain(6)
    with pytest.raises(ValueError, match="may swap, not recompute"):
        RerunProfiler(graph, Plan("x", {"f2": Recompute()}))


def dense_change(profiler, chosen):
    """The whole-graph profile's change to the Keep plan's high bytes, per op."""
    return profiler.profile(chosen).high_bytes - profiler.keep_high


def check_delta(profiler, chosen, rng):
    """The sparse delta reads what the whole-graph profile computes, at every op and as the
    largest change over a random set of ops (an interval, as segments own, and scattered)."""
    dense = dense_change(profiler, chosen)
    delta = profiler.delta(chosen)
    ops = len(dense)
    assert delta.at(np.arange(ops)).tolist() == dense.tolist()
    scattered = np.asarray(sorted(rng.sample(range(ops), rng.randint(0, ops))), dtype=np.int64)
    assert delta.at(scattered).tolist() == dense[scattered].tolist()
    low = rng.randrange(ops)
    for members in (scattered, np.arange(low, rng.randrange(low, ops) + 1), np.arange(0)):
        chosen_mask = np.zeros(ops, dtype=bool)
        chosen_mask[members] = True
        counted = np.concatenate(([0], np.cumsum(chosen_mask)))
        expected = int(dense[chosen_mask].max()) if members.size else None
        assert delta.most(counted) == expected
    profile = profiler.profile(chosen)
    assert (delta.recompute_s, delta.reruns) == (profile.recompute_s, profile.reruns)
    assert profiler.recompute_s(chosen) == pytest.approx(profile.recompute_s, rel=1e-12)
