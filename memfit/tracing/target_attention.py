"""``F.scaled_dot_product_attention`` as CUDA runs it, traced on CPU tensors (for a CUDA profile).

CUDA picks one kernel per call (``select_sdp_backend`` in PyTorch's
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``; the calls in ``attention.cpp``), and the
kernel decides what the step keeps: flash and memory-efficient attention save the output, a
float32 logsumexp and the dropout RNG state, never the S x S scores the math path stores. This
module applies those rules for an sm80/sm90 GPU (A100, H100, H200, GH200) with every backend
enabled, in PyTorch's default order, and calls that kernel's aten op, whose meta kernel gives the
sizes and whose backward autograd records:

1. **flash** (``_scaled_dot_product_flash_attention``): float16 or bfloat16; no ``attn_mask``;
   query, key and value of one head dim, at most 256 (padded to a multiple of 8 before the call,
   the output sliced back, as ``attention.cpp`` does); ``is_causal`` only with as many queries
   as keys; dense 4-D inputs whose last dim has stride 1; one batch size, and as many key/value
   heads as query heads.
2. **memory-efficient** (``_scaled_dot_product_efficient_attention``): float32, float16 or
   bfloat16; an ``attn_mask`` allowed (a boolean one becomes an additive bias of the query's
   dtype, then is expanded to (batch, heads, queries, keys) and its last dim padded to a multiple
   of 16, as ``preprocess_mask`` does); query and key of one head dim; the query's and the
   value's head dims divisible by 4 (float32) or 8 (16-bit), the tensor-core GEMM alignment of
   sm80+, with no upper limit; last dim of stride 1; the same batch and head rules.
3. **math** (``_scaled_dot_product_attention_math``) otherwise, in float32 for 16-bit inputs
   (PyTorch's default ``allow_fp16_bf16_reduction_math_sdp(False)`` upcasts them), its result
   cast back.

Dropout runs inside the flash and memory-efficient kernels (their RNG state is an output). Not
modelled: cuDNN attention, which the newest PyTorch tries first on sm90/sm100 with cuDNN newer
than 9.15; it saves the same kinds of tensors as flash (output, float32 logsumexp, RNG state), so
the plan's bytes are flash's. Grouped-query calls (``enable_gqa`` with fewer key/value heads)
take the math path here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8  # attention.cpp pads q, k, v to it before the flash kernel
BIAS_MULTIPLE = 16  # preprocess_mask pads the bias's last dim to it for the efficient kernel
LOW_PRECISION = (torch.float16, torch.bfloat16)


def cuda_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through the kernel CUDA would pick (module docstring)."""
    kernel = cuda_kernel(query, key, value, attn_mask, is_causal)
    if kernel == "flash":
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if kernel == "efficient":
        return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def cuda_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None, is_causal: bool) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the first kernel whose rules the call meets."""
    if not _dense_rules(query, key, value):
        return "math"
    if _flash_rules(query, key, value, attn_mask, is_causal):
        return "flash"
    if _efficient_rules(query, key, value):
        return "efficient"
    return "math"


def _dense_rules(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """What both fused kernels need: 4-D inputs, one batch size, as many heads, no empty
    sequence, one dtype."""
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors) or len({t.dtype for t in tensors}) != 1:
        return False
    same_batch_heads = all(tuple(t.shape[:2]) == tuple(query.shape[:2]) for t in tensors)
    return same_batch_heads and all(t.shape[2] > 0 for t in tensors)  # sizes may be symbolic


def _last_stride_one(tensors: tuple[torch.Tensor, ...], ignore_singleton: bool) -> bool:
    return all(t.stride(-1) == 1 or (ignore_singleton and t.shape[-1] == 1) for t in tensors)


def _flash_rules(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None, is_causal: bool) -> bool:
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    return (attn_mask is None and query.dtype in LOW_PRECISION and len(head_dims) == 1
            and query.shape[-1] <= FLASH_MAX_HEAD_DIM
            and (not is_causal or query.shape[-2] == key.shape[-2])
            and _last_stride_one((query, key, value), ignore_singleton=True))


def _efficient_rules(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    alignment = 8 if query.dtype in LOW_PRECISION else 4
    return (query.dtype in (torch.float32, *LOW_PRECISION)
            and query.shape[-1] == key.shape[-1]
            and query.shape[-1] % alignment == 0 and value.shape[-1] % alignment == 0
            and _last_stride_one((query, key, value), ignore_singleton=False))


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
           is_causal: bool, scale: float | None) -> torch.Tensor:
    head_dim = query.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale  # of the unpadded head dim
    padding = -head_dim % FLASH_HEAD_DIM_MULTIPLE
    if padding:
        query, key, value = (F.pad(t, (0, padding)) for t in (query, key, value))
    output = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                      scale=scale)[0]
    return output[..., :head_dim] if padding else output


def _efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
               scale: float | None) -> torch.Tensor:
    bias = None if attn_mask is None else _bias(attn_mask, query, key)
    needs_logsumexp = any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, needs_logsumexp,
                                                        dropout_p, is_causal, scale=scale)[0]


def _bias(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask as the efficient kernel takes it: additive, of the query's dtype, (B, H, Sq, Sk),
    its last dim's storage padded to a multiple of 16."""
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device
                                ).masked_fill(attn_mask.logical_not(), -math.inf)
    keys = key.shape[-2]
    padding = -attn_mask.shape[-1] % BIAS_MULTIPLE
    if padding:
        attn_mask = F.pad(attn_mask, (0, padding))[..., :keys]
    return attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], keys)


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
          scale: float | None, enable_gqa: bool) -> torch.Tensor:
    dtype = query.dtype
    if dtype in LOW_PRECISION:
        query, key, value = (t.to(torch.float32) for t in (query, key, value))
    output = aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p,
                                                     is_causal, None, scale=scale,
                                                     enable_gqa=enable_gqa)[0]
    return output.to(dtype)
