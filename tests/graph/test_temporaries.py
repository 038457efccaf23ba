"""The kernel temporaries memfit counts are what the installed CPU kernels allocate."""

import pytest
import torch
import torch.fx as fx

from memfit.graph.temporaries import kernel_temporary_bytes
from memfit.runtime.measure import _allocator_peak_above_start

aten = torch.ops.aten


def traced(function, *args) -> fx.Node:
    """The graph node of the op ``function`` calls, with its fake ``val`` as analyze sees it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = make_fx(function, tracing_mode="fake")(*args)
    return next(node for node in module.graph.nodes if node.op == "call_function")


def storage_bytes(value) -> int:
    values = value if isinstance(value, tuple) else (value,)
    return sum(v.untyped_storage().nbytes() for v in values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(512, 64), (3, 5)])
def test_dropout_temporaries_match_the_allocator(dtype, shape):
    values = torch.randn(shape).to(dtype)
    forward = lambda x: aten.native_dropout.default(x, 0.1, True)  # noqa: E731
    (output, mask), peak_bytes = _allocator_peak_above_start(lambda: forward(values))
    assert peak_bytes - storage_bytes((output, mask)) == kernel_temporary_bytes(traced(forward, values))

    backward = lambda g, m: aten.native_dropout_backward.default(g, m, 1 / 0.9)  # noqa: E731
    gradient = torch.randn(shape).to(dtype)
    result, peak_bytes = _allocator_peak_above_start(lambda: backward(gradient, mask))
    node = traced(backward, gradient, mask)
    assert peak_bytes - storage_bytes(result) == kernel_temporary_bytes(node) > 0


def test_ops_without_known_temporaries_count_none():
    node = traced(lambda x: aten.relu.default(x), torch.randn(4, 4))
    assert kernel_temporary_bytes(node) == 0


CONVOLUTIONS = [  # (batch, in channels, out channels, size, kernel, stride, padding, dims, bias)
    (8, 3, 16, 32, 3, 1, 1, 2, False), (8, 16, 16, 32, 3, 1, 1, 2, False),
    (2, 20, 4, 16, 3, 1, 1, 2, True), (8, 16, 16, 32, 3, 2, 1, 2, False),
    (2, 5, 12, 16, 3, 1, 1, 2, False), (2, 1, 4, 16, 3, 1, 1, 3, False),
    (2, 4, 8, 16, 3, 2, 1, 3, True), (2, 8, 8, 8, 3, 1, 1, 3, True),
]


def convolution_arguments(batch, inputs, outputs, size, kernel, stride, padding, dims, bias):
    values = torch.randn(batch, inputs, *[size] * dims)
    weight = torch.randn(outputs, inputs, *[kernel] * dims)
    return values, weight, torch.randn(outputs) if bias else None, [stride] * dims, [padding] * dims


@pytest.mark.parametrize("shape", CONVOLUTIONS)
def test_convolution_forward_temporaries_match_the_allocator(shape):
    values, weight, bias, stride, padding = convolution_arguments(*shape)
    dims = len(stride)

    def forward(x, w, b):
        return aten.convolution.default(x, w, b, stride, padding, [1] * dims, False, [0] * dims, 1)

    output, peak_bytes = _allocator_peak_above_start(lambda: forward(values, weight, bias))
    node = traced(forward, values, weight, bias)
    assert peak_bytes - storage_bytes(output) == kernel_temporary_bytes(node) > 0


def _backward_cases():
    """2D, stride 1, at least 5 input channels, no bias gradient: the cases the rule is exact on.
    The others are known gaps, marked xfail (not strict: some happen to match): the bias
    gradient's buffers, fewer than 8 output channels, strided data gradients, 3-channel inputs' weight gradients, and 3D
    kernels (gemm weight gradients, scratchpads) are not modelled yet."""
    masks = [(True, True, False), (False, True, False), (True, False, False), (True, True, True)]
    for shape in (s for s in CONVOLUTIONS if s[7] == 2):
        for mask in masks:
            exact = shape[5] == 1 and shape[1] >= 5 and not mask[2]
            marks = () if exact else pytest.mark.xfail(strict=False, reason="not modelled yet")
            yield pytest.param(shape, mask, marks=marks)


@pytest.mark.parametrize(("shape", "mask"), list(_backward_cases()))
def test_convolution_backward_temporaries_match_the_allocator(shape, mask):
    """The input gradient's and the weight gradient's blocked copies, by the allocator."""
    values, weight, _, stride, padding = convolution_arguments(*shape)
    dims = len(stride)
    gradient = torch.randn_like(aten.convolution.default(values, weight, None, stride, padding,
                                                         [1] * dims, False, [0] * dims, 1))
    bias_sizes = [weight.shape[0]] if mask[2] else None

    def backward(g, x, w):
        return aten.convolution_backward.default(g, x, w, bias_sizes, stride, padding, [1] * dims,
                                                 False, [0] * dims, 1, list(mask))

    results, peak_bytes = _allocator_peak_above_start(lambda: backward(gradient, values, weight))
    produced = tuple(r for r in results if r is not None)
    node = traced(backward, gradient, values, weight)
    assert peak_bytes - storage_bytes(produced) == kernel_temporary_bytes(node) > 0


@pytest.mark.parametrize("shape", [(8, 16, 32, 32), (2, 4, 16, 16, 16), (3, 5, 7)])
def test_batch_norm_temporaries_match_the_allocator(shape):
    values, channels = torch.randn(shape), shape[1]
    weight, bias = torch.randn(channels), torch.randn(channels)
    running_mean, running_var = torch.zeros(channels), torch.ones(channels)

    def forward(x, w, b, m, v):
        return aten.native_batch_norm.default(x, w, b, m, v, True, 0.1, 1e-5)

    arguments = (values, weight, bias, running_mean, running_var)
    (output, mean, invstd), peak_bytes = _allocator_peak_above_start(lambda: forward(*arguments))
    node = traced(forward, *arguments)
    assert peak_bytes - storage_bytes((output, mean, invstd)) == kernel_temporary_bytes(node) > 0

    gradient = torch.randn(shape)

    def backward(g, x, w, m, v, saved_mean, saved_invstd):
        return aten.native_batch_norm_backward.default(g, x, w, m, v, saved_mean, saved_invstd,
                                                       True, 1e-5, [True, True, True])

    arguments = (gradient, values, weight, running_mean, running_var, mean, invstd)
    results, peak_bytes = _allocator_peak_above_start(lambda: backward(*arguments))
    node = traced(backward, *arguments)
    assert peak_bytes - storage_bytes(results) == kernel_temporary_bytes(node) > 0
