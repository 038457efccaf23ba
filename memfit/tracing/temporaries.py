"""Bytes a kernel allocates and frees inside one op, beyond the outputs it returns.

A dispatch-level view of a graph (fake tensors, the CPU dispatch tracker) sees each op's outputs
only; the allocator also sees the buffers a kernel makes for itself and frees before it returns.
Most kernels make none. The CPU kernels of dropout do, and a training step's peak often sits on
them: multiplying by the bool mask casts the mask to the values' dtype first (a buffer as large as
the output), and ``native_dropout_backward`` computes ``grad * mask`` and then multiplies that by
the scale (a second output-sized buffer, plus the scale wrapped as a 0-dim double and cast).
On CUDA both ops are single fused kernels with no temporaries.

Convolutions on the CPU go through oneDNN (mkldnn), which computes in channel-blocked layouts:
the input, weight and output are reordered into copies whose channels are rounded up to the
vector width (8 floats on AVX2), the result is reordered back into the plain output, and the
copies are freed. Batch-norm keeps two per-channel buffers beside its outputs in the forward and
an input-sized one in the backward. The rules below hold where ``test_temporaries`` checks them
against the allocator (torch 2.13, AVX2; ``bench/kernel_survey.py`` runs every op of a captured
graph alone under the allocator).

Under inductor's layout optimization (``GraphLowering.decide_layout_opt``) every 2D convolution
reads its input and weight channels last, and the values made from them are laid out so: a
convolution and its backward then read their activations channels last, oneDNN computes in that
layout and makes none of the blocked copies above, so those convolutions are measured in that
layout (``inductor_channels_last``).

Convolutions the rules are not exact for are measured instead (``kernel_probe.py``: the op run
once at its exact shapes in a child process): transposed convolutions, 3D backward, bias
gradients, strided data gradients, ATen's slow (non-oneDNN) paths. Their scratch follows oneDNN's
choice of implementation, its cache-sized blocking and the thread count, not a formula in the
shapes (it changes with the thread count, and not with the batch), so no rule is written for them.

Attention on the CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what
SDPA runs without dropout) works in query blocks of 32, 64 or 256 rows (by the query length) and
key blocks of up to 512, with one scratch block per thread: the forward holds the block's scores,
row maxima, row sums and output rows, the backward its probabilities and their gradient, a row
sum per thread and a contiguous copy of a transposed output gradient (float32 and float64; half
types are measured). A recomputing plan runs the forward again inside the backward, so its
scratch can be the whole of what a peak adds there.

``analyze(..., kernel_temporaries=True)`` adds these bytes to each op as a storage nobody reads,
so every memory profile counts them while the op runs and frees them right after. It also counts
an output at the storage its kernel really returns where that is larger than the fake value's
(``kernel_output_storage_bytes``: reduced losses on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable

import torch
import torch.fx as fx

from memfit.tracing.kernel_probe import measured_temporary_bytes
from memfit.tracing.rnn import RNN_TEMPORARIES

_WRAPPED_SCALAR_BYTES = 8  # a Python float becomes a 0-dim float64 tensor


def _scalar_bytes(dtype: torch.dtype) -> int:
    """The wrapped Python scalar, plus its cast to ``dtype`` when that is not float64."""
    cast = 0 if dtype == torch.float64 else torch.empty((), dtype=dtype).element_size()
    return _WRAPPED_SCALAR_BYTES + cast


def _dropout_forward(values: torch.Tensor, output_bytes: int) -> int:
    """``input * mask`` casts the bool mask to the input's dtype; ``mul_(scale)`` then wraps the
    scale (after the cast mask is freed)."""
    return max(output_bytes, _scalar_bytes(values.dtype))


def _dropout_backward(values: torch.Tensor, output_bytes: int) -> int:
    """``grad * mask`` (the cast mask freed after it), then that product times the wrapped scale
    into the output: the product and the scale are alive beside the output."""
    return output_bytes + _scalar_bytes(values.dtype)


def _dropout_rule(rule: Callable[[torch.Tensor, int], int]) -> Callable[[fx.Node], int]:
    def node_rule(node: fx.Node) -> int:
        first = _values(node)[0]
        return rule(first, first.untyped_storage().nbytes())

    return node_rule


def _values(node: fx.Node) -> list:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _argument(node: fx.Node, name: str):
    """The argument called ``name`` in the op's schema (a node's fake value for a node; the
    schema's default where the call leaves it out)."""
    assert isinstance(node.target, torch._ops.OpOverload)
    schema = node.target._schema.arguments
    index = [argument.name for argument in schema].index(name)
    if index < len(node.args):
        argument = node.args[index]
    else:  # given by name, or left at the schema's default
        argument = node.kwargs.get(name, schema[index].default_value)
    return argument.meta.get("val") if isinstance(argument, fx.Node) else argument


def _block_channels() -> int:
    """oneDNN's channel block: the floats in one vector register (measured on AVX2 only)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def _blocked_bytes(tensor: torch.Tensor, channel_dims: tuple[int, ...]) -> int:
    """``tensor``'s bytes with the sizes of ``channel_dims`` rounded up to the channel block."""
    block = _block_channels()
    sizes = [-(-size // block) * block if dim in channel_dims else size
             for dim, size in enumerate(tensor.shape)]
    return math.prod(sizes) * tensor.element_size()


def _uses_mkldnn(node: fx.Node, values: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ATen sends this convolution to oneDNN in the cases the rules below were measured on
    (float32, not transposed, one group), following ATen's own test of batch size, the last two
    kernel sizes and threads."""
    stride, dilation = _argument(node, "stride"), _argument(node, "dilation")
    transposed, groups = _argument(node, "transposed"), _argument(node, "groups")
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if values.dtype != torch.float32 or transposed or groups != 1:
        return False
    one_by_one = weight.shape[-1] == 1 and weight.shape[-2] == 1
    plain = all(s == 1 for s in stride) and all(d == 1 for d in dilation)
    if one_by_one and plain and values.shape[0] < 16 and torch.get_num_threads() == 1:
        return False
    large_kernel = weight.shape[-1] > 3 and weight.shape[-2] > 3
    return large_kernel or values.shape[0] > 1 or math.prod(values.shape[:4]) > 20480


def _forward_rule_is_exact(node: fx.Node) -> bool:
    """oneDNN's plain (not transposed, one group) float32 forward, 2D and 3D, at stride 1: exact
    on AVX2, and on AVX-512 for kernels wider than 1x1. Strided 1x1 forwards hold a few KiB more
    than the rule, and on AVX-512 oneDNN's 1x1 kernels hold more at stride 1 too, so those are
    measured (``kernel_probe``)."""
    weight = _argument(node, "weight")
    one_by_one = all(size == 1 for size in weight.shape[2:])
    measured_here = torch.backends.cpu.get_cpu_capability() == "AVX2" or not one_by_one
    return (_uses_mkldnn(node, _argument(node, "input"), weight) and measured_here
            and all(s == 1 for s in _argument(node, "stride")))


def _backward_rule_is_exact(node: fx.Node) -> bool:
    """Never: the rule below is an estimate, and every backward is measured (``kernel_probe``).
    It is exact on 2D, stride-1 convolutions from a full channel block without a bias gradient,
    but at small spatial sizes oneDNN holds several times more, and a plan that trusted the rule
    there would run over its budget."""
    del node
    return False


def _convolution_forward(node: fx.Node) -> int:
    """oneDNN reorders the input (when it has a full channel block; narrower inputs are read as
    they are) and the weight, computes into a blocked output, frees both copies, then reorders
    the blocked output into the plain one."""
    values, weight, output = _argument(node, "input"), _argument(node, "weight"), _values(node)[0]
    wide = values.shape[1] >= _block_channels()
    blocked_input = _blocked_bytes(values, (1,)) if wide else 0
    blocked_weight = _blocked_bytes(weight, (0, 1) if wide else (0,))
    blocked_output = _blocked_bytes(output, (1,))
    bias = _argument(node, "bias")
    if bias is not None and bias.shape[0] % _block_channels():  # a padded copy, 128 bytes over
        blocked_input += _blocked_bytes(bias, (0,)) + 128
    output_bytes = output.untyped_storage().nbytes()
    peak = max(blocked_input + blocked_weight + blocked_output, blocked_output + output_bytes)
    return peak - output_bytes


def _convolution_backward(node: fx.Node) -> int:
    """The input gradient first (blocked grad-output, weight and grad-input copies, then the
    reorder into the plain result), then the weight gradient beside it (blocked grad-output,
    input and weight-gradient copies, then the reorder); every channel count is blocked."""
    values, weight = _argument(node, "input"), _argument(node, "weight")
    gradient, mask = _argument(node, "grad_output"), _argument(node, "output_mask")
    results = _values(node)
    grad_input = results[0].untyped_storage().nbytes() if mask[0] else 0
    blocked_gradient = _blocked_bytes(gradient, (1,))
    blocked_weight = _blocked_bytes(weight, (0, 1))
    peak = 0
    if mask[0]:
        blocked_grad_input = _blocked_bytes(values, (1,))
        peak = max(blocked_gradient + blocked_weight + blocked_grad_input,
                   blocked_grad_input + grad_input)
    if mask[1]:
        grad_weight = results[1].untyped_storage().nbytes()
        peak = max(peak, grad_input + blocked_gradient + _blocked_bytes(values, (1,))
                   + blocked_weight, grad_input + blocked_weight + grad_weight)
    outputs = sum(r.untyped_storage().nbytes() for r, wanted in zip(results, mask, strict=True)
                  if wanted and isinstance(r, torch.Tensor))
    return max(0, peak - outputs)


def _batch_norm_forward(node: fx.Node) -> int:
    """Training mode: two per-channel buffers (the batch's mean and variance) beside the outputs."""
    values, training = _argument(node, "input"), _argument(node, "training")
    return 2 * values.shape[1] * values.element_size() if training else 0


def _batch_norm_backward(node: fx.Node) -> int:
    """Training mode: one buffer the size of the input beside the gradients."""
    values, training = _argument(node, "input"), _argument(node, "train")
    return values.untyped_storage().nbytes() if training else 0


def _embedding_backward(node: fx.Node) -> int:
    """A strided output gradient (an LSTM's, transposed to batch-first) is copied contiguous."""
    gradient = _argument(node, "grad_output")
    return 0 if gradient.is_contiguous() else gradient.numel() * gradient.element_size()


def _attention_blocks(query_length: int, key_length: int) -> tuple[int, int]:
    """The query and key block lengths of ATen's CPU flash attention: query blocks of 256 rows
    from 768 queries on, of 64 from 192, else of 32; key blocks of 512; neither longer than the
    sequence."""
    query_block = 256 if query_length >= 768 else 64 if query_length >= 192 else 32
    return min(query_block, query_length), min(512, key_length)


def _accumulate_size(dtype: torch.dtype) -> int:
    """Bytes of an element of the kernel's accumulation type (float32 for half types)."""
    return 4 if dtype in (torch.float16, torch.bfloat16) else torch.empty((), dtype=dtype).element_size()


def _flash_attention_forward(node: fx.Node) -> int:
    """Per thread: a query block's scores against a key block, its row maxima and sums and its
    output rows, in the accumulation type (half types: an estimate, see
    ``_flash_attention_rule_is_exact``)."""
    query, key = _argument(node, "query"), _argument(node, "key")
    query_block, key_block = _attention_blocks(query.shape[2], key.shape[2])
    per_thread = (query_block * key_block + 2 * query_block
                  + query_block * query.shape[3]) * _accumulate_size(query.dtype)
    if query.dtype in (torch.float16, torch.bfloat16):
        per_thread += query_block * key_block * query.element_size()
    return torch.get_num_threads() * per_thread


def _flash_attention_backward(node: fx.Node) -> int:
    """Per thread: a block's probabilities and their gradient and a row sum of the query block;
    before them, a contiguous copy of the output gradient where the kernel's (batch, query,
    head) view of it is not contiguous (half types: an estimate).

    Note:
        Each OpenMP thread allocates its own row sum; the profiler's allocator events show the
        calling thread's only, so at two threads the allocator is seen to hold one row sum
        (a float per query row) less than this rule counts, and than the process holds."""
    query, key = _argument(node, "query"), _argument(node, "key")
    gradient = _argument(node, "grad_out")
    query_block, key_block = _attention_blocks(query.shape[2], key.shape[2])
    accumulate = _accumulate_size(query.dtype)
    per_thread = (2 * query_block * key_block + query_block) * accumulate
    if query.dtype in (torch.float16, torch.bfloat16):
        per_thread += 2 * query_block * key_block * query.element_size()
    copied = 0 if _contiguous_with_swapped(gradient, 1, 2) else (
        gradient.numel() * gradient.element_size())
    return copied + torch.get_num_threads() * per_thread


def _contiguous_with_swapped(value: torch.Tensor, first: int, second: int) -> bool:
    """Whether ``value.transpose(first, second)`` is contiguous, read off its sizes and strides
    (no op runs: a fake value may belong to another fake mode than the one active)."""
    sizes, strides = list(value.shape), list(value.stride())
    sizes[first], sizes[second] = sizes[second], sizes[first]
    strides[first], strides[second] = strides[second], strides[first]
    if any(size == 0 for size in sizes):
        return True
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _flash_attention_rule_is_exact(node: fx.Node) -> bool:
    """float32 and float64, exact (``test_temporaries``). Half types are measured: their kernels
    block and pack differently and hold several times what the blocks above count."""
    return _argument(node, "query").dtype in (torch.float32, torch.float64)


aten = torch.ops.aten
_CPU_TEMPORARIES: dict[object, Callable[[fx.Node], int]] = {
    aten.native_dropout.default: _dropout_rule(_dropout_forward),
    aten.native_dropout_backward.default: _dropout_rule(_dropout_backward),
    aten.convolution.default: _convolution_forward,
    aten.convolution_backward.default: _convolution_backward,
    aten.native_batch_norm.default: _batch_norm_forward,
    aten._native_batch_norm_legit.default: _batch_norm_forward,
    aten._native_batch_norm_legit.no_stats: _batch_norm_forward,
    aten._native_batch_norm_legit_functional.default: _batch_norm_forward,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_attention_backward,
    **RNN_TEMPORARIES,  # oneDNN's LSTM layer and its backward (memfit.tracing.rnn)
}
# where the rule above is exact; elsewhere the kernel is measured (kernel_probe.py)
_EXACT_WHERE: dict[object, Callable[[fx.Node], bool]] = {
    aten.convolution.default: _forward_rule_is_exact,
    aten.convolution_backward.default: _backward_rule_is_exact,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_rule_is_exact,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        _flash_attention_rule_is_exact,
}


_REDUCED_LOSSES = (aten.mse_loss.default, aten.smooth_l1_loss.default,
                   aten.binary_cross_entropy.default)


def kernel_output_storage_bytes(node: fx.Node) -> int | None:
    """The bytes of the storage under ``node``'s output where the CPU kernel returns a view into a
    larger buffer than its fake value shows, else ``None``.

    A reduced ``mse_loss``, ``smooth_l1_loss`` or ``binary_cross_entropy`` on the CPU computes the
    elementwise loss into a buffer of the broadcast inputs' size and returns the reduced loss as a
    0-dim tensor on that buffer, so the whole buffer lives as long as the loss (where the fake
    value's storage is one element).
    """
    if node.target not in _REDUCED_LOSSES or not _on_cpu(node):
        return None
    values, target = _argument(node, "self"), _argument(node, "target")
    if _argument(node, "reduction") == 0:  # "none": the buffer is the output itself
        return None
    shape = torch.broadcast_shapes(values.shape, target.shape)
    return math.prod(shape) * values.element_size()


def kernel_temporary_bytes(node: fx.Node) -> int:
    """The bytes ``node``'s kernel holds for itself at its high-water mark, beyond its outputs
    (0 for a kernel not known to make any)."""
    return kernel_temporary_bytes_of([node]).get(node, 0)


def kernel_temporary_bytes_of(nodes: Iterable[fx.Node], channels_last: Collection[fx.Node] = ()
                              ) -> dict[fx.Node, int]:
    """``kernel_temporary_bytes`` of each node that has any, the kernels no rule is exact for
    measured together (one child process for all new signatures). The nodes in
    ``channels_last`` (``inductor_channels_last``) run on channels-last activations, which no
    rule describes: they are measured so.

    A kernel whose measurement fails (a warning says so) gets its rule's estimate.
    """
    ruled = [node for node in nodes if _on_cpu(node) and node.target in _CPU_TEMPORARIES]
    unruled = [node for node in ruled if node in channels_last or (
        node.target in _EXACT_WHERE and not _EXACT_WHERE[node.target](node))]
    measured = measured_temporary_bytes(unruled, channels_last) if unruled else {}
    found = {node: measured[node] if node in measured else _CPU_TEMPORARIES[node.target](node)
             for node in ruled}
    return {node: size for node, size in found.items() if size}


def inductor_channels_last(module: fx.GraphModule) -> frozenset[fx.Node]:
    """The 2D convolutions and convolution backwards of ``module`` that inductor runs on
    channels-last activations (see the module note): all of them where its layout optimization
    is on for ``module``, decided as inductor decides it."""
    from torch._inductor.graph import GraphLowering

    convolutions = [node for node in module.graph.nodes if node.op == "call_function"
                    and node.target in (aten.convolution.default,
                                        aten.convolution_backward.default)
                    and _values(node) and _argument(node, "weight").dim() == 4]
    if not convolutions or not GraphLowering.decide_layout_opt(module, is_inference=False):
        return frozenset()
    return frozenset(convolutions)


def _on_cpu(node: fx.Node) -> bool:
    first = next((value for value in _values(node) if isinstance(value, torch.Tensor)), None)
    return first is not None and first.device.type == "cpu"
