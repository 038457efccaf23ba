"""Plan: decisions, immutability and the JSON form a saved plan keeps."""

from __future__ import annotations

import json

import pytest

from memfit.core.plan import FORMAT_VERSION, KEEP, Keep, Plan, Recompute, Swap, SwapIn


def example_plan() -> Plan:
    return Plan(
        "swap",
        {
            "a": Keep(reason="small"),
            "b": Swap((SwapIn("c", ("d",)), SwapIn("e", ("f", "g"))), reason="large"),
        },
        graph_hash="0123456789abcdef",
        params={"lb": 3, "ub": 10, "types": ["aten.mm"]},
        budget_bytes=1 << 30,
        hardware="h100-pcie",
    )


def test_json_round_trip():
    plan = example_plan()
    text = json.dumps(plan.to_json())
    assert Plan.from_json(json.loads(text)) == plan


def test_save_and_load(tmp_path):
    plan = example_plan()
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    assert json.loads((tmp_path / "plan.json").read_text())["decisions"]["a"] == {
        "type": "Keep",
        "reason": "small",
    }


def test_params_are_stored_as_json():
    plan = Plan("swap", params={"types": ("aten.mm",), "policy": object, 3: None})
    params = Plan.from_json(json.loads(json.dumps(plan.to_json()))).params
    assert params == {"types": ["aten.mm"], "policy": repr(object), "3": None}


def test_swap_needs_a_swap_in():
    with pytest.raises(ValueError, match="at least one SwapIn; use Keep"):
        Swap(())


def test_recompute_round_trips_through_json():
    plan = Plan("x", {"a": Recompute("cheap to rebuild")})
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.recomputed == ("a",)


@pytest.mark.parametrize("decision", [{"type": "Offload"}, {"reason": "no type"}])
def test_unknown_decision_type_is_rejected(decision):
    data = {"version": FORMAT_VERSION, "strategy": "x", "decisions": {"a": decision}}
    with pytest.raises(ValueError, match="unknown decision type .* expected 'Keep', 'Swap' or 'Recompute'"):
        Plan.from_json(data)


def test_lookups():
    plan = example_plan()
    assert plan.decision("zz") is KEEP
    assert plan.decision("a") == Keep(reason="small")
    assert plan.swapped == ("b",)
    assert plan.swap_in_count == 2
    assert Plan("keep").swap_in_count == 0


def test_plan_is_frozen():
    plan = example_plan()
    with pytest.raises(TypeError):
        plan.decisions["c"] = KEEP  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.params["lb"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.strategy = "other"  # type: ignore[misc]


def test_a_swap_in_that_feeds_reruns_round_trips_and_lowers_the_same(tmp_path):
    from memfit.core import synthetic
    from memfit.core.schedule import lower

    graph = synthetic.chain(4)
    plan = Plan("x", {"f1": Swap((SwapIn("loss_backward", ("f2", "f2_backward")),)),
                      "f2": Recompute()}, graph_hash=graph.structure_hash)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    assert lower(graph, loaded).actions == lower(graph, plan).actions
    assert "f1#in0" in next(a for a in lower(graph, loaded).actions if a.kind == "recompute").reads
