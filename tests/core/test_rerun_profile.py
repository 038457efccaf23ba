"""The fast recompute profile equals ``memory_profile(lower(...))``, folded onto the graph's ops."""

import random

import numpy as np
import pytest

from memfit.core import synthetic
from memfit.core.plan import Plan, Recompute
from memfit.core.rerun_profile import RerunProfiler
from memfit.core.schedule import lower, memory_profile


def folded_profile(graph, recomputed):
    """High bytes per op (its re-runs folded in), live bytes after it, and the peak, the slow way."""
    schedule = lower(graph, Plan("test", {name: Recompute() for name in recomputed}))
    profile = memory_profile(schedule)
    high = np.zeros(len(graph.ops), dtype=np.int64)
    live = np.zeros(len(graph.ops), dtype=np.int64)
    pending: list[int] = []
    for action, high_bytes, live_bytes in zip(schedule.actions, profile.high_bytes,
                                              profile.live_bytes, strict=True):
        pending.append(high_bytes)
        if action.kind == "compute":
            high[graph.index[action.op]] = max(pending)
            live[graph.index[action.op]] = live_bytes
            pending = []
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
    rng = random.Random(0)
    for _ in range(25):
        chosen = rng.sample(candidates, rng.randint(1, len(candidates)))
        got = profiler.profile(chosen)
        high, live, peak = folded_profile(graph, chosen)
        assert got.high_bytes.tolist() == high.tolist()
        assert got.live_bytes.tolist() == live.tolist()
        assert got.peak_bytes == peak


def test_nothing_recomputed_is_the_keep_profile():
    graph = synthetic.resnet_like(3)
    profile = RerunProfiler(graph).profile([])
    high, live, peak = folded_profile(graph, [])
    assert profile.high_bytes.tolist() == high.tolist() and profile.peak_bytes == peak
    assert profile.reruns == 0 and profile.recompute_s == 0


def test_recompute_time_is_the_reruns_time():
    graph = synthetic.chain(8, time_s=2e-3)
    profile = RerunProfiler(graph).profile(["f2", "f3"])
    reruns = [a for a in lower(graph, Plan("t", {"f2": Recompute(), "f3": Recompute()})).actions
              if a.kind == "recompute"]
    assert profile.reruns == len(reruns) == 2
    assert profile.recompute_s == pytest.approx(2 * 2e-3)
