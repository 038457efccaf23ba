"""Plan: decisions, immutability and the JSON form a saved plan keeps."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from memfit.data.plan import FORMAT_VERSION, KEEP, Keep, Plan, Recompute, Swap, SwapIn


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
    plan = Plan("swap", params={"types": ("aten.mm",), "policy": object, 3: None},
                graph_hash="0123")
    params = Plan.from_json(json.loads(json.dumps(plan.to_json()))).params
    assert params == {"types": ["aten.mm"], "policy": repr(object), "3": None}


def test_swap_needs_a_swap_in():
    with pytest.raises(ValueError, match="at least one SwapIn; use Keep"):
        Swap(())


def test_recompute_round_trips_through_json():
    plan = Plan("checkpoint", {"a": Recompute("cheap to rebuild")}, graph_hash="0123")
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.recomputed == ("a",)


@pytest.mark.parametrize("decision", [{"type": "Offload"}, {"reason": "no type"}])
def test_unknown_decision_type_is_rejected(decision):
    data = {**example_plan().to_json(), "decisions": {"a": decision}}
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
    from memfit.model import synthetic
    from memfit.model.schedule import lower

    graph = synthetic.chain(4)
    plan = Plan("checkpoint", {"f1": Swap((SwapIn("loss_backward", ("f2", "f2_backward")),)),
                      "f2": Recompute()}, graph_hash=graph.structure_hash)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    assert lower(graph, loaded).actions == lower(graph, plan).actions
    assert "f1#in0" in next(a for a in lower(graph, loaded).actions if a.kind == "recompute").reads


def test_a_plan_of_a_strategy_not_registered_here_loads(tmp_path):
    """The schema asks for a strategy name; whether it is registered is asked where the plan
    runs (``memfit.compile``: tests/test_plan_portable.py)."""
    plan = replace(example_plan(), strategy="my-strategy")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


# ---- the schema a saved plan is read against -----------------------------------------------------


def explained_plan_json() -> dict:
    """A valid saved plan with an explanation (rows and all), to break one field at a time."""
    from memfit.data.hardware import get_hardware
    from memfit.model import synthetic
    from memfit.model.explain import explain
    from memfit.model.simulate import simulate
    from memfit.planning.strategies import get_strategy

    graph, hardware = synthetic.chain(6), get_hardware("h100-pcie")
    baseline = simulate(graph, get_strategy("keep")(graph, hardware), hardware)
    made = get_strategy("checkpoint")(graph, hardware, None)
    data = replace(made, explanation=explain(graph, made, hardware, baseline)).to_json()
    data["decisions"].update(example_plan().to_json()["decisions"])  # "a": Keep, "b": Swap
    assert data["explanation"]["rows"] and Plan.from_json(data).decisions["b"].swap_ins
    return json.loads(json.dumps(data))  # as a file holds it: lists, not tuples


def broken(path: str, value: object = ...) -> Callable[[dict], None]:
    """Set (or with no value, delete) the field at ``path``, e.g. ``decisions.b.swap_ins.0``."""
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]

    def edit(data: dict) -> None:
        for part in parents:
            data = data[part]
        if value is ...:
            del data[last]
        else:
            data[last] = value

    return edit


MALFORMED = [  # (what to break, the field the error must name)
    (broken("strategy", 3), r"'strategy' must be a non-blank string, got 3"),
    (broken("strategy", " "), r"'strategy' must be a non-blank string"),
    (broken("strategy"), r"lacks the field\(s\) \['strategy'\]"),
    (broken("budget_bytes", -1), r"'budget_bytes' must be a positive integer of bytes or null"),
    (broken("budget_bytes", 0), r"'budget_bytes' must be a positive integer"),
    (broken("budget_bytes", "1GiB"), r"'budget_bytes' must be a positive integer.*got '1GiB'"),
    (broken("budget_bytes", 1.5), r"'budget_bytes' must be a positive integer"),
    (broken("budget_bytes", True), r"'budget_bytes' must be a positive integer"),
    (broken("graph_hash"), r"lacks the field\(s\) \['graph_hash'\]"),
    (broken("graph_hash", ""), r"'graph_hash' must be a non-blank string, got ''"),
    (broken("graph_hash", "  "), r"'graph_hash' must be a non-blank string"),
    (broken("graph_hash", None), r"'graph_hash' must be a non-blank string, got None"),
    (broken("topology_hash", 7), r"'topology_hash' must be a string"),
    (broken("hardware", ["h100"]), r"'hardware' must be a string"),
    (broken("params", [1]), r"'params' must be an object with string keys"),
    (broken("budget", 3), r"unknown field\(s\) \['budget'\]"),
    (broken("decisions", []), r"'decisions' must be an object"),
    (broken("decisions"), r"lacks the field\(s\) \['decisions'\]"),
    (broken("decisions.a", "Keep"), r"'decisions\['a'\]' must be an object"),
    (broken("decisions.a.type", "Offload"), r"unknown decision type 'Offload' in field "
                                            r"'decisions\['a'\].type'"),
    (broken("decisions.a.why", "x"), r"unknown field\(s\) \['why'\] in 'decisions\['a'\]'"),
    (broken("decisions.a.reason", 5), r"'decisions\['a'\].reason' must be a string"),
    (broken("decisions.b.swap_ins", []), r"'decisions\['b'\].swap_ins' must be a non-empty list"),
    (broken("decisions.b.swap_ins", "c"), r"'decisions\['b'\].swap_ins' must be a list"),
    (broken("decisions.b.swap_ins.0.after"), r"'decisions\['b'\].swap_ins\[0\].after' must be"),
    (broken("decisions.b.swap_ins.1.consumers", "f"), r"'decisions\['b'\].swap_ins\[1\].consumers"
                                                      r"' must be a list"),
    (broken("decisions.b.swap_ins.1.consumers.0", 4), r"swap_ins\[1\].consumers\[0\]' must be"),
    (broken("reruns", "f1"), r"'reruns' must be a list"),
    (broken("reruns", [["f1"]]), r"'reruns\[0\]' must be a pair \[op, before\]"),
    (broken("reruns", [["f1", None]]), r"'reruns\[0\]\[1\]' must be a non-blank string"),
    (broken("version", "1"), r"format version '1', this memfit reads version 1"),
    (broken("version", True), r"format version True"),
    (broken("format", "memfit.timeline"), r"'format' must be 'memfit.plan'"),
    (broken("explanation", []), r"'explanation' must be an object"),
    (broken("explanation.budget_bytes", "big"), r"'explanation.budget_bytes' must be int \| None"),
    (broken("explanation.peak_bytes"), r"'explanation.peak_bytes' is missing"),
    (broken("explanation.colour", "red"), r"unknown field\(s\) \['colour'\] in 'explanation'"),
    (broken("explanation.rows.0.size_bytes", "1MiB"), r"'explanation.rows\[0\].size_bytes' must "
                                                      r"be int"),
    (broken("explanation.rows.0.decision", "offload"), r"'explanation.rows\[0\].decision' must "
                                                       r"be Literal\['keep', 'swap', 'recompute'\]"),
    (broken("explanation.rows.0.prefetch_after", [1]), r"'explanation.rows\[0\].prefetch_after'"),
    (broken("explanation.rows", {}), r"'explanation.rows' must be a list"),
]


@pytest.mark.parametrize("edit, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_a_malformed_plan_file_is_refused_naming_the_field(edit, message, tmp_path):
    data = explained_plan_json()
    edit(data)
    (tmp_path / "step.plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as raised:  # not KeyError, TypeError, ...
        Plan.load(tmp_path / "step.plan.json")
    assert str(tmp_path / "step.plan.json") in str(raised.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"plan"', "{}", "not json", '{"peak_bytes": 3}'])
def test_a_file_that_is_no_plan_at_all_says_so(text, tmp_path):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(ValueError, match="is not a memfit plan"):
        Plan.load(tmp_path / "x.json")


def test_the_untouched_file_loads_and_keeps_every_field():
    data = explained_plan_json()
    plan = Plan.from_json(data)
    assert json.loads(json.dumps(plan.to_json())) == data and plan.explanation is not None
    assert data["version"] == FORMAT_VERSION


def test_a_blank_graph_hash_never_skips_the_compatibility_check():
    from memfit.model import synthetic
    from memfit.model.schedule import PlanError

    graph = synthetic.chain(4)
    for blank in ("", "  "):
        with pytest.raises(PlanError, match="names no graph .*graph_hash is blank.*plan again"):
            Plan("keep", graph_hash=blank).check_for(graph, "cpu")
    Plan("keep", graph_hash=graph.structure_hash).check_for(graph, "cpu")  # its own: accepted
