"""Op classes: which ops are arithmetic the cost model prices by FLOPs, and which only move bytes.

The one list of compute ops. ``op_class("aten.mm")`` is ``"matmul"``; an op in no compute class
is ``"memory"`` (elementwise, reductions, norms, copies, views), priced by the bytes it moves.
``Hardware.op_time_s`` picks the peak and the efficiency by class, and a test captures real
models and fails on any op of a compute class whose FLOP count is zero.

Names are op kinds as ``CostGraph`` spells them (``Op.kind``): the ATen schema name with a dot
(``"aten.convolution_backward"``), or the name of a higher-order op (``"flex_attention"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

MATMUL = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm", "aten._addmm_activation",
    "aten.mv", "aten.addmv", "aten.dot", "aten._scaled_mm", "aten._int_mm",
})
CONVOLUTION = frozenset({
    "aten.convolution", "aten._convolution", "aten.convolution_overrideable",
    "aten.convolution_backward", "aten.cudnn_convolution", "aten.cudnn_convolution_transpose",
    "aten.mkldnn_convolution", "aten._slow_conv2d_forward", "aten.slow_conv3d_forward",
    "aten.slow_conv_transpose2d", "aten.slow_conv_transpose3d",
})
ATTENTION = frozenset({
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_efficient_attention_backward",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._scaled_dot_product_fused_attention_overrideable_backward",
    "aten._flash_attention_forward", "aten._flash_attention_backward",
    "aten._efficient_attention_forward", "aten._efficient_attention_backward",
    "flex_attention", "flex_attention_backward",
})
RNN = frozenset({
    "aten.mkldnn_rnn_layer", "aten.mkldnn_rnn_layer_backward",
    "aten._cudnn_rnn", "aten._cudnn_rnn_backward",
})

# class name -> the op kinds in it; every kind here must get a FLOP count from the capture
COMPUTE_CLASSES: Mapping[str, frozenset[str]] = MappingProxyType({
    "matmul": MATMUL, "convolution": CONVOLUTION, "attention": ATTENTION, "rnn": RNN,
})
MEMORY = "memory"
_CLASS_OF = {kind: name for name, kinds in COMPUTE_CLASSES.items() for kind in kinds}


def op_class(kind: str) -> str:
    """The class of an op kind: a key of ``COMPUTE_CLASSES``, else ``"memory"``."""
    return _CLASS_OF.get(kind, MEMORY)
