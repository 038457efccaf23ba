"""The public API: compile, plan, measure_peak; errors that say what to do; nothing half-applied."""

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit import examples
from memfit.model.schedule import PlanError


def small():
    return examples.mlp(depth=8, width=64, batch_size=1024)


def snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


def assert_unchanged(model, before):
    params, grads, buffers = before
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name])
        assert (p.grad is None and grads[name] is None) or torch.equal(p.grad, grads[name])
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name])


@pytest.mark.parametrize("budget", ["abc", "-3GiB", 0, 1.5, "1.5", True, [1]])
def test_malformed_budget_says_which_forms_are_accepted(budget):
    example = small()
    with pytest.raises(ValueError, match="a budget.*fraction"):
        memfit.compile(example.model, example.loss_fn, budget=budget)


def test_unknown_strategy_and_parameter_name_the_accepted_values():
    example = small()
    with pytest.raises(ValueError, match="keep"):
        memfit.compile(example.model, example.loss_fn, strategy="magic")
    with pytest.raises(ValueError, match="n_tensors"):
        memfit.compile(example.model, example.loss_fn, strategy="swap", n_tensorz=3)
    with pytest.raises(ValueError, match="lb"):
        memfit.compile(example.model, example.loss_fn, strategy="swap", lb=5, ub=2)


def test_budget_error_leaves_the_model_untouched():
    example = small()
    model = example.model
    model(example.inputs()[0]).sum().backward()  # existing .grad must survive too
    before = snapshot(model)
    step = memfit.compile(model, example.loss_fn, budget=1000, strategy="swap")
    with pytest.raises(memfit.BudgetError) as error:
        step(*example.inputs())
    assert error.value.minimum_bytes > 1000
    assert error.value.dominant and "Raise the budget" in str(error.value)
    assert_unchanged(model, before)


def test_a_failing_step_leaves_the_model_untouched():
    example = small()
    model = example.model
    before = snapshot(model)

    def broken(model, x, y):
        return (model(x) @ torch.ones(3, 3)).mean()  # shape error while capturing

    with pytest.raises(memfit.CaptureError):
        memfit.compile(model, broken, strategy="keep")(*example.inputs())
    assert_unchanged(model, before)


def test_gradients_accumulate_like_backward():
    example = small()
    eager = copy.deepcopy(example.model)
    step = memfit.compile(example.model, example.loss_fn, budget="0.7", strategy="swap")
    for batch in (1024, 1024):
        inputs = example.inputs(batch)
        step(*inputs)
        example.loss_fn(eager, *inputs).backward()
    for a, b in zip(example.model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # same kernels, same order: bit for bit


def test_same_shape_reuses_the_plan_and_a_new_shape_replans():
    example = small()
    step = memfit.compile(example.model, example.loss_fn, budget="0.7", strategy="swap")
    step(*example.inputs(1024))
    first = step.compiled
    example.model.zero_grad(set_to_none=True)  # no gradients kept: nothing more is resident
    step(*example.inputs(1024))
    assert step.compiled is first and step.regions == [first]
    example.model.zero_grad(set_to_none=True)
    step(*example.inputs(512))
    other = step.compiled
    assert other is not first and step.regions == [first, other]
    assert other.graph.structure_hash != first.graph.structure_hash


def test_report_names_budget_prediction_and_measurement():
    example = small()
    step = memfit.compile(example.model, example.loss_fn, budget="0.7", strategy="swap")
    step(*example.inputs())
    text = step.report()
    assert "predicted" in text and "measured" in text and "swapped" in text
    assert "prediction gap: +0.00%" in text


def test_plan_with_meta_inputs_needs_no_data():
    example = small()
    inputs = tuple(t.to("meta") for t in example.inputs())
    plan = memfit.plan(example.model, example.loss_fn, *inputs, budget="0.7", hardware="h100-pcie")
    assert plan.hardware == "h100-pcie" and plan.strategy == "auto"
    assert plan.budget_bytes is not None and plan.explanation is not None
    assert plan.explanation.peak_bytes <= plan.budget_bytes


def test_a_budget_alone_plans_with_auto_bit_for_bit():
    """With a budget and no strategy, the fastest fitting mix runs; its step is the unplanned
    step's bit for bit and measures within the budget."""
    example = small()
    reference_model = copy.deepcopy(example.model)
    inputs = example.inputs()
    step = memfit.compile(example.model, example.loss_fn, budget="0.6")
    loss = step(*inputs)
    reference = memfit.compile(reference_model, example.loss_fn, strategy="keep")(*inputs)
    assert step.plan.strategy == "auto" and step.plan.params["solver"] != "keep"
    assert step.plan.decisions and torch.equal(loss, reference)
    for (name, p), q in zip(example.model.named_parameters(), reference_model.parameters(),
                            strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert step.measured.peak_bytes <= step.budget_bytes


def test_measure_peak_counts_what_a_call_allocates():
    x = torch.zeros(1024)  # 4 KiB, registered as pre-existing
    peak = memfit.measure_peak(lambda t: (t + t) * t, x)  # no Python scalar for the allocator to wrap
    assert peak == 3 * 4096  # x, t + t, and (t + t) * t alive together


def test_inputs_must_be_tensors():
    step = memfit.compile(nn.Linear(2, 2), lambda m, x, k: m(x).sum() * k, strategy="keep")
    with pytest.raises(ValueError, match="tensors only"):
        step(torch.randn(3, 2), 2.0)


def test_a_layer_frozen_between_steps_gets_no_gradient_as_in_eager():
    """Dynamo's guards see requires_grad: freezing re-traces and re-plans (the old capture,
    keyed on input shapes, kept writing .grad to frozen parameters)."""
    example = small()
    eager = copy.deepcopy(example.model)
    step = memfit.compile(example.model, example.loss_fn, budget="0.7", strategy="swap")
    for index in range(2):
        if index == 1:
            for model in (example.model, eager):
                model.zero_grad(set_to_none=True)
                for parameter in model[0].parameters():
                    parameter.requires_grad_(False)
        inputs = example.inputs()
        step(*inputs)
        example.loss_fn(eager, *inputs).backward()
    assert len(step.regions) == 2  # planned again after the freeze
    for (name, ours), theirs in zip(example.model.named_parameters(), eager.parameters(),
                                    strict=True):
        assert (ours.grad is None) == (theirs.grad is None), name
        assert ours.grad is None or torch.equal(ours.grad, theirs.grad), name
    assert all(p.grad is None for p in example.model[0].parameters())


@pytest.mark.slow
def test_planning_allocates_no_input_memory():
    """memfit.plan traces fake tensors: a batch of 4 GiB of inputs is planned in a few MiB."""
    from memfit.runtime.measure import measure_allocator_peak

    example = examples.mlp(depth=2, width=64, batch_size=1)
    inputs = tuple(t.to("meta") for t in example.inputs(1 << 24))  # 4 GiB of float32 x
    measured = measure_allocator_peak(memfit.plan, example.model, example.loss_fn, *inputs,
                                      strategy="keep", hardware="cpu")
    assert measured.result.graph_hash and measured.above_start_bytes < 64 * 2**20


def test_a_checkpointed_gpt2_plan_counts_its_saved_tensors_once():
    """A captured GPT-2 recomputes values that are not saved tensors on the way to saved ones
    (views, dropout masks): before, ``plan.explain()`` counted them against the saved tensors
    ("97 saved tensors; 0 swapped, 169 recomputed" at the example's default size)."""
    example = examples.gpt2(layers=1, width=32, heads=2, vocab=64, sequence=16, batch_size=2)
    inputs = tuple(t.to("meta") for t in example.inputs(2))
    plan = memfit.plan(example.model, example.loss_fn, *inputs, strategy="checkpoint")
    explanation = plan.explanation
    counted = explanation.tally
    rows = sum(row.decision == "recompute" for row in explanation.rows)
    assert rows > counted.saved == explanation.saved_tensors  # the populations differ here
    assert counted.swapped + counted.recomputed + counted.kept == counted.saved
    assert 0 < counted.recomputed < counted.saved and counted.rerun_count >= counted.recomputed
    text = plan.explain()
    assert (f"saved tensors: {counted.saved} = 0 swapped (0 B) + {counted.recomputed} "
            f"recomputed + {counted.kept} kept") in text
    assert f"re-runs: {counted.rerun_count} forward op runs" in text


def _tiny_gpt2():
    return examples.gpt2(layers=1, width=32, heads=2, sequence=16, batch_size=2)


@pytest.mark.slow
def test_a_plan_for_a_gpus_step_is_refused_on_cpu_and_a_cpu_plan_runs():
    """memfit.plan for a GPU profile captures that GPU's step (CUDA's attention kernel, its
    autocast dtypes): compile(plan=...) on CPU tensors refuses it, naming the cause; a plan for
    the CPU profile is the CPU's graph and runs."""
    example = _tiny_gpt2()
    meta = tuple(t.to("meta") for t in example.inputs())
    for autocast in (None, torch.bfloat16):
        gpu_plan = memfit.plan(example.model, example.loss_fn, *meta, budget=0.8,
                               hardware="h100-sxm", autocast=autocast)
        step = memfit.compile(example.model, example.loss_fn, plan=gpu_plan, measure=False)
        with pytest.raises(PlanError, match="another device's step"):
            step(*example.inputs())
    cpu_plan = memfit.plan(example.model, example.loss_fn, *meta, budget=0.8, hardware="cpu")
    step = memfit.compile(example.model, example.loss_fn, plan=cpu_plan, measure=False)
    step(*example.inputs())
    assert step.plan is cpu_plan


@pytest.mark.slow
def test_max_batch_size_under_a_gpus_bf16_autocast_fits_more():
    """Half-width activations: at one budget the bf16 step of the GPU fits a larger batch."""
    example = examples.gpt2(layers=2, width=64, heads=4, sequence=128, batch_size=2)
    largest = {}
    for autocast in (None, torch.bfloat16):
        found = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                                      budget="64MiB", hardware="h100-sxm", strategy="keep",
                                      objective="largest", max_batch=256, autocast=autocast)
        assert found.verified is None  # a CPU step measures nothing of the GPU's
        largest[autocast] = found.batch_size
    assert largest[torch.bfloat16] > largest[None]


def test_a_strategy_name_reads_with_underscore_or_hyphen_alike():
    """``vdnn-all`` plans what ``vdnn_all`` plans (the same plan JSON, which names
    ``vdnn_all``); compile and backend keep the registered spelling too."""
    example = small()
    inputs = tuple(t.to("meta") for t in example.inputs())
    plans = [memfit.plan(example.model, example.loss_fn, *inputs, budget="0.7",
                         hardware="h100-pcie", strategy=name) for name in ("vdnn-all", "vdnn_all")]
    assert plans[0].strategy == "vdnn_all" and plans[0].to_json() == plans[1].to_json()
    step = memfit.compile(example.model, example.loss_fn, budget="0.7", strategy="memory_poor")
    assert step.strategy == "memory-poor"
    assert memfit.backend(budget=0.5, strategy="optimal_recompute").strategy == "optimal-recompute"
