"""Bytes a kernel allocates and frees inside one op, beyond the outputs it returns.

A dispatch-level view of a graph (fake tensors, the CPU dispatch tracker) sees each op's outputs
only; the allocator also sees the buffers a kernel makes for itself and frees before it returns.
Most kernels make none. The CPU kernels of dropout do, and a training step's peak often sits on
them: multiplying by the bool mask casts the mask to the values' dtype first (a buffer as large as
the output), and ``native_dropout_backward`` computes ``grad * mask`` and then multiplies that by
the scale (a second output-sized buffer, plus the scale wrapped as a 0-dim double and cast).
On CUDA both ops are single fused kernels with no temporaries.

``analyze(..., kernel_temporaries=True)`` adds these bytes to each op as a storage nobody reads,
so every memory profile counts them while the op runs and frees them right after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

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


_CPU_TEMPORARIES: dict[object, Callable[[torch.Tensor, int], int]] = {
    torch.ops.aten.native_dropout.default: _dropout_forward,
    torch.ops.aten.native_dropout_backward.default: _dropout_backward,
}


def kernel_temporary_bytes(node: fx.Node) -> int:
    """The bytes ``node``'s kernel holds for itself at its high-water mark, beyond its outputs
    (0 for a kernel not known to make any)."""
    rule = _CPU_TEMPORARIES.get(node.target)
    value = node.meta.get("val")
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    if rule is None or not isinstance(first, torch.Tensor) or first.device.type != "cpu":
        return 0
    return rule(first, first.untyped_storage().nbytes())
