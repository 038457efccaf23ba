"""Plans are portable: plan once (meta inputs), explain, save, load, and run the loaded plan with
bit-for-bit the gradients of the step that planned for itself; a plan for another input shape or
hardware fails with a message that says which differs and what to do."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import memfit
from memfit import examples
from memfit.data.plan import Plan

BUDGET = 0.9  # of the unplanned peak: both strategies fit, and both decide something


@pytest.fixture(scope="module")
def example():
    return examples.mlp(depth=4, width=64, batch_size=1024)


@pytest.fixture(scope="module")
def swap_plan(example):
    return plan_for(example, "swap")


def plan_for(example, strategy, hardware="cpu"):
    meta = tuple(t.to("meta") for t in example.inputs())  # shapes only: nothing runs
    return memfit.plan(example.model, example.loss_fn, *meta, budget=BUDGET, hardware=hardware,
                       strategy=strategy)


def run(step, model, inputs):
    model.zero_grad(set_to_none=True)
    loss = step(*inputs)
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["swap", "checkpoint"])
def test_a_loaded_plan_runs_bit_for_bit_like_the_planned_step(example, swap_plan, strategy,
                                                              tmp_path):
    model, inputs = example.model, example.inputs()
    made = swap_plan if strategy == "swap" else plan_for(example, strategy)
    assert made.decisions and made.explanation is not None
    made.save(tmp_path / "step.plan.json")
    loaded = memfit.Plan.load(tmp_path / "step.plan.json")
    assert loaded.decisions == made.decisions and loaded.explanation == made.explanation

    planned_step = memfit.compile(model, example.loss_fn, budget=BUDGET, strategy=strategy,
                                  hardware="cpu", measure=False)
    loss, grads = run(planned_step, model, inputs)
    assert planned_step.plan.decisions == loaded.decisions  # meta inputs plan what real ones do

    loaded_step = memfit.compile(model, example.loss_fn, plan=loaded, measure=False)
    loaded_loss, loaded_grads = run(loaded_step, model, inputs)
    assert loaded_step.plan is loaded
    assert torch.equal(loss, loaded_loss)
    assert grads.keys() == loaded_grads.keys()
    assert all(torch.equal(grads[name], loaded_grads[name]) for name in grads)

    model.zero_grad(set_to_none=True)  # and both are PyTorch's own gradients
    example.loss_fn(model, *inputs).backward()
    assert all(torch.equal(p.grad, grads[name]) for name, p in model.named_parameters())

    # the explanation: every decision, its costs add up to the step's prediction, what-ifs
    explanation = planned_step.plan.explanation
    shown, graph = {row.tensor for row in explanation.rows}, planned_step.compiled.graph
    assert shown <= set(planned_step.plan.decisions)
    for hidden in set(planned_step.plan.decisions) - shown:  # marked inside a segment, a no-op
        assert all(graph.op(c).phase == "forward" for c in graph.tensors[hidden].consumers), (
            hidden, [(c, graph.op(c).phase) for c in graph.tensors[hidden].consumers])
    predicted = planned_step.predicted
    assert sum(r.exposed_s for r in explanation.rows) == pytest.approx(
        predicted.exposed_transfer_s)
    assert sum(r.recompute_s for r in explanation.rows) == pytest.approx(predicted.recompute_s)
    assert (predicted.exposed_transfer_s if strategy == "swap" else predicted.recompute_s) > 0
    assert explanation.step_time_s == predicted.step_time_s
    assert explanation.what_if == ()  # compile plans once; memfit.plan adds the what-ifs
    text = loaded.explain(rows=None)
    assert all(f"| {row.tensor} " in text for row in loaded.explanation.rows)
    assert "| 90%" in text and "| 110%" in text  # loaded is memfit.plan's: it has them
    assert "what if: not computed" in planned_step.plan.explain()


def test_a_plan_for_another_input_shape_fails_clearly(example, swap_plan):
    step = memfit.compile(example.model, example.loss_fn, plan=swap_plan, measure=False)
    with pytest.raises(memfit.PlanError, match="other input shapes.*plan again with memfit.plan"):
        step(*example.inputs(512))


def test_a_plan_for_another_hardware_fails_clearly(example, swap_plan):
    step = memfit.compile(example.model, example.loss_fn, hardware="h100-pcie", plan=swap_plan)
    with pytest.raises(memfit.PlanError, match="made for hardware 'cpu'.*hardware='cpu'"):
        step(*example.inputs())


def test_the_plan_s_hardware_is_the_default(example, swap_plan):
    # as if made with hardware="gh200": compile() on this CPU plans with that profile, not "cpu"
    made = replace(swap_plan, hardware="gh200")
    step = memfit.compile(example.model, example.loss_fn, plan=made)
    example.model.zero_grad(set_to_none=True)
    step(*example.inputs())
    assert step.plan is made


def test_plan_with_a_budget_or_strategy_is_refused(example, swap_plan):
    with pytest.raises(ValueError, match="either plan= or budget"):
        memfit.compile(example.model, example.loss_fn, budget=0.5, plan=swap_plan)
    with pytest.raises(ValueError, match="either plan= or budget"):
        memfit.compile(example.model, example.loss_fn, plan=swap_plan, lb=3)


def test_plan_is_public():
    assert memfit.Plan is Plan and "Plan" in memfit.__all__


def test_every_decision_and_the_explanation_are_public_together():
    """A plan's decisions are Keep, Swap (with its SwapIns), Recompute (any of them a
    Decision), and its re-runs Rerun; ``plan.explanation`` is an Explanation: all importable
    from ``memfit`` itself."""
    from memfit.data import plan as plan_module
    from memfit.data.explanation import Explanation

    for name in ("Keep", "Swap", "SwapIn", "Recompute", "Rerun", "Decision"):
        assert getattr(memfit, name) is getattr(plan_module, name) and name in memfit.__all__
    assert memfit.Explanation is Explanation


# ---- a plan that loads but does not fit the step: refused before anything runs -------------------


def _model_with_state():
    """Linear, BatchNorm (buffers the step updates), Linear; every .grad already set."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    inputs = (torch.randn(512, 16), torch.randn(512, 1))
    loss_fn = lambda model, x, y: torch.nn.functional.mse_loss(model(x), y)  # noqa: E731
    loss_fn(model, *inputs).backward()
    return model, loss_fn, inputs


def _incompatible(kind, model, loss_fn, inputs, tmp_path):
    """A plan file that passes the schema but is wrong for this step, loaded back."""
    data = memfit.plan(model, loss_fn, *inputs, hardware="cpu", strategy="checkpoint").to_json()
    if kind == "another graph":
        data["graph_hash"], data["topology_hash"] = "0" * 16, "0" * 16
    elif kind == "another shape":
        data["graph_hash"] = "1" * 16  # the topology hash still matches
    elif kind == "a tensor not in the graph":
        data["decisions"] = {"no_such_tensor": {"type": "Recompute", "reason": ""}}
    elif kind == "another hardware":
        data["hardware"] = "h100-pcie"
    path = tmp_path / "step.plan.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


@pytest.mark.slow
@pytest.mark.parametrize("kind, message", [
    ("another graph", "made for another graph"),
    ("another shape", "other input shapes"),
    ("a tensor not in the graph", "names tensor 'no_such_tensor', which is not in the graph"),
    ("another hardware", "made for hardware 'h100-pcie'"),
    ("a blank graph hash", "names no graph"),
])
def test_an_incompatible_plan_leaves_the_model_untouched(kind, message, tmp_path):
    model, loss_fn, inputs = _model_with_state()
    if kind == "a blank graph hash":  # built in code: a file with one is refused by Plan.load
        loaded = replace(memfit.plan(model, loss_fn, *inputs, hardware="cpu",
                                     strategy="checkpoint"), graph_hash="")
    else:
        loaded = _incompatible(kind, model, loss_fn, inputs, tmp_path)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    step = memfit.compile(model, loss_fn, plan=loaded, hardware="cpu")
    with pytest.raises(memfit.PlanError, match=message):
        step(*inputs)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], value) for name, value in model.state_dict().items())
    assert all(torch.equal(grads[name], p.grad) for name, p in model.named_parameters())


def test_the_same_check_sees_a_step_that_ran():
    """The control: a fitting plan runs, and the comparison above sees what it changed."""
    model, loss_fn, inputs = _model_with_state()
    fitting = memfit.plan(model, loss_fn, *inputs, hardware="cpu", strategy="checkpoint")
    state = {name: value.clone() for name, value in model.state_dict().items()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    memfit.compile(model, loss_fn, plan=fitting, hardware="cpu")(*inputs)
    assert not torch.equal(state["1.running_mean"], model.state_dict()["1.running_mean"])
    assert not any(torch.equal(grads[name], p.grad) for name, p in model.named_parameters())


def test_compile_wants_a_plan_not_a_path(example):
    with pytest.raises(ValueError, match=r"plan= takes a memfit.Plan, not str.*Plan.load\(path\)"):
        memfit.compile(example.model, example.loss_fn, plan="step.plan.json")
