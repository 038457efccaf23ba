"""The target's graph: capture a step as the profile's device would run it, not as this CPU does.

A CPU laptop planning for an H100 (``memfit.plan(..., hardware="h100-sxm",
autocast=torch.bfloat16)``) traces CPU kernels: math attention with dropout on the full S x S
scores, every op in float32. ``retargeted(hardware, device, autocast)``, the one entry point, is
entered around the joint trace (``memfit.tracing.capture`` and the planning-only backend) and
returns what makes the trace record the target's kernels:

- the profile's device is this device's type (a CPU run, or a GPU planning for itself):
  ``torch.autocast(device, dtype)`` when ``autocast`` is given, else nothing: the capture is
  exactly today's;
- a CUDA profile planned from CPU or meta tensors: a ``TorchFunctionMode`` (``CudaPersonality``)
  that picks CUDA's SDPA kernel (``memfit.tracing.target_attention``) and applies CUDA's autocast
  policy. Fake CUDA tensors cannot be traced on a CPU-only build (autograd aborts: "PyTorch is
  not linked with support for cuda devices") and ``torch.autocast("cuda")`` needs them, so the
  personality rewrites the calls above autograd instead, on CPU tensors: the casts are ops
  autograd records, so the backward's dtypes come out as CUDA's (bf16 activation gradients,
  float32 weight gradients through the casts' backward).

CUDA's autocast policy is PyTorch's: the op lists of ``ATen/autocast_mode.h`` (installed with
torch, ``include/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``), which the documentation restates
("CUDA Ops that can autocast to float16 / to float32 / to widest input type",
https://docs.pytorch.org/docs/stable/amp.html#cuda-op-specific-behavior). The mode sees the
Python-level calls (``F.linear``, ``Tensor.__matmul__``, ``F.cross_entropy``), so composite
Python functions whose aten ops are listed are listed by their Python names (``__pow__``,
``cross_entropy``, ``normalize``). A cast of a leaf tensor that requires grad (a weight) is made
once per trace and reused, as autocast's cast cache does (GPT-2's tied ``wte``/``lm_head``).

A plan made this way describes the target's step: its graph is not the one a CPU step runs, so
``memfit.compile(..., plan=plan)`` on CPU tensors refuses it (the graph hashes differ).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from memfit.data.hardware import Hardware
from memfit.tracing.target_attention import cuda_attention

LOWER_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

# AT_FORALL_LOWER_PRECISION_FP, with the Python names of the same ops (Tensor.__matmul__,
# torch.linalg.multi_dot) beside the aten ones
TO_LOWER_PRECISION = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot", "vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention",
})
# AT_FORALL_FP32 and norm (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE), with the documented Python
# names (__pow__, __rpow__, __rdiv__, __rtruediv__, normalize) and cross_entropy's fallback
TO_FLOAT32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "__rdiv__",
    "__rtruediv__", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "cross_entropy", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
    "upsample_bicubic2d", "interpolate",
})
# AT_FORALL_FP32_SET_OPT_DTYPE: run with dtype=float32 (no cast of the input)
WITH_FLOAT32_RESULT = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "vector_norm", "matrix_norm", "sum",
})
# AT_FORALL_PROMOTE: every floating input to the widest one's dtype
TO_WIDEST = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "grid_sample", "index_put", "tensordot", "scatter_add",
})


def retargeted(hardware: Hardware, device: torch.device,
               autocast: torch.dtype | None = None) -> contextlib.AbstractContextManager:
    """What to enter around a joint trace on ``device`` so that it records ``hardware``'s step.

    Args:
        hardware: the profile planned for; its ``device_type`` says which device runs the step.
        device: where the traced tensors are (a meta input is traced on the parameters' device).
        autocast: the lower-precision dtype of the target's ``torch.autocast`` region
            (``torch.bfloat16`` or ``torch.float16``), ``None`` for none.

    Raises:
        ValueError: for an ``autocast`` that is not a lower-precision float dtype, or a profile
            of a device type memfit cannot imitate from this one.
    """
    check_autocast(autocast)
    if hardware.device_type == device.type:  # a step this device runs: PyTorch's own autocast
        if autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast)
    if hardware.device_type == "cuda":
        return CudaPersonality(autocast)
    if hardware.device_type == "cpu" and autocast is not None:
        return torch.autocast("cpu", dtype=autocast)
    if hardware.device_type == "cpu":
        return contextlib.nullcontext()
    raise ValueError(f"memfit cannot capture a {hardware.device_type!r} step from {device.type} "
                     f"tensors (profile {hardware.name!r}); plan on that device, or use a CUDA or "
                     "CPU profile")


def check_autocast(autocast: object) -> None:
    """Raise ``ValueError`` unless ``autocast`` is ``None``, ``torch.bfloat16`` or
    ``torch.float16``: checked before tracing, so the error is not one from inside Dynamo."""
    if autocast is not None and autocast not in LOWER_PRECISION_DTYPES:
        raise ValueError(f"autocast= takes torch.bfloat16 or torch.float16, got {autocast!r}")


@contextlib.contextmanager
def host_code() -> Iterator[None]:
    """Run memfit's own code (the planner, inside the trace's partition step) without the
    personality: its tensor arithmetic is bookkeeping, not the target's step."""
    stack = torch.overrides._get_current_function_mode_stack()
    modes = [mode for mode in stack if isinstance(mode, CudaPersonality)]
    for mode in modes:
        mode.paused += 1
    try:
        yield
    finally:
        for mode in modes:
            mode.paused -= 1


class CudaPersonality(TorchFunctionMode):
    """CUDA's SDPA kernel choice and (with ``autocast``) CUDA's autocast policy, on CPU tensors.

    See the module docstring for why a function mode and which lists.
    """

    def __init__(self, autocast: torch.dtype | None) -> None:
        super().__init__()
        self.autocast = autocast
        self.paused = 0
        self._cast_cache: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __exit__(self, *exc_info: Any) -> Any:
        self._cast_cache.clear()
        return super().__exit__(*exc_info)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.autocast is not None:
            args, kwargs = self._autocast(name, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return cuda_attention(*args, **kwargs)
        if name == "cross_entropy" and self.autocast is not None:
            return _cross_entropy_in_float32(func, args, kwargs)
        return func(*args, **kwargs)

    def _autocast(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments as CUDA's autocast passes them to the op ``name``."""
        if name in TO_LOWER_PRECISION:
            return self._cast_all((args, kwargs), self.autocast)
        if name in TO_FLOAT32 and name != "cross_entropy":
            return self._cast_all((args, kwargs), torch.float32)
        if name in WITH_FLOAT32_RESULT and _lower_precision_input(args) and "dtype" not in kwargs:
            return args, {**kwargs, "dtype": torch.float32}
        if name in TO_WIDEST:
            return self._cast_all((args, kwargs), _widest(args, kwargs))
        return args, kwargs

    def _cast_all(self, arguments: tuple[tuple, dict], dtype: torch.dtype | None
                  ) -> tuple[tuple, dict]:
        """Every floating tensor (not float64, as autocast's eligibility rule) cast to ``dtype``."""
        if dtype is None:
            return arguments

        def cast(value: Any) -> Any:
            eligible = (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.dtype != torch.float64 and value.dtype != dtype)
            return self._cast(value, dtype) if eligible else value

        return tree_map(cast, arguments)

    def _cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor.to(dtype)``, made once for a leaf that requires grad (autocast's cache)."""
        if not (tensor.is_leaf and tensor.requires_grad):
            return tensor.to(dtype)
        key = (id(tensor), dtype)
        if key not in self._cast_cache:  # the source is kept, so its id is not reused
            self._cast_cache[key] = (tensor, tensor.to(dtype))
        return self._cast_cache[key][1]


def _lower_precision_input(args: tuple) -> bool:
    first = args[0] if args else None
    return isinstance(first, torch.Tensor) and first.dtype in LOWER_PRECISION_DTYPES


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The widest floating dtype among the tensors, as autocast's promote policy picks it."""
    dtypes: list[torch.dtype] = []

    def collect(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            dtypes.append(value.dtype)
        return value

    tree_map(collect, (args, kwargs))
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).bits) if dtypes else None


def _cross_entropy_in_float32(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``F.cross_entropy`` as aten's composite runs under CUDA autocast: ``log_softmax`` with
    ``dtype=float32`` (a float32 result, no float32 copy of the logits), then ``nll_loss`` in
    float32. Probabilities as targets or label smoothing take the float32 cast of the inputs."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
             "label_smoothing")
    bound = dict(zip(names, args, strict=False)) | kwargs
    logits, target = bound["input"], bound["target"]
    legacy = bound.get("size_average") is not None or bound.get("reduce") is not None
    if target.is_floating_point() or bound.get("label_smoothing", 0.0) or legacy:
        cast_args, cast_kwargs = tree_map(_to_float32, (args, kwargs))
        return func(*cast_args, **cast_kwargs)
    weight = bound.get("weight")
    log_probabilities = F.log_softmax(logits, 1 if logits.dim() > 1 else 0, dtype=torch.float32)
    return F.nll_loss(log_probabilities, target,
                      None if weight is None else weight.to(torch.float32),
                      ignore_index=bound.get("ignore_index", -100),
                      reduction=bound.get("reduction", "mean"))


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOWER_PRECISION_DTYPES:
        return value.to(torch.float32)
    return value
