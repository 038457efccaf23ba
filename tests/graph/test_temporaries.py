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
