"""Explanations on synthetic graphs: every decision has a row, the rows add up to the simulated
timeline, what-if budgets are re-planned, and the whole travels through JSON with the plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import FORMAT_VERSION, Plan, Recompute, Swap, SwapIn, topology_hash
from memfit.data.plan_text import explain_text
from memfit.model import synthetic
from memfit.model.explain import Explanation, WhatIf, explain, tally
from memfit.model.schedule import PlanError
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy

# a slow host link: swaps cannot hide, so exposed transfer is not zero
SLOW_LINK = get_hardware("h100-pcie").with_(name="slow-link", d2h_bytes_per_s=1e8,
                                            h2d_bytes_per_s=1e8)


def planned(graph: CostGraph, strategy: str, fraction: float | None, hardware=SLOW_LINK,
            **params) -> Plan:
    """What ``memfit.planning.step.plan_step`` does, torch-free: plan, then attach the explanation."""
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
        assert sum(m.recomputed for m in totals) == explanation.tally.recomputed
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


# ---- counts of one population, re-runs, monotone what-ifs ---------------------------------------


def rebuilt_on_the_way() -> CostGraph:
    """``a -> b -> c -> loss``; the backward reads ``c`` only, so recomputing ``c`` re-runs
    ``b`` too: two values rebuilt, one of them (``b``) not a saved tensor."""
    ops = [
        Op("fa", "aten.mm", "forward", inputs=("x",), outputs=("a",), time_s=1e-3),
        Op("fb", "aten.relu", "forward", inputs=("a",), outputs=("b",), time_s=2e-3),
        Op("fc", "aten.gelu", "forward", inputs=("b",), outputs=("c",), time_s=3e-3),
        Op("fl", "aten.sum", "forward", inputs=("c",), outputs=("loss",), time_s=1e-3),
        Op("gc", "aten.gelu_backward", "backward", inputs=("c",), outputs=("dc",),
           depends_on=("fl",), time_s=1e-3),
        Op("ga", "aten.mm_backward", "backward", inputs=("dc",), outputs=("dx",),
           time_s=1e-3),
    ]  # fmt: skip
    sizes = {"x": 8, "a": 100, "b": 200, "c": 300, "loss": 4, "dc": 300, "dx": 8}
    kinds = {"x": "input", "dc": "gradient", "dx": "gradient"}
    tensors = [Tensor(name, size, kinds.get(name, "activation"), is_output=name in ("loss", "dx"))
               for name, size in sizes.items()]
    return CostGraph.build(ops, tensors, name="rebuilt")


def test_counts_are_of_the_saved_tensors_and_reruns_are_reported():
    """Recomputing ``c`` rebuilds ``b`` on the way. Before, the text said "1 saved tensors; 0
    swapped, 2 recomputed" (rebuilt values counted against saved ones), nothing of the re-runs."""
    graph = rebuilt_on_the_way()
    assert [t.name for t in graph.saved_tensors()] == ["c"]
    plan = Plan("by-hand", {"b": Recompute(), "c": Recompute()})
    timeline = simulate(graph, plan, SLOW_LINK)
    explanation = explain(graph, plan, SLOW_LINK, simulate(graph, Plan("keep"), SLOW_LINK))
    counted = explanation.tally
    assert counted == tally(graph, plan, timeline)
    assert (counted.saved, counted.swapped, counted.recomputed, counted.kept) == (1, 0, 1, 0)
    assert (counted.rerun_count, counted.rerun_ops, counted.rerun_bytes) == (2, 2, 200 + 300)
    assert counted.recompute_s == pytest.approx(2e-3 + 3e-3) == timeline.recompute_s
    assert sum(r.decision == "recompute" for r in explanation.rows) == 2  # both rows stay
    assert [m.recomputed for m in explanation.by_module()] == [1]
    text = explain_text(replace(plan, explanation=explanation))
    assert "saved tensors: 1 = 0 swapped (0 B) + 1 recomputed + 0 kept" in text
    assert "re-runs: 2 forward op runs (2 distinct ops) rebuild 500 B, 5.00 ms" in text


def test_a_swapped_value_the_backward_never_reads_is_counted_apart():
    """``a`` is read again only in the forward pass. Before, "N swapped" counted it against the
    saved tensors (GPT-2 at 30% on h100-pcie: 29 swapped, 27 of them saved tensors)."""
    graph = rebuilt_on_the_way()
    plan = Plan("by-hand", {"a": Swap((SwapIn("fa", ("fb",)),)),
                            "c": Swap((SwapIn("fl", ("gc",)),))})
    counted = tally(graph, plan, simulate(graph, plan, SLOW_LINK))
    assert (counted.saved, counted.swapped, counted.kept) == (1, 1, 0)
    assert (counted.swapped_unsaved, counted.swapped_unsaved_bytes, counted.swap_ins) == (1, 100, 2)
    explanation = explain(graph, plan, SLOW_LINK, simulate(graph, Plan("keep"), SLOW_LINK))
    assert [m.swapped for m in explanation.by_module()] == [1]
    text = explain_text(replace(plan, explanation=explanation))
    assert ("saved tensors: 1 = 1 swapped (300 B) + 0 recomputed + 0 kept; also swapped: 1 "
            "forward values read again only in the forward pass (100 B)") in text
    assert "swaps: 2 swap-ins, exposed transfer" in text


@pytest.mark.parametrize("strategy, fraction", [("checkpoint", None), ("memory-poor", None),
                                                ("swap", 0.8), ("auto", 0.7)])
@pytest.mark.parametrize("graph", [synthetic.chain(12), synthetic.resnet_like(3),
                                   synthetic.multi_tower(2, 4)], ids=lambda g: g.name)
def test_no_count_exceeds_its_total(graph, strategy, fraction):
    plan = planned(graph, strategy, fraction)
    counted, rows = plan.explanation.tally, plan.explanation.rows
    assert counted.saved == len(graph.saved_tensors())
    assert 0 <= counted.kept <= counted.saved
    assert counted.swapped == sum(r.decision == "swap" and r.saved for r in rows)
    assert counted.recomputed == sum(r.decision == "recompute" and r.saved for r in rows)
    assert counted.rerun_ops <= counted.rerun_count
    assert (counted.rerun_count > 0) == (counted.recompute_s > 0)


def with_what_ifs(plan: Plan, *cases: WhatIf) -> Plan:
    assert plan.explanation is not None
    return replace(plan, explanation=replace(plan.explanation, what_if=cases))


def what_if_times_ms(text: str) -> list[float]:
    """The step-time column of the what-if table, tightest budget first."""
    table = text[text.index("what if the budget were"):].splitlines()[3:6]
    return [float(line.split("|")[4].split()[0]) for line in table]


def test_a_looser_budget_never_shows_a_slower_step():
    """The heuristic found a faster plan at 90% than at 100%, and a slower one at 110%: each
    row shows the fastest plan at or under its budget and says whose it is. Before, the rows
    read 90%: faster, 100%: slower, 110%: slower still."""
    plan = planned(synthetic.chain(12), "swap", 0.6)
    this = plan.explanation
    budget, time_s = this.budget_bytes, this.step_time_s
    faster = WhatIf(0.9, int(budget * 0.9), this.peak_bytes - 1, time_s * 0.8)
    slower = WhatIf(1.1, int(budget * 1.1), this.peak_bytes, time_s * 1.5)
    text = explain_text(with_what_ifs(plan, faster, slower))
    times = what_if_times_ms(text)
    assert times == sorted(times, reverse=True) and times[0] == times[2]
    assert times[0] == pytest.approx(time_s * 0.8 * 1e3, rel=1e-3)
    assert text.count("the 90% budget") == 2
    assert "at 100%: the plan made for that budget takes" in text
    assert "at 110%: the plan made for that budget takes" in text
    table = with_what_ifs(plan, faster, slower).explanation.what_if_table()
    assert [row.made_for for row in table] == [0.9, 0.9, 0.9]


def test_a_looser_budget_that_did_not_fit_shows_the_plan_that_does():
    plan = planned(synthetic.chain(12), "swap", 0.6)
    this = plan.explanation
    failed = WhatIf(1.1, int(this.budget_bytes * 1.1), minimum_bytes=this.budget_bytes * 2)
    table = with_what_ifs(plan, failed).explanation.what_if_table()
    assert [(row.factor, row.made_for) for row in table] == [(1.0, 1.0), (1.1, 1.0)]
    text = explain_text(with_what_ifs(plan, failed))
    assert "at 110%: the plan made for that budget did not fit" in text
    assert "does not fit" not in text.split("what if the budget were")[1].split("\n")[4]


def test_a_tighter_plan_over_the_looser_budget_is_not_borrowed():
    """A strategy that ignores its budget can return a plan whose peak is over it; such a plan
    does not fit the looser budget either, so no row borrows it."""
    plan = planned(synthetic.chain(12), "swap", 0.6)
    this = plan.explanation
    over = WhatIf(0.9, int(this.budget_bytes * 0.9), this.budget_bytes + 1, this.step_time_s / 2)
    table = with_what_ifs(plan, over).explanation.what_if_table()
    assert [(row.factor, row.made_for) for row in table] == [(0.9, 0.9), (1.0, 1.0)]


def test_the_tally_travels_through_json_and_an_older_plan_says_it_has_none(tmp_path):
    plan = planned(synthetic.chain(10), "checkpoint", None)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.explanation.tally == plan.explanation.tally is not None
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["explanation"]["tally"]
    older = Plan.from_json(data)
    assert older.explanation.tally is None
    assert "plan again for the counts" in older.explain()


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
