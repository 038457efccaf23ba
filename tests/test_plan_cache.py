"""Plans cached on disk across processes (``memfit.planning.plan_cache``): a second process of the
same script chooses no plan and says so; anything a plan depends on changed misses the cache; a
corrupt, foreign or over-budget entry is ignored, reported and never run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit.data.costgraph import CostGraph, Op
from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.units import Budget
from memfit.fitting.fitted import BACKEND_KEY
from memfit.model.synthetic import chain
from memfit.planning import plan_cache
from memfit.planning.plan_cache import planning_tally
from memfit.planning.step import plan_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_on(tmp_path, monkeypatch) -> Path:
    """The cache on, in a folder of this test's own (the suite runs with it off)."""
    monkeypatch.setenv("MEMFIT_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    return tmp_path


AT_60_PERCENT = Budget(fraction=0.6)


def planned(graph, budget: Budget | None = AT_60_PERCENT, strategy: str = "checkpoint",
            outside_bytes: int = 0):
    """``plan_step`` on ``graph`` with the ``cpu`` profile, and the tally of its plans."""
    with planning_tally() as tally:
        result = plan_step(graph, get_hardware("cpu"), budget, strategy, {}, outside_bytes)
    return result, tally


def entries(folder: Path) -> list[Path]:
    return sorted((folder / "plans").glob("*.json"))


def test_the_same_call_reads_its_plan_and_any_changed_input_misses(cache_on, monkeypatch):
    graph = chain(12)
    first, made = planned(graph)
    again, read = planned(graph)
    assert (made.made, made.cached, read.made, read.cached) == (1, 0, 0, 1)
    assert again.plan.to_json() == first.plan.to_json()
    assert again.predicted == first.predicted and len(entries(cache_on)) == 1
    changes = {"budget": lambda: planned(graph, Budget(fraction=0.7)),
               "graph": lambda: planned(chain(12, size_bytes=2 << 20)),
               "strategy": lambda: planned(graph, strategy="auto"),
               "outside bytes": lambda: planned(graph, outside_bytes=1 << 20)}
    for what, plan_again in changes.items():
        assert plan_again()[1].made == 1, what
    versions = {**plan_cache.code_versions(), "torch": "0.0"}
    monkeypatch.setattr(plan_cache, "code_versions", lambda: versions)
    assert planned(graph)[1].made == 1  # another torch, memfit version or memfit source
    assert len(entries(cache_on)) == 6


def test_every_field_of_every_op_and_tensor_reaches_the_graph_digest():
    """The key hashes the graph's structure text and the fields it leaves out: a change to any
    one field of one op or tensor (a time, a scope, a size, a consumer), or to the graph's name
    or compiler, is another graph."""
    graph = chain(6)
    op, tensor = graph.ops[2], graph.tensors[graph.ops[2].outputs[0]]
    changed = {"str": lambda value: value + "x", "tuple": lambda value: (*value, "x"),
               "float": lambda value: value + 1.5, "int": lambda value: value + 3,
               "bool": lambda value: not value, "NoneType": lambda value: "x"}

    def with_field(item, name: str) -> CostGraph:
        value = changed[type(getattr(item, name)).__name__](getattr(item, name))
        if isinstance(item, Op):
            ops = tuple(replace(o, **{name: value}) if o is item else o for o in graph.ops)
            return CostGraph(ops, graph.tensors, graph.name)
        tensors = {**graph.tensors, item.name: replace(item, **{name: value})}
        return CostGraph(graph.ops, tensors, graph.name)

    digests = {plan_cache.graph_digest(graph)}
    for item in (op, tensor):
        for name in (entry.name for entry in fields(item)):
            digest = plan_cache.graph_digest(with_field(item, name))
            assert digest not in digests, f"{type(item).__name__}.{name} is not in the digest"
            digests.add(digest)
    for name in (entry.name for entry in fields(CostGraph) if entry.name not in ("ops", "tensors")):
        digest = plan_cache.graph_digest(replace(graph, **{name: changed["str"](getattr(graph, name))}))
        assert digest not in digests, f"CostGraph.{name} is not in the digest"
        digests.add(digest)


def test_a_corrupt_or_foreign_entry_is_ignored_reported_and_written_again(cache_on):
    graph = chain(12)
    first, _ = planned(graph)
    (path,) = entries(cache_on)
    entry = json.loads(path.read_text())
    for broken in ("{not json", json.dumps({**entry, "version": 999}),
                   json.dumps({**entry, "key": "0" * 64}),
                   json.dumps({**entry, "plan": {**entry["plan"], "decisions": 7}})):
        path.write_text(broken)
        again, tally = planned(graph)
        assert (tally.made, tally.cached, len(tally.ignored)) == (1, 0, 1), broken[:40]
        assert again.plan.to_json() == first.plan.to_json()
        assert json.loads(path.read_text())["version"] == entry["version"]  # written again
    assert planned(graph)[1].cached == 1


def test_a_cached_plan_predicted_over_its_budget_never_runs(cache_on):
    """An entry holding another budget's plan (a file copied, a stale key) is simulated on the
    graph before it is used: over the budget, it is ignored and the plan made anew."""
    graph = chain(12)
    loose, _ = planned(graph, Budget(fraction=1.0))
    tight, _ = planned(graph, Budget(fraction=0.6))
    loose_path, tight_path = (next(p for p in entries(cache_on)
                                   if json.loads(p.read_text())["plan"]["budget_bytes"] == b)
                              for b in (loose.plan.budget_bytes, tight.plan.budget_bytes))
    entry = json.loads(tight_path.read_text())
    tight_path.write_text(json.dumps({**entry, "plan": json.loads(loose_path.read_text())["plan"]}))
    again, tally = planned(graph, Budget(fraction=0.6))
    assert tally.made == 1 and "predicted over the budget" in tally.ignored[0]
    assert again.predicted_peak_bytes <= again.budget.device_bytes
    assert again.plan.to_json() == tight.plan.to_json()


def test_a_refusal_is_cached_and_the_cache_can_be_turned_off(cache_on, monkeypatch):
    graph = chain(12)
    with pytest.raises(BudgetError) as first:
        planned(graph, Budget(bytes=1))
    with planning_tally() as tally, pytest.raises(BudgetError) as again:
        plan_step(graph, get_hardware("cpu"), Budget(bytes=1), "checkpoint", {})
    assert tally.cached == 1 and str(again.value) == str(first.value)
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    assert planned(chain(13))[1].made == 1 and len(entries(cache_on)) == 1


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))


def test_the_report_says_each_regions_planning_seconds_and_the_cache(cache_on, compiled_fresh):
    x, y = torch.randn(512, 64), torch.randn(512, 1)
    reports, losses = [], []
    for _ in range(2):
        torch._dynamo.reset()
        model = mlp()
        fitted = memfit.fit(model)  # no budget: the keep plan, planned all the same
        loss = nn.functional.mse_loss(fitted(x), y)
        loss.backward()
        losses.append(loss.detach())
        reports.append(memfit.report(fitted))
        planning = model.__dict__[BACKEND_KEY].regions[0].planning
        assert planning.choosing_s > 0 and planning.around_s > 0
    assert "region 0: plan made in" in reports[0]
    assert "region 0: plan read from the plan cache in" in reports[1]
    assert torch.equal(losses[0], losses[1])


@pytest.mark.slow
def test_a_second_process_plans_nothing_and_runs_the_same_plans(tmp_path):
    """The same fit loop run twice, each in its own process, with the cache on: the second makes
    no plan, reads every plan the first made, and runs the same plans within the budget with
    bitwise the same losses. (The seconds this saves are a benchmark figure:
    ``python -m bench.run --only first_call``.)"""
    env = dict(os.environ, MEMFIT_CACHE="1", MEMFIT_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    runs = []
    for _ in range(2):
        finished = subprocess.run([sys.executable, str(ROOT / "tests" / "plan_cache_child.py"),
                                   "0.6"], capture_output=True, text=True, env=env, check=False,
                                  timeout=1200)
        assert finished.returncode == 0, finished.stderr[-3000:]
        runs.append(json.loads(finished.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["plans_made"] >= 1 and first["plans_cached"] == 0
    assert second["plans_made"] == 0 and second["plans_cached"] == first["plans_made"]
    assert second["budget_bytes"] == first["budget_bytes"]
    assert second["plans"] == first["plans"]
    assert second["losses"] == first["losses"]
    assert max(second["peaks"]) <= second["budget_bytes"], second["peaks"]
    assert "read from the plan cache" in second["report"]
