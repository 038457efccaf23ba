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
    "aten.mm", "aten.addmm", "aten.addbmm", "aten._addmm_activation", "aten.mv", "aten.addmv",
    "aten.dot", "aten._scaled_mm", "aten._int_mm",
})
# matmuls that add a bias: on a CPU each first writes the bias, broadcast, into its whole output,
# then accumulates the product into it (a pass over the output before the multiply); CUDA's
# cuBLASLt adds it in the multiply's epilogue
BIAS_FIRST = frozenset({"aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.addmv"})
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1,
})
# many small matmuls in one call (attention's scores and their product with the values, a
# head's width deep): a CPU's library runs them further below its peak than one large matmul
BATCHED_MATMUL = frozenset({"aten.bmm", "aten.baddbmm"})
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
    "matmul": MATMUL, "batched_matmul": BATCHED_MATMUL, "convolution": CONVOLUTION,
    "attention": ATTENTION, "rnn": RNN,
})
MEMORY = "memory"
# the class whose efficiency a class takes where a profile gives it none
FALLBACK_CLASS: Mapping[str, str] = MappingProxyType({"batched_matmul": "matmul"})
_CLASS_OF = {kind: name for name, kinds in COMPUTE_CLASSES.items() for kind in kinds}


def op_class(kind: str) -> str:
    """The class of an op kind: a key of ``COMPUTE_CLASSES``, else ``"memory"``."""
    return _CLASS_OF.get(kind, MEMORY)


# Memory-bound ops whose elements cost more than the bytes they move on a CPU core: each
# element runs a polynomial (transcendental functions, softmax's exp), a random generator, or
# a normalization's statistics and affine map (batch norm's per-channel passes, layer norm's
# per-row ones), each normalization family priced over its forward and backward together.
# Three families are eager kernels' own, each several passes where a fused kernel makes one:
# softmax over its forward and backward (a max, an exp, a sum and a scale per row),
# ``_safe_softmax`` (softmax, then a check for rows masked whole and a ``where`` over its
# output), dropout (a draw of the mask, its conversion, a multiply) and dropout's backward (its
# mask converted to the gradient's dtype, then multiplied).
# A fused kernel prices them as their ``FALLBACK_FAMILY``.
# ``aten.pow`` is arithmetic: models raise to small whole powers (GELU's cube, a square), which
# ATen computes by multiplying (the kind does not say the exponent: a fractional one is
# underpriced).
# ``Hardware.element_rates`` gives each family's elements per second where a profile measured
# them; an op of no family ("arithmetic") is priced by its bytes alone.
TRANSCENDENTAL = frozenset({
    "aten.exp", "aten.exp2", "aten.expm1", "aten.log", "aten.log1p", "aten.log2", "aten.tanh",
    "aten.sigmoid", "aten.erf", "aten.erfc", "aten.gelu", "aten.gelu_backward", "aten.silu",
    "aten.silu_backward", "aten.sin", "aten.cos", "aten.softplus", "aten.mish", "aten.elu",
    "aten.atan", "aten.tan",
})
# transcendental functions a kernel evaluates per element where that is more than one: GELU's
# backward takes the normal's CDF (``erf``) and its density (``exp``), softplus a ``log1p`` of
# an ``exp``, mish a ``tanh`` of a softplus
TRANSCENDENTALS_PER_ELEMENT: Mapping[str, int] = MappingProxyType({
    "aten.gelu_backward": 2, "aten.softplus": 2, "aten.mish": 3,
})
SOFTMAX = frozenset({
    "aten._softmax", "aten._log_softmax", "aten._softmax_backward_data",
    "aten._log_softmax_backward_data",
})
SAFE_SOFTMAX = frozenset({"aten._safe_softmax"})
DROPOUT = frozenset({"aten.native_dropout"})
DROPOUT_BACKWARD = frozenset({"aten.native_dropout_backward"})
RANDOM = frozenset({
    "aten.bernoulli", "aten.rand", "aten.rand_like", "aten.randn",
    "aten.randn_like", "aten.uniform", "aten.normal", "aten.randint", "aten.randint_like",
    "prims.inductor_random", "rngprims.philox_rand", "aten.philox_rand",
})
BATCH_NORM = frozenset({
    "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit",
    "aten.native_batch_norm", "aten._batch_norm_with_update",
    "aten._batch_norm_with_update_functional", "aten.native_batch_norm_backward",
    "aten.batch_norm_backward",
})
LAYER_NORM = frozenset({
    "aten.native_layer_norm", "aten.native_layer_norm_backward", "aten._fused_rms_norm",
    "aten._fused_rms_norm_backward",
})
# A kernel inductor generates for a softmax (its decomposition: a row's ``amax``, the
# exponentials, their sum, fused with what feeds them: a scale, a mask) is priced by its own
# family, ``compiled_softmax``, per element of its ``exp`` (``memfit.model.kernels``): on a CPU
# it runs several passes over each row, recomputing its inputs in each. No op kind is in it.
SOFTMAX_KERNEL_KINDS = frozenset({"aten.amax", "aten.exp"})  # a fused kernel with both
COMPILED_SOFTMAX = "compiled_softmax"
ELEMENT_FAMILIES: Mapping[str, frozenset[str]] = MappingProxyType({
    "transcendental": TRANSCENDENTAL, "random": RANDOM, "batch_norm": BATCH_NORM,
    "layer_norm": LAYER_NORM, "softmax": SOFTMAX, "safe_softmax": SAFE_SOFTMAX,
    "dropout": DROPOUT, "dropout_backward": DROPOUT_BACKWARD, COMPILED_SOFTMAX: frozenset(),
})
RANDOM_DRAWS = RANDOM | DROPOUT  # ops that draw from the random generator
ARITHMETIC = "arithmetic"
EAGER_FAMILIES = frozenset({"safe_softmax", "softmax", "dropout", "dropout_backward"})
# what an eager kernel's family is priced as where a profile has no rate for it, or inside a
# fused kernel (one pass over the elements): each chain ends outside ``EAGER_FAMILIES``
FALLBACK_FAMILY: Mapping[str, str] = MappingProxyType({
    "safe_softmax": "softmax", "softmax": "transcendental", "dropout": "random",
    "dropout_backward": ARITHMETIC,
})
_FAMILY_OF = {kind: name for name, kinds in ELEMENT_FAMILIES.items() for kind in kinds}


def element_family(kind: str) -> str:
    """The per-element cost family of a memory-bound op kind (in-place variants, whose schema
    names end in ``_``, count as their op): a key of ``ELEMENT_FAMILIES``, else
    ``"arithmetic"``."""
    return _FAMILY_OF.get(kind, _FAMILY_OF.get(kind.removesuffix("_"), ARITHMETIC))
