"""Analysis counts storages once and predicts the measured peak to the byte."""

import torch
from torch import nn

import memfit
from memfit import examples
from memfit.data.hardware import PROFILES
from memfit.model.kernels import repriced
from memfit.tracing.analyze import analyze
from memfit.tracing.capture import capture
from tests.measured_peaks import assert_measured_as_predicted


def test_views_and_transposes_add_no_bytes():
    model = nn.Linear(64, 64, bias=False)

    def loss_fn(model, x):
        h = model(x)
        return (h.t().reshape(-1) * h.reshape(-1)).sum()

    graph = analyze(capture(model, loss_fn, torch.randn(32, 64)), PROFILES["cpu"])
    views = [op for op in graph.ops if op.kind in ("aten.t", "aten.view", "aten._unsafe_view")]
    assert views and all(op.outputs == () for op in views)
    assert all(op.time_s == 0.0 for op in views)  # the built-in profile prices no view


def test_a_view_costs_its_dispatch_under_aot_eager_and_nothing_under_inductor():
    """``aot_eager``'s generated code calls the dispatcher for each view; inductor's makes
    them without a call; a tuple's ``getitem`` is Python's and calls no op."""
    hardware = PROFILES["cpu"].with_(view_overhead_s=2e-6)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    captured = capture(model, lambda model, x: model(x).sum(), torch.randn(4, 16))
    eager = analyze(captured, hardware)
    views = [op for op in eager.ops if not op.outputs and op.kind != "getitem"]
    getitems = [op for op in eager.ops if op.kind == "getitem"]
    assert views and getitems  # t(weight), layer norm's outputs
    assert all(op.time_s == 2e-6 for op in views)
    assert all(op.time_s == 0.0 for op in getitems)
    compiled = analyze(captured, hardware, compiler="inductor")
    assert all(op.time_s == 0.0 for op in compiled.ops if not op.outputs)
    assert repriced(eager, hardware, "aot_eager").ops == eager.ops


def test_saved_bytes_are_deduplicated_by_storage():
    example = examples.gpt2(layers=2, width=64, sequence=64, batch_size=2)
    captured = capture(example.model, example.loss_fn, *example.inputs())
    graph = analyze(captured, PROFILES["cpu"])
    unique = sum(t.size_bytes for t in graph.saved_tensors())
    naive = 0  # the sum over forward nodes read by backward nodes, counting every alias
    for node in captured.graph_module.graph.nodes:
        if node.meta.get("partitioner_tag") == "is_forward" and node.op == "call_function":
            if any(u.meta.get("partitioner_tag") == "is_backward" for u in node.users):
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    naive += value.numel() * value.element_size()
    assert 0 < unique < naive


def test_flops_come_from_the_torch_flop_counter():
    model = nn.Linear(128, 256, bias=False)
    graph = analyze(capture(model, lambda m, x: m(x).sum(), torch.randn(64, 128)), PROFILES["cpu"])
    matmuls = [op for op in graph.ops if op.kind == "aten.mm"]
    # forward x @ W^T and backward dW = g^T x: 2 * 64 * 128 * 256 each
    assert sorted(op.flops for op in matmuls) == [2 * 64 * 128 * 256] * 2


def test_predicted_unplanned_peak_equals_measured_peak_to_the_byte():
    example = examples.gpt2(layers=2, width=64, sequence=64, batch_size=2)
    step = memfit.compile(example.model, example.loss_fn, strategy="keep")
    step(*example.inputs())
    assert_measured_as_predicted(step)
