"""FLOPs of a captured op: torch's FLOP counter registry, completed for the ops it misses.

``torch.utils.flop_counter`` counts matmuls, convolutions and the CUDA attention kernels, but
not the kernels a CPU capture records (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, oneDNN's ``mkldnn_rnn_layer``), cuDNN's RNN, nor a few matmul and convolution
variants. Importing this module registers formulas for those in torch's own registry
(``register_flop_formula``), only where torch has none, so ``FlopCounterMode`` counts them too
and a later torch that adds its own keeps it. ``memfit.core.op_classes`` lists every compute op;
a test fails on any of them counted at zero.

Conventions follow torch's: a multiply-add is 2 FLOPs, attention counts the full S x S score
matrix whether causal or not, and a backward counts the gradients of both operands.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from math import prod

import torch
from torch.utils.flop_counter import (
    conv_flop_count,
    flop_registry,
    mm_flop,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten
Shape = Sequence[int]


def _register(targets: list, get_raw: bool = False):
    """``register_flop_formula`` for the targets torch does not count yet."""
    missing = [target for target in targets if target not in flop_registry]

    def register(formula):
        if missing:
            register_flop_formula(missing, get_raw=get_raw)(formula)
        return formula

    return register


@_register([aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_fused_attention_overrideable])
def _attention_flops(query: Shape, key: Shape, value: Shape, *args, out_shape=None,
                     **kwargs) -> int:
    """The two matmuls of ``softmax(Q K^T) V``, as torch counts the CUDA kernels."""
    return sdpa_flop_count(query, key, value)


@_register([aten._scaled_dot_product_flash_attention_for_cpu_backward,
            aten._scaled_dot_product_fused_attention_overrideable_backward])
def _attention_backward_flops(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args,
                              out_shape=None, **kwargs) -> int:
    """The scores recomputed, then the gradients of both matmuls (five matmuls in all)."""
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _recurrent_flops(input_: Shape, matrices: Sequence[Shape]) -> int:
    """Every time step of every sequence multiplies its input and its hidden state by the gate
    weights: 2 FLOPs per weight per step per sequence (the gates' elementwise math is small)."""
    steps_times_batch = prod(input_[:-1])
    return 2 * steps_times_batch * sum(prod(shape) for shape in matrices if len(shape) == 2)


@_register([aten.mkldnn_rnn_layer])
def _rnn_layer_flops(input_: Shape, weight_ih: Shape, weight_hh: Shape, *args, out_shape=None,
                     **kwargs) -> int:
    """oneDNN's one-layer, one-direction RNN: the input and hidden projections at every step."""
    return _recurrent_flops(input_, (weight_ih, weight_hh))


@_register([aten.mkldnn_rnn_layer_backward])
def _rnn_layer_backward_flops(input_: Shape, weight_ih: Shape, weight_hh: Shape, *args,
                              out_shape=None, **kwargs) -> int:
    """Twice the forward: each projection's input gradient and weight gradient."""
    return 2 * _recurrent_flops(input_, (weight_ih, weight_hh))


@_register([aten._cudnn_rnn])
def _cudnn_rnn_flops(input_: Shape, weights: Sequence[Shape], *args, out_shape=None,
                     **kwargs) -> int:
    """cuDNN's whole multi-layer RNN: every layer's (and direction's) weight matrices, each
    applied at every step (a layer's input width is in its ``weight_ih``)."""
    return _recurrent_flops(input_, weights)


@_register([aten._cudnn_rnn_backward])
def _cudnn_rnn_backward_flops(input_: Shape, weights: Sequence[Shape], *args, out_shape=None,
                              **kwargs) -> int:
    return 2 * _recurrent_flops(input_, weights)


@_register([aten.addbmm])
def _addbmm_flops(self_: Shape, batch1: Shape, batch2: Shape, *args, out_shape=None,
                  **kwargs) -> int:
    return batch1[0] * mm_flop(batch1[1:], batch2[1:])


@_register([aten._addmm_activation])
def _addmm_activation_flops(self_: Shape, mat1: Shape, mat2: Shape, *args, out_shape=None,
                            **kwargs) -> int:
    return mm_flop(mat1, mat2)


@_register([aten._int_mm])
def _int_mm_flops(mat1: Shape, mat2: Shape, *args, out_shape=None, **kwargs) -> int:
    return mm_flop(mat1, mat2)


@_register([aten.mv, aten.dot])
def _vector_product_flops(left: Shape, right: Shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * prod(left)


@_register([aten.addmv])
def _addmv_flops(self_: Shape, matrix: Shape, vector: Shape, *args, out_shape=None,
                 **kwargs) -> int:
    return 2 * prod(matrix)


@_register([aten.mkldnn_convolution, aten.slow_conv3d_forward])
def _convolution_flops(input_: Shape, weight: Shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_, weight, out_shape, transposed=False)


@_register([aten.cudnn_convolution_transpose, aten.slow_conv_transpose2d,
            aten.slow_conv_transpose3d])
def _transposed_convolution_flops(input_: Shape, weight: Shape, *args, out_shape=None,
                                  **kwargs) -> int:
    return conv_flop_count(input_, weight, out_shape, transposed=True)


def node_flops(node: torch.fx.Node) -> float:
    """FLOPs of a captured ``call_function`` node (0 for an op no formula counts).

    A formula that cannot read the node's arguments counts 0 with a warning naming the op: the
    plan is still right, only that op's time is too short.
    """
    packet = getattr(node.target, "overloadpacket", node.target)
    counter = flop_registry.get(packet)
    if counter is None:
        return 0.0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return float(counter(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception as error:  # noqa: BLE001 - a counter's bug must not stop planning
        warnings.warn(f"memfit counts 0 FLOPs for {node.name} ({node.target}): its FLOP "
                      f"formula failed ({type(error).__name__}: {error}), so its time is only "
                      "its memory traffic", stacklevel=2)
        return 0.0
