"""Every compute op of a captured model gets its FLOPs, counted as torch counts the same math.

The checks against an independent count use torch's own formulas for other kernels doing the
same arithmetic: GPT-2's attention traced as the math path (``bmm``) with dropout, and as the
CPU flash kernel without; ``nn.LSTM`` unrolled into ``mm`` ops, and as oneDNN's fused layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from memfit import examples
from memfit.data.hardware import PROFILES
from memfit.data.op_classes import COMPUTE_CLASSES, MEMORY, op_class
from memfit.tracing import rnn
from memfit.tracing.analyze import analyze, op_kind
from memfit.tracing.capture import capture
from memfit.tracing.flops import causal_share, node_flops


def _graph(example: examples.Example, eager_lstm: bool = False):
    if eager_lstm:  # the fused oneDNN layer, as memfit.fit traces an nn.LSTM
        with rnn.eager_lstm_kernels():
            captured = capture(example.model, example.loss_fn, *example.inputs())
    else:
        captured = capture(example.model, example.loss_fn, *example.inputs())
    return analyze(captured, PROFILES["cpu"])


def _bert_without_mask() -> examples.Example:
    """BERT traced whole: its padding mask is read into Python (``mask.all()``), which a fake
    tensor cannot answer; the mask changes no compute op's shape."""
    example = examples.bert(layers=1, sequence=16, batch_size=2)
    return dataclasses.replace(example, loss_fn=lambda model, ids, mask, labels: model(
        input_ids=ids, labels=labels).loss)


MODELS = {
    "gpt2_dropout": lambda: examples.gpt2(layers=1, sequence=32, batch_size=2, dropout=0.1),
    "gpt2_no_dropout": lambda: examples.gpt2(layers=1, sequence=32, batch_size=2, dropout=0.0),
    "bert": _bert_without_mask,
    "resnet50_shaped": lambda: examples.resnet50_shaped(widths=(8, 16, 32, 64), image=32,
                                                        batch_size=2),
    "unet3d": lambda: examples.unet3d(channels=(4, 8, 16), size=16, batch_size=1),
    "lstm": lambda: examples.lstm(sequence=8, batch_size=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_compute_op_is_priced_at_zero_flops(name):
    graph = _graph(MODELS[name](), eager_lstm=name == "lstm")
    compute = [op for op in graph.ops if op_class(op.kind) != MEMORY and op.outputs]
    assert compute, f"{name} captured no compute op"
    free = sorted({op.kind for op in compute if op.flops <= 0})
    assert not free, f"{name}: compute ops priced at zero FLOPs: {free}"
    assert all(op.time_s > PROFILES["cpu"].op_overhead_s for op in compute)


def test_every_op_torch_counts_is_in_a_compute_class():
    """The class list and the FLOP registry agree: an op with a formula is priced as compute."""
    kinds = {op_kind_of(target) for target in flop_registry}
    assert {kind for kind in kinds if op_class(kind) == MEMORY} == set()


def op_kind_of(target) -> str:
    """``op_kind``'s name for a registry key (an overload packet or a higher-order op)."""
    schema = getattr(getattr(target, "default", None), "_schema", None)
    if schema is None and hasattr(target, "overloads"):
        schema = getattr(target, target.overloads()[0])._schema
    return schema.name.replace("::", ".") if schema is not None else target.__name__


def test_every_compute_class_kind_names_a_real_op():
    kinds = {kind for kinds in COMPUTE_CLASSES.values() for kind in kinds}
    for kind in kinds:
        namespace, _, name = kind.rpartition(".")
        if namespace == "aten":
            assert hasattr(torch.ops.aten, name), kind


@pytest.mark.slow
def test_cpu_flash_attention_counts_the_math_paths_matmuls():
    """Same GPT-2 twice: with dropout attention traces as ``bmm``s (forward Q K^T and P V, four
    in backward), without as the CPU flash kernel. The kernel's backward recomputes Q K^T, one
    more ``2 B H S S D`` per layer, and, causal, computes only the unmasked (S + 1) / 2S of the
    scores, which the math path computes whole before masking; every other FLOP is the same."""
    layers, heads, width, sequence, batch = 2, 4, 64, 32, 2
    shape = dict(layers=layers, heads=heads, width=width, sequence=sequence, batch_size=batch)
    flash = _graph(examples.gpt2(**shape, dropout=0.0))
    math = _graph(examples.gpt2(**shape, dropout=0.1))
    kernels = [op for op in flash.ops if op_class(op.kind) == "attention"]
    assert {op.kind for op in kernels} == {
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward"}
    scores = 2 * batch * heads * sequence * sequence * (width // heads)  # one S x S matmul
    attention_matmuls = sum(op.flops for op in math.ops if op.kind == "aten.bmm")
    assert attention_matmuls == layers * 6 * scores
    causal = (sequence + 1) / (2 * sequence)
    assert sum(op.flops for op in kernels) == layers * 7 * scores * causal
    others = sum(op.flops for op in flash.ops) - sum(op.flops for op in kernels)
    assert others == sum(op.flops for op in math.ops) - attention_matmuls


def _attention_node(is_causal: bool, queries: int, keys: int) -> torch.fx.Node:
    graph = torch.fx.Graph()
    query, key = graph.placeholder("query"), graph.placeholder("key")
    query.meta["val"] = torch.empty(1, 2, queries, 8)
    key.meta["val"] = torch.empty(1, 2, keys, 8)
    node = graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                               (query, key, key, 0.0, is_causal))
    node.meta["val"] = (torch.empty(1, 2, queries, 8), torch.empty(1, 2, queries))
    return node


@pytest.mark.parametrize("is_causal, queries, keys, share", [
    (False, 16, 16, 1.0), (True, 16, 16, 17 / 32), (True, 4, 16, 10 / 64),
    (True, 16, 4, (10 + 12 * 4) / 64),
])
def test_causal_attention_counts_the_unmasked_scores(is_causal, queries, keys, share):
    """Top-left aligned, as PyTorch's is_causal: query row i sees keys 0..i."""
    node = _attention_node(is_causal, queries, keys)
    assert causal_share(node) == share
    full = 2 * (2 * 1 * 2 * queries * keys * 8)  # torch's count: Q K^T and P V, every score
    assert node_flops(node) == full * share


@pytest.mark.slow
def test_fused_lstm_counts_the_unrolled_matmuls():
    """oneDNN's layer against the same LSTM unrolled into ``mm``s. The fused backward also
    returns the gradient of the initial hidden state, one ``dgates @ W_hh`` per layer that the
    unrolled trace skips (its zero initial state needs no gradient)."""
    layers, width, sequence, batch = 2, 32, 8, 2
    example = dict(layers=layers, width=width, sequence=sequence, batch_size=batch)
    fused = _graph(examples.lstm(**example), eager_lstm=True)
    unrolled = _graph(examples.lstm(**example))
    assert any(op.kind == "aten.mkldnn_rnn_layer_backward" for op in fused.ops)
    assert not any(op_class(op.kind) == "rnn" for op in unrolled.ops)
    initial_state_gradients = layers * 2 * batch * (4 * width) * width
    total = sum(op.flops for op in fused.ops)
    assert total == sum(op.flops for op in unrolled.ops) + initial_state_gradients


def test_registered_formulas_count_for_flop_counter_mode_too():
    """Registered in torch's registry: a user's ``FlopCounterMode`` counts the CPU kernel."""
    query = torch.randn(2, 4, 16, 8)
    with FlopCounterMode(display=False) as counter:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, query, query)
    assert counter.get_total_flops() == 2 * (2 * 2 * 4 * 16 * 16 * 8)


def test_a_failing_formula_counts_zero_with_a_warning():
    graph = torch.fx.Graph()
    left = graph.placeholder("left")
    node = graph.call_function(torch.ops.aten.mm.default, (left, left))
    left.meta["val"] = torch.empty(3, 4)  # 3x4 @ 3x4: the formula's shapes do not match
    node.meta["val"] = torch.empty(3, 4)
    with pytest.warns(UserWarning, match="memfit counts 0 FLOPs for mm"):
        assert node_flops(node) == 0.0
    assert op_kind(node) == "aten.mm"
