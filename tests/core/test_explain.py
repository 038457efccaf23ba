"""Explanations on synthetic graphs: every decision has a row, the rows add up to the simulated
timeline, what-if budgets are re-planned, and the whole travels through JSON with the plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memfit.core import synthetic
from memfit.core.costgraph import CostGraph
from memfit.core.errors import BudgetError
from memfit.core.explain import Explanation, explain
from memfit.core.hardware import get_hardware
from memfit.core.plan import FORMAT_VERSION, Plan, Swap, topology_hash
from memfit.core.schedule import PlanError
from memfit.core.simulate import simulate
from memfit.strategies import get_strategy

# a slow host link: swaps cannot hide, so exposed transfer is not zero
SLOW_LINK = get_hardware("h100-pcie").with_(name="slow-link", d2h_bytes_per_s=1e8,
                                            h2d_bytes_per_s=1e8)


def planned(graph: CostGraph, strategy: str, fraction: float | None, hardware=SLOW_LINK,
            **params) -> Plan:
    """What ``memfit.planning.plan_step`` does, torch-free: plan, then attach the explanation."""
    chosen = get_strategy(strategy)
    baseline = simulate(graph, get_strategy("keep")(graph, hardware), hardware)
    budget = None if fraction is None else int(baseline.peak_bytes * fraction)

    def replan(budget_bytes):
        return chosen(graph, hardware, budget_bytes, **params)

    made = replan(budget)
    explanation = explain(graph, made, hardware, baseline, budget, 0, replan)
    return replace(made, topology_hash=topology_hash(graph), explanation=explanation)


def decided(plan: Plan) -> set[str]:
    return set(plan.decisions)


def test_swap_rows_add_up_to_the_timeline():
    graph = synthetic.chain(12)
    plan = planned(graph, "swap", 0.6)
    assert plan.swapped
    timeline = simulate(graph, plan, SLOW_LINK)
    explanation = plan.explanation
    assert explanation is not None
    assert {r.tensor for r in explanation.rows} == decided(plan)
    assert timeline.exposed_transfer_s > 0
    assert sum(r.exposed_s for r in explanation.rows) == pytest.approx(timeline.exposed_transfer_s)
    assert explanation.exposed_transfer_s == timeline.exposed_transfer_s
    assert explanation.step_time_s == timeline.step_time_s
    assert explanation.peak_bytes == timeline.peak_bytes
    for row in explanation.rows:
        decision = plan.decisions[row.tensor]
        assert isinstance(decision, Swap) and row.decision == "swap"
        assert row.prefetch_after == tuple(s.after for s in decision.swap_ins)
        assert row.prefetch_scopes == tuple(graph.op(a).scope for a in row.prefetch_after)
        assert row.scope == graph.op(graph.tensors[row.tensor].producer).scope
        assert row.reason == decision.reason and row.reason
        assert row.size_bytes == graph.tensors[row.tensor].size_bytes


def test_copies_on_the_compute_thread_are_all_paid_for():
    graph = synthetic.chain(8)
    cpu = get_hardware("cpu")
    plan = planned(graph, "swap", 0.7, hardware=cpu)
    timeline = simulate(graph, plan, cpu)
    rows = plan.explanation.rows
    assert all(r.exposed_s > 0 for r in rows)
    assert sum(r.exposed_s for r in rows) == pytest.approx(timeline.exposed_transfer_s)


@pytest.mark.parametrize("graph", [synthetic.chain(16), synthetic.resnet_like(4),
                                   synthetic.random_dag(24, seed=3)], ids=lambda g: g.name)
def test_recompute_rows_add_up_to_the_timeline(graph):
    plan = planned(graph, "checkpoint", None)
    timeline = simulate(graph, plan, SLOW_LINK)
    rows = plan.explanation.rows
    shown = {r.tensor for r in rows}
    assert plan.recomputed and shown <= decided(plan)
    for hidden in decided(plan) - shown:  # marked inside a recomputed segment, but a no-op
        assert all(graph.op(c).phase == "forward" for c in graph.tensors[hidden].consumers)
    assert timeline.recompute_s > 0
    assert sum(r.recompute_s for r in rows) == pytest.approx(timeline.recompute_s)  # none hidden
    assert all(r.decision == "recompute" for r in rows) and any(r.reruns for r in rows)
    assert all(r.reruns or r.recompute_s == 0 for r in rows)


def test_explicit_reruns_are_rows_too():
    graph = synthetic.chain(6)
    plan = planned(graph, "memory-poor", None)
    assert plan.reruns and not plan.decisions
    timeline = simulate(graph, plan, SLOW_LINK)
    rows = plan.explanation.rows
    assert rows and all(r.decision == "recompute" for r in rows)
    assert max(r.reruns for r in rows) > 1  # the memory-poor chain rebuilds early values often
    assert sum(r.recompute_s for r in rows) == pytest.approx(timeline.recompute_s)


def test_what_if_rows_replan_at_plus_and_minus_ten_percent():
    graph = synthetic.chain(12)
    plan = planned(graph, "swap", 0.6)
    explanation = plan.explanation
    assert [w.factor for w in explanation.what_if] == [0.9, 1.1]
    for case in explanation.what_if:
        assert case.budget_bytes == int(explanation.budget_bytes * case.factor)
        if case.fits:
            assert case.peak_bytes <= case.budget_bytes
            assert case.step_time_s > 0
        else:
            assert case.minimum_bytes > case.budget_bytes
    looser = explanation.what_if[1]
    assert looser.fits and looser.step_time_s <= explanation.step_time_s


def test_what_if_below_the_minimum_says_so():
    graph = synthetic.chain(8)
    with pytest.raises(BudgetError) as caught:
        planned(graph, "swap", 0.01)
    minimum = caught.value.minimum_bytes
    chosen = get_strategy("swap")
    made = chosen(graph, SLOW_LINK, minimum)
    baseline = simulate(graph, Plan("keep"), SLOW_LINK)
    explanation = explain(graph, made, SLOW_LINK, baseline, minimum, 0,
                          lambda b: chosen(graph, SLOW_LINK, b), factors=(0.5,))
    (case,) = explanation.what_if
    assert not case.fits and case.minimum_bytes == minimum and case.step_time_s is None


def test_no_budget_no_what_ifs():
    plan = planned(synthetic.chain(4), "keep", None)
    assert plan.explanation.what_if == () and plan.explanation.rows == ()
    assert "no budget" in plan.explain()


def test_by_module_cuts_the_module_path():
    graph = synthetic.multi_tower(3, 4)
    plan = planned(graph, "checkpoint", None)
    explanation = plan.explanation
    shallow = explanation.by_module(depth=1)
    deep = explanation.by_module(depth=2)
    assert len(shallow) < len(deep)
    assert {m.scope for m in shallow} <= {"stem", "join", "tower0", "tower1", "tower2"}
    for totals in (shallow, deep):
        assert sum(m.recomputed for m in totals) == len(plan.recomputed)
        assert sum(m.recompute_s for m in totals) == pytest.approx(explanation.recompute_s)


def test_the_explanation_travels_through_json(tmp_path):
    graph = synthetic.resnet_like(3)
    plan = planned(graph, "swap", 0.6)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.decisions == plan.decisions and loaded.explanation == plan.explanation
    assert loaded.topology_hash == plan.topology_hash
    assert loaded.explain(rows=None) == plan.explain(rows=None)
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["version"] == FORMAT_VERSION and data["format"] == "memfit.plan"
    assert Explanation.from_json(data["explanation"]) == plan.explanation


def test_explain_text_lists_every_decision_and_the_what_ifs():
    graph = synthetic.chain(12)
    plan = planned(graph, "swap", 0.6)
    text = plan.explain(rows=None)
    for name in plan.decisions:
        assert f"| {name} " in text
    assert "prefetch after" in text and "time paid" in text and "why" in text
    assert "| 90%" in text and "| 110%" in text and "100% (this plan)" in text
    assert "by module" in text
    short = plan.explain(rows=2)
    assert "the 2 costliest shown" in short


def test_a_plan_without_explanation_still_explains_its_decisions():
    plan = planned(synthetic.chain(8), "swap", 0.6)
    bare = replace(plan, explanation=None)
    text = bare.explain()
    assert "no explanation recorded" in text
    assert all(name in text for name in plan.decisions)


# ---- the key: graph, shapes, hardware ------------------------------------------------------------


def test_check_for_accepts_its_own_graph_and_hardware():
    graph = synthetic.chain(6)
    planned(graph, "swap", 0.6).check_for(graph, SLOW_LINK.name)


def test_check_for_names_the_hardware():
    graph = synthetic.chain(6)
    with pytest.raises(PlanError, match="made for hardware 'slow-link'.*planned for 'gh200'"):
        planned(graph, "swap", 0.6).check_for(graph, "gh200")


def test_check_for_names_other_shapes():
    plan = planned(synthetic.chain(6, size_bytes=1 << 20), "swap", 0.6)
    with pytest.raises(PlanError, match="other input shapes.*plan again with memfit.plan"):
        plan.check_for(synthetic.chain(6, size_bytes=1 << 21), SLOW_LINK.name)


def test_check_for_names_another_graph():
    plan = planned(synthetic.chain(6), "swap", 0.6)
    with pytest.raises(PlanError, match="another graph.*plan again with memfit.plan"):
        plan.check_for(synthetic.chain(7), SLOW_LINK.name)


@pytest.mark.parametrize("version,made_by", [(None, "an older memfit"), (0, "an older memfit"),
                                             (FORMAT_VERSION + 1, "a newer memfit")])
def test_other_format_versions_fail_clearly(version, made_by):
    data = planned(synthetic.chain(8), "swap", 0.6).to_json()
    data["version"] = version
    with pytest.raises(ValueError, match=f"format version .*{made_by}.*plan again"):
        Plan.from_json(data)


def test_loading_a_file_that_is_not_a_plan(tmp_path):
    (tmp_path / "x.json").write_text('{"peak_bytes": 3}')
    with pytest.raises(ValueError, match="not a memfit plan"):
        Plan.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("garbage")
    with pytest.raises(ValueError, match="not a memfit plan"):
        Plan.load(tmp_path / "y.json")
