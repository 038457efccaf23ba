"""Work that no budget changes is done once per planning call: ``auto`` with its what-if budgets
builds the swap tuner's passes once per graph and each setting's swaps once, prices each set of
re-runs' time once; the separator-block DP's Pareto fronts are the ones a full sort keeps."""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np

import memfit.model.rerun_delta as rerun_delta_module
import memfit.planning.step as plan_step_module
from memfit.data.hardware import get_hardware
from memfit.data.units import Budget
from memfit.model import synthetic
from memfit.model.plan_memo import plans_remembered
from memfit.model.profile import BaseProfile
from memfit.planning.solvers import segments
from memfit.planning.step import plan_step
from memfit.planning.strategies.swapping import tflms


def _counting_swap_work(monkeypatch) -> tuple[Counter, Counter]:
    """Swap planners built, and each setting's swaps computed (not remembered), by setting."""
    built: Counter = Counter()
    swapped: Counter = Counter()
    rewrites = tflms._Planner.rewrites
    planner_init = tflms._Planner.__init__

    def counted_init(self, graph, hardware):
        built[graph.name] += 1
        planner_init(self, graph, hardware)

    def counted_rewrites(self, config):
        swapped[config] += 1  # decisions asks for rewrites only when it computes
        return rewrites(self, config)

    monkeypatch.setattr(tflms._Planner, "__init__", counted_init)
    monkeypatch.setattr(tflms._Planner, "rewrites", counted_rewrites)
    return built, swapped


def test_auto_builds_budget_free_swap_work_once_per_call_and_plans_the_same(monkeypatch):
    graph, hardware = synthetic.resnet_like(6), get_hardware("h100-pcie")
    built, swapped = _counting_swap_work(monkeypatch)
    shared = plan_step(graph, hardware, Budget(fraction=0.5), "auto", {}, 1 << 20,
                       what_ifs=True)
    assert built == {graph.name: 1}  # three auto searches (the budget, x0.9, x1.1), one planner
    assert swapped and max(swapped.values()) == 1
    settings_once = sum(swapped.values())

    built.clear()
    swapped.clear()
    monkeypatch.setattr(plan_step_module, "plans_remembered", contextlib.nullcontext)
    fresh = plan_step(graph, hardware, Budget(fraction=0.5), "auto", {}, 1 << 20,
                      what_ifs=True)
    assert built[graph.name] > 1 and sum(swapped.values()) > settings_once
    assert shared.plan == fresh.plan and shared.plan.params == fresh.plan.params
    assert shared.plan.explanation == fresh.plan.explanation
    assert len(shared.plan.explanation.what_if) == 2


def test_rerun_time_is_priced_once_per_set_inside_a_span(monkeypatch):
    graph = synthetic.chain(12)
    model = BaseProfile.of(graph)
    recomputed = [t.name for t in graph.saved_tensors()][2:7]
    outside = model.rerun_time_s(recomputed)
    priced: Counter = Counter()
    rerun_time_s = rerun_delta_module.rerun_time_s

    def counted(base, tensors):
        priced[frozenset(tensors)] += 1
        return rerun_time_s(base, tensors)

    monkeypatch.setattr(rerun_delta_module, "rerun_time_s", counted)
    with plans_remembered():
        assert model.rerun_time_s(recomputed) == outside > 0
        assert model.rerun_time_s(reversed(recomputed)) == outside
        assert model.rerun_time_s(recomputed[:2]) != outside
    assert list(priced.values()) == [1, 1]
    model.rerun_time_s(recomputed)  # outside a span, nothing is kept
    assert priced[frozenset(recomputed)] == 2


def _sorted_pareto(states: segments._Front, quantum: int) -> segments._Front:
    """The fronts' definition: sort by (rounded bytes, time), keep each state faster than all
    before it."""
    rounded = -(-states.carried_bytes // quantum) * quantum
    order = np.lexsort((states.time_s, rounded))
    time_s = states.time_s[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], time_s[:-1])))
    kept = order[time_s < best_before]
    return segments._Front(rounded[kept], states.time_s[kept], states.segment[kept],
                           states.previous[kept])


def test_pareto_front_is_the_sorted_definitions_ties_included():
    generator = np.random.default_rng(0)
    for size in (0, 1, 2, 7, 300):
        for quantum in (1, 5, 64):
            carried = generator.integers(0, 400, size).astype(np.int64)
            time_s = generator.integers(0, 12, size).astype(float) / 4  # many equal times
            states = segments._Front(carried, time_s, np.arange(size, dtype=np.int64),
                                     generator.integers(0, 9, size).astype(np.int64))
            found, expected = segments._pareto(states, quantum), _sorted_pareto(states, quantum)
            for name in ("carried_bytes", "time_s", "segment", "previous"):
                assert np.array_equal(getattr(found, name), getattr(expected, name)), name
