"""A step planned on this CPU for a CUDA profile is captured as CUDA runs it: CUDA's SDPA kernel
(no S x S tensor), CUDA's autocast policy; a CPU step is captured exactly as before."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import examples
from memfit.data.hardware import get_hardware
from memfit.fitting.traced import trace_plan
from memfit.tracing.capture import capture
from memfit.tracing.target import retargeted

H100 = get_hardware("h100-sxm")
SEQUENCE = 1024
BATCH = 16
HEADS = 16
FLASH = "aten._scaled_dot_product_flash_attention"


def _medium_width_gpt2(layers: int = 2):
    """GPT-2 medium's width, heads and sequence (attention dropout 0.1) with 2 of its 24 layers
    and a small vocabulary: the attention is the same, capture takes seconds."""
    return examples.gpt2(layers=layers, width=1024, heads=HEADS, vocab=128, sequence=SEQUENCE,
                         batch_size=BATCH, dropout=0.1)


def _meta_inputs(example):
    return tuple(t.to("meta") for t in example.inputs())


def _calls(graph_module):
    return [n for n in graph_module.graph.nodes if n.op == "call_function"]


def _values(node):
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor)]


def _name(node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(node.target)


@pytest.fixture(scope="module")
def gpt2_bf16():
    example = _medium_width_gpt2()
    return capture(example.model, example.loss_fn, *_meta_inputs(example), hardware=H100,
                   autocast=torch.bfloat16)


def test_gpt2_for_h100_in_bf16_holds_no_sequence_by_sequence_tensor(gpt2_bf16):
    # width = sequence = 1024, so (B, S, d) and (d, d) tensors end in 1024 x 1024 too: the
    # scores are the 4-D ones, (B, H, S, S), and nothing is as large as they are
    values = [v for node in _calls(gpt2_bf16.graph_module) for v in _values(node)]
    assert not [tuple(v.shape) for v in values
                if v.dim() == 4 and tuple(v.shape[-2:]) == (SEQUENCE, SEQUENCE)]
    assert max(v.numel() for v in values) < BATCH * HEADS * SEQUENCE * SEQUENCE
    names = collections.Counter(_name(node) for node in _calls(gpt2_bf16.graph_module))
    assert names["_scaled_dot_product_flash_attention"] == 2  # one per layer
    assert names["_scaled_dot_product_flash_attention_backward"] == 2
    assert names["bmm"] == names["_safe_softmax"] == 0


def test_gpt2_for_h100_in_bf16_runs_matmuls_in_bf16_and_keeps_weight_gradients_float32(
        gpt2_bf16):
    matmuls = [node for node in _calls(gpt2_bf16.graph_module)
               if _name(node) in ("mm", "addmm", "bmm")]
    assert matmuls and {_values(node)[0].dtype for node in matmuls} == {torch.bfloat16}
    norms = [node for node in _calls(gpt2_bf16.graph_module) if _name(node) == "native_layer_norm"]
    assert norms and {_values(node)[0].dtype for node in norms} == {torch.float32}
    output = gpt2_bf16.graph_module.graph.find_nodes(op="output")[0]
    gradients = [value.meta["val"].dtype for value, binding
                 in zip(output.args[0], gpt2_bf16.outputs, strict=True)
                 if binding.kind == "gradient" and value is not None]
    assert gradients and set(gradients) == {torch.float32}


def test_planned_gpt2_prices_the_flash_kernel():
    example = _medium_width_gpt2()
    planned = trace_plan(example.model, example.loss_fn, _meta_inputs(example), None, "keep",
                         H100, {}, autocast=torch.bfloat16)
    attention = [op for op in planned.graph.ops if "attention" in op.kind]
    assert {op.kind for op in attention} == {FLASH, FLASH + "_backward"}
    assert all(op.flops > 0 and op.dtype == "bfloat16" for op in attention)
    matmuls = [op for op in planned.graph.ops if op.kind in ("aten.mm", "aten.addmm")]
    assert matmuls and {op.dtype for op in matmuls} == {"bfloat16"}


class _Attention(nn.Module):
    """Self-attention of a given head dim, with an optional mask, in float32."""

    def __init__(self, head_dim: int, masked: bool) -> None:
        super().__init__()
        self.project = nn.Linear(8, 3 * 2 * head_dim)
        self.head_dim, self.masked = head_dim, masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        q, k, v = self.project(x).view(batch, sequence, 3, 2, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = torch.ones(sequence, sequence, dtype=torch.bool).tril() if self.masked else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)


def _attention_kernels(head_dim: int, masked: bool = False, autocast=None) -> set[str]:
    model = _Attention(head_dim, masked)
    captured = capture(model, lambda m, x: m(x).sum(), torch.empty(2, 64, 8, device="meta"),
                       hardware=H100, autocast=autocast)
    return {_name(node) for node in _calls(captured.graph_module)
            if "attention" in _name(node) or _name(node) in ("bmm", "_safe_softmax")}


def test_float32_attention_for_cuda_takes_the_memory_efficient_kernel():
    efficient = {"_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_efficient_attention_backward"}
    assert _attention_kernels(64) == efficient
    planned = trace_plan(_Attention(64, masked=False), lambda m, x: m(x).sum(),
                         (torch.empty(2, 64, 8, device="meta"),), None, "keep", H100, {})
    priced = {op.kind: op.flops for op in planned.graph.ops if "attention" in op.kind}
    assert priced.keys() == {f"aten.{name}" for name in efficient}
    assert min(priced.values()) > 0
    assert _attention_kernels(64, masked=True) == efficient  # a mask rules out flash only
    # sdp_utils.cpp sets no head-dim limit on the memory-efficient kernel, only alignment
    assert _attention_kernels(320) == efficient


def test_attention_cuda_cannot_fuse_takes_the_math_path():
    # float32's efficient kernel needs a head dim divisible by 4; a head dim over 256 rules out
    # flash in bf16, 258 is not 8-aligned for the efficient kernel
    assert "bmm" in _attention_kernels(258)
    assert "bmm" in _attention_kernels(258, autocast=torch.bfloat16)
    assert "_scaled_dot_product_flash_attention" in _attention_kernels(256,
                                                                       autocast=torch.bfloat16)


def _small_resnet() -> nn.Module:
    """Conv, batch norm and ReLU in a residual block, then a linear head."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.norm = nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.norm(self.conv(x)))

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), Block(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def test_cnn_under_cuda_bf16_autocast_convolves_in_bf16_and_normalizes_as_it_comes():
    model = _small_resnet()
    inputs = (torch.empty(4, 3, 16, 16, device="meta"),
              torch.empty(4, dtype=torch.long, device="meta"))
    captured = capture(model, lambda m, x, y: F.cross_entropy(m(x), y), *inputs,
                       hardware=H100, autocast=torch.bfloat16)
    calls = _calls(captured.graph_module)
    convolutions = [node for node in calls if _name(node) == "convolution"]
    assert len(convolutions) == 2 and {_values(n)[0].dtype for n in convolutions} == {
        torch.bfloat16}
    # batch norm is on no CUDA autocast list: it takes the convolution's bf16 output as it is
    norms = [node for node in calls if "batch_norm" in _name(node) and "backward" not in
             _name(node)]
    assert norms and {_values(n)[0].dtype for n in norms} == {torch.bfloat16}
    losses = [node for node in calls if _name(node) in ("_log_softmax", "nll_loss_forward")]
    assert losses and {_values(n)[0].dtype for n in losses} == {torch.float32}


def test_a_cpu_capture_is_unchanged():
    example = examples.gpt2(layers=1, width=32, heads=2, sequence=16, batch_size=2)
    inputs = _meta_inputs(example)

    def op_list(**target):
        return [(str(n.target), [tuple(v.shape) for v in _values(n)])
                for n in _calls(capture(example.model, example.loss_fn, *inputs,
                                        **target).graph_module)]

    plain = op_list()
    assert op_list(hardware=get_hardware("cpu")) == plain
    assert any("attention" in target or "bmm" in target for target, _ in plain)
    assert op_list(hardware=H100) != plain  # a CUDA profile's capture does differ


def test_cpu_profile_autocast_is_torch_autocast_on_the_cpu():
    """For the CPU profile ``autocast=`` is ``torch.autocast("cpu")`` itself: its matmuls run in
    bf16, its attention is the CPU's kernel, not CUDA's."""
    example = examples.gpt2(layers=1, width=32, heads=2, sequence=16, batch_size=2, dropout=0.0)
    captured = capture(example.model, example.loss_fn, *_meta_inputs(example),
                       hardware=get_hardware("cpu"), autocast=torch.bfloat16)
    calls = _calls(captured.graph_module)
    matmuls = [node for node in calls if _name(node) in ("mm", "addmm")]
    assert matmuls and {_values(node)[0].dtype for node in matmuls} == {torch.bfloat16}
    attention = {_name(node) for node in calls if "attention" in _name(node)}
    assert attention == {"_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_flash_attention_for_cpu_backward"}


def test_autocast_takes_only_lower_precision_floats():
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        retargeted(H100, torch.device("cpu"), torch.float64)
    model = _Attention(8, masked=False)
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):  # before any tracing
        memfit.plan(model, lambda m, x: m(x).sum(), torch.empty(2, 4, 8, device="meta"),
                    hardware="h100-sxm", autocast=torch.float32)


def test_a_plan_may_rerun_the_flash_kernel_with_its_dropout():
    """The flash kernel draws its dropout (its RNG state is an output): a plan that re-runs it
    is made (the replayed state is memfit's rng ops, as for native_dropout), and it is cheaper
    than keeping everything."""
    example = examples.gpt2(layers=4, width=64, heads=4, vocab=64, sequence=256, batch_size=16)
    plan = memfit.plan(example.model, example.loss_fn, *_meta_inputs(example), budget=0.4,
                       hardware=H100, autocast=torch.bfloat16, strategy="optimal-recompute")
    rebuilt = [*plan.recomputed, *(rerun.op for rerun in plan.reruns)]
    assert any(name.startswith("_scaled_dot_product_flash_attention") for name in rebuilt)
    assert plan.explanation is not None and plan.explanation.peak_bytes <= plan.budget_bytes
