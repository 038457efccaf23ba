"""``plan_step`` lowers and simulates each plan once per call (``memfit.model.plan_memo``), and
what it plans and explains is what it planned without remembering anything."""

from __future__ import annotations

import contextlib
from collections import Counter

import memfit.model.simulate as simulate_module
import memfit.planning.step as plan_step_module
from memfit.data.hardware import get_hardware
from memfit.data.units import Budget
from memfit.model import synthetic
from memfit.model.plan_memo import plans_remembered
from memfit.model.schedule import lower
from memfit.planning.step import plan_step
from memfit.planning.strategies import get_strategy


def _counting_simulations(monkeypatch) -> Counter:
    """Each simulation computed (not remembered), by plan content."""
    computed: Counter = Counter()
    simulated = simulate_module._simulated

    def counted(graph, plan, hardware, record_intervals):
        computed[(plan.strategy, plan.reruns, frozenset(plan.decisions.items()),
                  record_intervals)] += 1
        return simulated(graph, plan, hardware, record_intervals)

    monkeypatch.setattr(simulate_module, "_simulated", counted)
    return computed


def test_auto_with_what_ifs_simulates_each_plan_once_and_plans_the_same(monkeypatch):
    graph, hardware = synthetic.resnet_like(6), get_hardware("h100-pcie")
    computed = _counting_simulations(monkeypatch)
    remembered = plan_step(graph, hardware, Budget(fraction=0.5), "auto", {}, 1 << 20,
                           what_ifs=True)
    assert computed and max(computed.values()) == 1
    with_memo = sum(computed.values())

    computed.clear()
    monkeypatch.setattr(plan_step_module, "plans_remembered", contextlib.nullcontext)
    fresh = plan_step(graph, hardware, Budget(fraction=0.5), "auto", {}, 1 << 20,
                      what_ifs=True)
    assert sum(computed.values()) > with_memo  # the same plans were simulated again
    assert remembered.plan == fresh.plan
    assert remembered.plan.params == fresh.plan.params
    assert remembered.plan.explanation == fresh.plan.explanation
    assert remembered.predicted == fresh.predicted
    assert len(remembered.plan.explanation.what_if) == 2


def test_a_span_tells_plans_apart_and_keeps_nothing_after_it():
    graph, hardware = synthetic.chain(8), get_hardware("h100-pcie")
    keep = get_strategy("keep")(graph, hardware)
    recompute = get_strategy("checkpoint")(graph, hardware)
    with plans_remembered():
        first = lower(graph, keep)
        assert lower(graph, keep) is first
        assert lower(graph, recompute) is not first
        assert lower(graph, recompute).actions != first.actions
    assert lower(graph, keep) is not first
    assert lower(graph, keep) == first
