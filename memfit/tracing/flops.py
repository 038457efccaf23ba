"""FLOPs of a captured op: torch's FLOP counter registry, completed for the ops it misses.

``torch.utils.flop_counter`` counts matmuls, convolutions and the CUDA attention kernels, but
not the kernels a CPU capture records (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, oneDNN's ``mkldnn_rnn_layer``), cuDNN's RNN, nor a few matmul and convolution
variants. Importing this module registers formulas for those in torch's own registry
(``register_flop_formula``), only where torch has none, so ``FlopCounterMode`` counts them too
and a later torch that adds its own keeps it. ``memfit.data.op_classes`` lists every compute op;
a test fails on any of them counted at zero.

Conventions follow torch's (a multiply-add is 2 FLOPs, a backward counts the gradients of both
operands) except for causal attention: ``node_flops`` counts the scores a causal kernel
computes, about half of torch's full S x S count (``causal_share``).
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

from memfit.data.op_classes import op_class

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
    """FLOPs of a captured ``call_function`` node (0 for an op no formula counts): torch's
    count, times ``causal_share`` for a causal attention kernel.

    A formula that cannot read the node's arguments counts 0 with a warning naming the op: the
    plan is still right, only that op's time is too short.
    """
    packet = getattr(node.target, "overloadpacket", node.target)
    counter = flop_registry.get(packet)
    if counter is None:
        return 0.0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        flops = float(counter(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception as error:  # noqa: BLE001 - a counter's bug must not stop planning
        warnings.warn(f"memfit counts 0 FLOPs for {node.name} ({node.target}): its FLOP "
                      f"formula failed ({type(error).__name__}: {error}), so its time is only "
                      "its memory traffic", stacklevel=2)
        return 0.0
    return flops * causal_share(node)


def causal_share(node: torch.fx.Node) -> float:
    """The share of the S x S scores a causal attention kernel computes; 1 for any other op.

    torch's counter counts every score; the flash and memory-efficient kernels (CUDA's and the
    CPU's) skip the blocks a causal mask hides, about half of them, and the published kernel
    efficiencies (FlashAttention-2 and 3) are quoted against that halved count. The share
    counts the unmasked scores, the mask aligned to the top left as PyTorch's ``is_causal``.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None or op_class(schema.name.replace("::", ".")) != "attention":
        return 1.0
    values = {argument.name: _argument(node, index, argument)
              for index, argument in enumerate(schema.arguments)}
    if not values.get("is_causal") and not values.get("custom_mask_type"):
        return 1.0
    query, key = values.get("query"), values.get("key")
    if not isinstance(query, torch.fx.Node) or not isinstance(key, torch.fx.Node):
        return 1.0
    # (batch, heads, sequence, dim) for the _scaled_dot_product_* ops, (batch, sequence,
    # heads, dim) for the raw _flash_/_efficient_attention_* kernels
    axis = -2 if schema.name.startswith("aten::_scaled_dot_product") else 1
    queries, keys = query.meta["val"].shape[axis], key.meta["val"].shape[axis]
    diagonal = min(queries, keys)
    unmasked = diagonal * (diagonal + 1) // 2 + (queries - diagonal) * keys
    return unmasked / (queries * keys)


def _argument(node: torch.fx.Node, index: int, argument) -> object:
    """A schema argument's value at ``node``: keyword, positional, else its default."""
    if argument.name in node.kwargs:
        return node.kwargs[argument.name]
    if index < len(node.args) and not argument.kwarg_only:
        return node.args[index]
    return argument.default_value if argument.has_default_value() else None
