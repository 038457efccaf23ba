"""Planning ahead across graph breaks: ``memfit.plan`` and ``max_batch_size`` trace every region
of a step that Dynamo breaks (a logger call in transformers' loss, Python between regions), plan
each, and return one plan that covers them all (``Plan.regions``)."""

from __future__ import annotations

import logging

import pytest
import torch

import memfit
from memfit.data.hardware import get_hardware
from memfit.data.plan import Swap
from memfit.fitting.traced import trace_plan

LOGGER = logging.getLogger("tests.plan_graph_breaks")


class _TwoHalves(torch.nn.Module):
    """Two tanh stacks with a logger call between them: Dynamo breaks the graph there."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.first = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        self.second = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        LOGGER.debug("between the halves")
        return torch.tanh(self.second(h)).pow(2).mean()


def _loss(model, x):
    return model(x)


def test_a_plan_covers_both_sides_of_a_graph_break_and_runs_bitwise():
    """The plan holds one plan per region; a fraction is of the whole step's unplanned peak; it
    saves, loads, explains every region, and ``compile(plan=...)`` runs it bit for bit."""
    torch.manual_seed(0)
    model = _TwoHalves()
    x = torch.randn(256, 64)
    meta = x.to("meta")
    unplanned = trace_plan(model, _loss, (meta,), None, "keep", get_hardware("cpu"), {})
    assert len(unplanned.regions) == 2
    step_peak_bytes = max(region.predicted_peak_bytes for region in unplanned.regions)
    assert unplanned.predicted_peak_bytes == step_peak_bytes

    plan = memfit.plan(model, _loss, meta, budget=0.85, hardware="cpu")
    assert len(plan.regions) == 2
    assert plan.budget_bytes == int(0.85 * step_peak_bytes)
    for region in plan.regions:
        assert region.explanation is not None
        assert region.explanation.peak_bytes <= plan.budget_bytes
    assert plan.swapped == tuple(name for region in plan.regions for name in region.swapped)
    assert plan.swapped  # 0.85 of the unplanned peak needs swaps here
    assert all(isinstance(region.decision(name), Swap)
               for region in plan.regions for name in region.swapped)
    with pytest.raises(ValueError, match="regions"):
        plan.decision(plan.swapped[0])

    text = plan.explain()
    assert "2 regions (graph breaks)" in text
    assert "-- region 0 --" in text and "-- region 1 --" in text
    for region in plan.regions:
        assert region.graph_hash in text

    eager_model = _TwoHalves()
    eager_model.load_state_dict(model.state_dict())
    eager_loss = eager_model(x)
    eager_loss.backward()
    step = memfit.compile(model, _loss, plan=plan, measure=False)
    loss = step(x)
    assert torch.equal(loss, eager_loss.detach())
    for mine, theirs in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)
    assert [region.plan for region in step.regions] == list(plan.regions)


def test_a_saved_plan_of_several_regions_loads_equal(tmp_path):
    model = _TwoHalves()
    plan = memfit.plan(model, _loss, torch.empty(256, 64, device="meta"), hardware="cpu")
    assert len(plan.regions) == 2
    path = tmp_path / "step.plan.json"
    plan.save(path)
    loaded = memfit.Plan.load(path)
    assert loaded == plan
    assert loaded.explain() == plan.explain()


def test_a_region_short_beside_the_saves_before_it_is_refused_with_its_minimum():
    """Ahead of time nothing runs that could plan the regions again: a region that misses the
    budget beside the regions before it raises ``BudgetError`` (no warning, no plan over it)."""
    model = _TwoHalves()
    meta = torch.empty(256, 64, device="meta")
    with pytest.raises(memfit.BudgetError) as refused:
        memfit.plan(model, _loss, meta, budget=0.5, hardware="cpu", strategy="keep")
    assert refused.value.minimum_bytes > refused.value.budget_bytes


def _gpt2_with_its_own_loss(layers: int = 2, width: int = 64):
    """transformers' GPT-2 as a user builds it: its loss from ``labels=`` warns through a logger
    on every call (``loss_type``), which Dynamo cannot trace: a graph break."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=128,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _unplanned_on_an_h100(model):
    """GPT-2's step at batch 2 planned unplanned (``keep``) for an H100 in bf16: its regions."""
    ids = torch.empty(2, 32, dtype=torch.long, device="meta")
    unplanned = trace_plan(model, _lm_loss, (ids,), None, "keep", get_hardware("h100-sxm"), {},
                           autocast=torch.bfloat16)
    assert len(unplanned.regions) >= 2
    return ids, unplanned


@pytest.mark.slow
def test_gpt2_with_labels_plans_every_region_ahead_for_an_h100_in_bf16():
    model = _gpt2_with_its_own_loss()
    ids, unplanned = _unplanned_on_an_h100(model)
    budget_bytes = int(0.8 * unplanned.predicted_peak_bytes)
    plan = memfit.plan(model, _lm_loss, ids, hardware="h100-sxm", autocast=torch.bfloat16,
                       budget=budget_bytes)
    assert len(plan.regions) == len(unplanned.regions)
    assert plan.budget_bytes == budget_bytes
    assert all(region.hardware == "h100-sxm" for region in plan.regions)
    for region in plan.regions:
        assert region.explanation is not None
        assert region.explanation.peak_bytes <= budget_bytes
    text = plan.explain()
    assert f"{len(plan.regions)} regions (graph breaks)" in text
    assert all(f"-- region {index} --" in text for index in range(len(plan.regions)))


@pytest.mark.slow
def test_max_batch_size_plans_gpt2_with_labels_across_its_graph_break():
    model = _gpt2_with_its_own_loss()
    _, at_two = _unplanned_on_an_h100(model)
    found = memfit.max_batch_size(model, _lm_loss,
                                  lambda batch: (torch.zeros(batch, 32, dtype=torch.long),),
                                  budget=at_two.predicted_peak_bytes, hardware="h100-sxm",
                                  strategy="keep", objective="largest", max_batch=3,
                                  autocast=torch.bfloat16)
    assert found.batch_size == 2  # unplanned, batch 2 fits its own peak and batch 3 does not
    assert [trial.batch_size for trial in found.tried] == [1, 2, 3]
    assert len(found.plan.regions) == len(at_two.regions)
    assert found.predicted_peak_bytes == at_two.predicted_peak_bytes
