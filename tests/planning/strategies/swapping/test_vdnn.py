"""The vDNN policies: vdnn_all, vdnn_conv, vdnn_dyn on synthetic and captured graphs, and one run.

What is checked: vdnn_all swaps exactly the feature maps, vdnn_conv exactly the convolution
inputs; every swap-in is issued one backward layer ahead of its first reader; every plan passes
``check_plan``; with a budget a policy fits or raises ``BudgetError`` whose minimum itself fits;
vdnn_dyn is never slower than vdnn_all / vdnn_conv where they fit; gradients under vdnn_all are
bit for bit those of the unplanned step.
"""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit import examples
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import PROFILES
from memfit.data.plan import Plan, Swap
from memfit.model.schedule import check_plan
from memfit.model.simulate import simulate
from memfit.model.synthetic import chain, multi_tower, random_dag, resnet_like
from memfit.planning.strategies import check_params, get_strategy, strategy_names
from memfit.planning.strategies.swapping._vdnn_layers import (
    attention_backend,
    is_convolution,
    layer_runs,
)
from tests.measured_peaks import assert_within_budget

POLICIES = ("vdnn_all", "vdnn_conv", "vdnn_dyn")
HARDWARE = (PROFILES["h100-pcie"], PROFILES["gh200"])
FRACTIONS = (0.9, 0.5, 0.3)  # 0.3 is below every minimum here but chain's
SYNTHETIC = {
    "chain": lambda: chain(12),
    "resnet_like": lambda: resnet_like(4),
    "multi_tower": lambda: multi_tower(3, 4),
    "random_dag": lambda: random_dag(40, seed=3),
}


@pytest.fixture(scope="module")
def captured() -> dict[str, CostGraph]:
    """GPT-2 (the example's defaults: math attention with dropout) and a ResNet-50 shape."""
    from memfit.tracing.analyze import analyze
    from memfit.tracing.capture import capture

    graphs = {}
    for name, example in (("gpt2", examples.gpt2()),
                          ("resnet50", examples.resnet50_shaped(widths=(16, 32, 64, 128), image=32))):
        graphs[name] = analyze(capture(example.model, example.loss_fn, *example.inputs()),
                               PROFILES["h100-pcie"], name=name)
    return graphs


def all_graphs(captured) -> dict[str, CostGraph]:
    return {**{name: make() for name, make in SYNTHETIC.items()}, **captured}


def feature_maps(graph: CostGraph) -> set[str]:
    """Saved activations with bytes that a backward op reads after every forward read."""
    phase = {op.name: op.phase for op in graph.ops}
    found = set()
    for tensor in graph.saved_tensors():
        if tensor.is_output or tensor.size_bytes == 0:
            continue
        last_forward = max((graph.index[c] for c in tensor.consumers if phase[c] != "backward"),
                           default=graph.index[tensor.producer or ""])
        if any(phase[c] == "backward" and graph.index[c] > last_forward for c in tensor.consumers):
            found.add(tensor.name)
    return found


def keep_peak(graph: CostGraph) -> int:
    return simulate(graph, Plan("keep"), HARDWARE[0], record_intervals=False).peak_bytes


# ---- registration and parameters ----------------------------------------------------------------


def test_registered_with_checked_parameters():
    assert set(POLICIES) <= set(strategy_names())
    for name in POLICIES:
        check_params(name, {"attention": "math"})
        with pytest.raises(ValueError, match="attention must be one of"):
            check_params(name, {"attention": "flash"})
        with pytest.raises(ValueError, match="unknown parameter"):
            check_params(name, {"lb": 3})
        with pytest.raises(ValueError, match="budget_bytes"):
            get_strategy(name)(chain(4), HARDWARE[0], -1)


# ---- what is offloaded, and when it comes back ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_vdnn_all_swaps_exactly_the_feature_maps(name):
    graph = SYNTHETIC[name]()
    plan = get_strategy("vdnn_all")(graph, HARDWARE[0])
    expected = {t.name for t in graph.saved_tensors() if not t.is_output}
    assert set(plan.swapped) == expected == feature_maps(graph)
    check_plan(graph, plan)


def test_vdnn_all_and_conv_on_captured_graphs(captured):
    gpt2, resnet = captured["gpt2"], captured["resnet50"]
    for graph in (gpt2, resnet):
        plan = get_strategy("vdnn_all")(graph, HARDWARE[0])
        assert set(plan.swapped) == feature_maps(graph)
    # GPT-2's Conv1D modules are matrix multiplies: vdnn_conv treats "convolution" strictly.
    assert not get_strategy("vdnn_conv")(gpt2, HARDWARE[0]).swapped
    convs = {t for op in resnet.forward_ops if op.kind == "aten.convolution" for t in op.inputs}
    plan = get_strategy("vdnn_conv")(resnet, HARDWARE[0])
    assert plan.swapped and set(plan.swapped) == convs & feature_maps(resnet)


def test_vdnn_conv_on_resnet_like_offloads_convolution_inputs():
    graph = resnet_like(2)
    plan = get_strategy("vdnn_conv")(graph, HARDWARE[0])
    assert set(plan.swapped) == {"stem", "b0_relu", "b0_add", "b1_relu"}
    assert is_convolution("aten.convolution.default") and is_convolution("aten.conv_transpose2d")
    assert not is_convolution("aten.convolution_backward") and not is_convolution("aten.addmm")


def test_chain_prefetch_is_one_layer_ahead():
    """f_i is read by f_{i+1}'s backward; it is fetched when f_{i+2}'s backward starts."""
    plan = get_strategy("vdnn_all")(chain(8), HARDWARE[0])
    for i in range(6):
        decision = plan.decision(f"f{i}")
        assert isinstance(decision, Swap) and len(decision.swap_ins) == 1
        assert decision.swap_ins[0].after == f"f{i + 2}_backward"
        assert decision.swap_ins[0].consumers == (f"f{i + 1}_backward",)
    assert plan.decision("f6").swap_ins[0].after == "loss_backward"  # f7's layer is the first


def test_prefetch_is_one_layer_ahead_everywhere(captured):
    for name, graph in all_graphs(captured).items():
        runs = layer_runs(graph, "backward")
        layer_of = {graph.ops[i].name: n for n, run in enumerate(runs) for i in run}
        plan = get_strategy("vdnn_all")(graph, HARDWARE[0])
        for tensor, decision in plan.decisions.items():
            assert isinstance(decision, Swap)
            (swap_in,) = decision.swap_ins
            first = swap_in.consumers[0]
            layer = layer_of[first]
            expected = (graph.ops[runs[layer - 1][0]].name if layer
                        else graph.ops[graph.index[first] - 1].name)
            last_forward = max([graph.index[graph.tensors[tensor].producer or ""]] + [
                graph.index[c] for c in graph.tensors[tensor].consumers
                if graph.op(c).phase != "backward"])
            if graph.index[expected] >= last_forward:  # else clamped to the last forward read
                assert swap_in.after == expected, (name, tensor)


# ---- budgets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hardware", HARDWARE, ids=lambda h: h.name)
def test_fits_or_raises_a_minimum_that_fits(captured, hardware):
    for name, graph in all_graphs(captured).items():
        peak = keep_peak(graph)
        for fraction in FRACTIONS:
            budget = int(fraction * peak)
            times = {}
            for policy in POLICIES:
                try:
                    plan = get_strategy(policy)(graph, hardware, budget)
                except BudgetError as error:
                    assert error.minimum_bytes > budget and error.strategy == policy
                    plan = get_strategy(policy)(graph, hardware, error.minimum_bytes)
                    timeline = simulate(graph, plan, hardware, record_intervals=False)
                    assert timeline.peak_bytes <= error.minimum_bytes, (name, policy)
                    continue
                check_plan(graph, plan)
                timeline = simulate(graph, plan, hardware, record_intervals=False)
                assert timeline.peak_bytes <= budget, (name, policy, fraction)
                times[policy] = timeline.step_time_s
            for fixed in ("vdnn_all", "vdnn_conv"):
                if fixed in times:
                    assert "vdnn_dyn" in times, (name, fraction)
                    assert times["vdnn_dyn"] <= times[fixed] * (1 + 1e-9), (name, fixed, fraction)


def test_vdnn_dyn_searches_the_boundary(captured):
    graph = captured["gpt2"]
    hardware = HARDWARE[0]
    assert not get_strategy("vdnn_dyn")(graph, hardware).swapped  # fits the device: nothing
    loose = get_strategy("vdnn_dyn")(graph, hardware, int(0.7 * keep_peak(graph)))
    tight = get_strategy("vdnn_dyn")(graph, hardware, int(0.4 * keep_peak(graph)))
    assert loose.params["policy"] == tight.params["policy"] == "all"
    assert 0 < loose.params["boundary"] < tight.params["boundary"] < loose.params["policy_layers"]
    assert set(loose.swapped) < set(tight.swapped) < feature_maps(graph)


def test_no_feature_maps_raises_the_unplanned_peak():
    graph = chain(1)  # f0 is read by the loss only: nothing is saved for backward
    for policy in POLICIES:
        assert not get_strategy(policy)(graph, HARDWARE[0]).swapped
        with pytest.raises(BudgetError) as error:
            get_strategy(policy)(graph, HARDWARE[0], 1)
        assert error.value.minimum_bytes == keep_peak(graph)


# ---- the attention backend ------------------------------------------------------------------------


def test_attention_backend_is_the_captured_one(captured):
    gpt2 = captured["gpt2"]
    assert attention_backend(gpt2) == "math" and attention_backend(chain(3)) == "none"
    for policy in POLICIES:
        assert get_strategy(policy)(gpt2, HARDWARE[0], attention="math").params["attention"] \
            == "math"
        with pytest.raises(ValueError, match="sdpa_kernel"):
            get_strategy(policy)(gpt2, HARDWARE[0], attention="fused")
        assert get_strategy(policy)(chain(3), HARDWARE[0], attention="fused").params[
            "attention"] == "none"


# ---- end to end --------------------------------------------------------------------------------


def test_vdnn_all_run_is_bitwise_the_unplanned_step():
    example = examples.gpt2(layers=1, sequence=64, batch_size=2)
    inputs = example.inputs()
    torch.use_deterministic_algorithms(True)
    try:
        results = {}
        for strategy, budget in (("keep", None), ("vdnn_all", 0.75)):
            model = copy.deepcopy(example.model)
            step = memfit.compile(model, example.loss_fn, budget=budget, strategy=strategy)
            torch.manual_seed(0)
            results[strategy] = (step, model, step(*inputs))
    finally:
        torch.use_deterministic_algorithms(False)
    (_, keep_model, keep_loss), (step, model, loss) = results["keep"], results["vdnn_all"]
    assert step.plan.swapped and step.plan.strategy == "vdnn_all"
    assert torch.equal(loss, keep_loss)
    for (name, got), expected in zip(model.named_parameters(), keep_model.parameters(),
                                     strict=True):
        assert torch.equal(got.grad, expected.grad), name
    assert_within_budget(step, step.budget_bytes)
