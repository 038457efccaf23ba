"""The kernel temporaries memfit counts are what the installed CPU kernels allocate."""

import pytest
import torch
import torch.fx as fx

from memfit.runtime.measure import allocator_peak_above_start
from memfit.tracing import kernel_probe, temporaries
from memfit.tracing.temporaries import (
    kernel_output_storage_bytes,
    kernel_temporary_bytes,
    kernel_temporary_bytes_of,
)

aten = torch.ops.aten


def traced(function, *args) -> fx.Node:
    """The graph node of the op ``function`` calls, with its fake ``val`` as analyze sees it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = make_fx(function, tracing_mode="fake")(*args)
    return next(node for node in module.graph.nodes if node.op == "call_function")


def storage_bytes(value) -> int:
    values = value if isinstance(value, tuple) else (value,)
    return sum(v.untyped_storage().nbytes() for v in values)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(512, 64), (3, 5)])
def test_dropout_temporaries_match_the_allocator(dtype, shape):
    values = torch.randn(shape).to(dtype)
    forward = lambda x: aten.native_dropout.default(x, 0.1, True)  # noqa: E731
    (output, mask), peak_bytes = allocator_peak_above_start(lambda: forward(values))
    assert peak_bytes - storage_bytes((output, mask)) == kernel_temporary_bytes(traced(forward, values))

    backward = lambda g, m: aten.native_dropout_backward.default(g, m, 1 / 0.9)  # noqa: E731
    gradient = torch.randn(shape).to(dtype)
    result, peak_bytes = allocator_peak_above_start(lambda: backward(gradient, mask))
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


@pytest.mark.slow
@pytest.mark.parametrize("shape", CONVOLUTIONS)
def test_convolution_forward_temporaries_match_the_allocator(shape):
    values, weight, bias, stride, padding = convolution_arguments(*shape)
    dims = len(stride)

    def forward(x, w, b):
        return aten.convolution.default(x, w, b, stride, padding, [1] * dims, False, [0] * dims, 1)

    output, peak_bytes = allocator_peak_above_start(lambda: forward(values, weight, bias))
    node = traced(forward, values, weight, bias)
    assert peak_bytes - storage_bytes(output) == kernel_temporary_bytes(node) > 0


def _backward_cases():
    """Every case and output mask: 2D at stride 1 from 5 input channels without the bias gradient
    by the rule, the others (strided, 3-channel inputs, bias gradients, 3D) measured."""
    masks = [(True, True, False), (False, True, False), (True, False, False), (True, True, True)]
    for shape in CONVOLUTIONS:
        for mask in masks:
            yield shape, mask


def backward_case(shape, mask):
    """``convolution_backward`` of a ``CONVOLUTIONS`` shape, and its real arguments."""
    values, weight, _, stride, padding = convolution_arguments(*shape)
    dims = len(stride)
    gradient = torch.randn_like(aten.convolution.default(values, weight, None, stride, padding,
                                                         [1] * dims, False, [0] * dims, 1))
    bias_sizes = [weight.shape[0]] if mask[2] else None

    def backward(g, x, w):
        return aten.convolution_backward.default(g, x, w, bias_sizes, stride, padding, [1] * dims,
                                                 False, [0] * dims, 1, list(mask))

    return backward, (gradient, values, weight)


def predictions(cases: dict) -> dict:
    """Each case's predicted bytes, all asked for at once (one child for the measured ones)."""
    nodes = {key: traced(function, *arguments) for key, (function, arguments) in cases.items()}
    predicted = kernel_temporary_bytes_of(nodes.values())
    return {key: predicted.get(node, 0) for key, node in nodes.items()}


def measured_extra_bytes(function, arguments) -> int:
    """What the allocator held at the call's high-water mark beyond the storages it returned."""
    results, peak_bytes = allocator_peak_above_start(lambda: function(*arguments))
    results = results if isinstance(results, tuple) else (results,)
    return peak_bytes - storage_bytes(tuple(r for r in results if r is not None))


@pytest.fixture(scope="module")
def predicted_backward():
    return predictions({case: backward_case(*case) for case in _backward_cases()})


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "mask"), list(_backward_cases()))
def test_convolution_backward_temporaries_match_the_allocator(shape, mask, predicted_backward):
    """The input gradient's and the weight gradient's blocked copies, by the allocator."""
    extra_bytes = measured_extra_bytes(*backward_case(shape, mask))
    assert extra_bytes == predicted_backward[(shape, mask)] > 0


# (batch, in channels, out channels, size, kernel, stride, padding, dims, transposed, output
#  padding, groups): the U-Net's 3D and transposed shapes, and strides, groups, widths beside them
MEASURED_CONVOLUTIONS = [
    (2, 16, 16, 4, 3, 1, 1, 3, False, 0, 1), (2, 8, 16, 4, 1, 1, 0, 3, False, 0, 1),
    (2, 4, 8, 8, 3, 2, 1, 3, False, 0, 1), (2, 1, 4, 16, 3, 2, 1, 3, False, 0, 1),
    (2, 24, 4, 4, 3, 2, 1, 3, True, 1, 1), (2, 8, 2, 8, 3, 2, 1, 3, True, 1, 1),
    (2, 16, 8, 6, 3, 1, 1, 3, False, 0, 4), (2, 8, 8, 16, 4, 2, 1, 2, True, 0, 1),
    (4, 16, 8, 8, 3, 2, 1, 2, True, 1, 2), (1, 3, 8, 20, 3, 1, 1, 2, False, 0, 1),
]
MEASURED_CALLS = [("forward", True), ("forward", False), ((True, True, True), True),
                  ((False, True, True), True), ((True, True, False), True)]


def measured_case(shape, call, bias):
    """A convolution (``call`` is ``"forward"`` or the backward's output mask) and its real
    arguments."""
    batch, inputs, outputs, size, kernel, stride, padding, dims, transposed, extra, groups = shape
    values = torch.randn(batch, inputs, *[size] * dims)
    weight_shape = (inputs, outputs // groups) if transposed else (outputs, inputs // groups)
    weight = torch.randn(*weight_shape, *[kernel] * dims)
    flags = ([stride] * dims, [padding] * dims, [1] * dims, transposed, [extra] * dims, groups)
    if call == "forward":
        def forward(x, w, b):
            return aten.convolution.default(x, w, b, *flags)

        return forward, (values, weight, torch.randn(outputs) if bias else None)
    gradient = torch.randn_like(aten.convolution.default(values, weight, None, *flags))

    def backward(g, x, w):
        return aten.convolution_backward.default(g, x, w, [outputs] if call[2] else None, *flags,
                                                 list(call))

    return backward, (gradient, values, weight)


MEASURED_CASES = [(shape, call, bias) for shape in MEASURED_CONVOLUTIONS
                  for call, bias in MEASURED_CALLS]


@pytest.fixture(scope="module")
def predicted_measured():
    return predictions({case: measured_case(*case) for case in MEASURED_CASES})


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "call", "bias"), MEASURED_CASES)
def test_measured_convolution_temporaries_match_the_allocator(shape, call, bias,
                                                              predicted_measured):
    """3D, transposed, grouped and slow-path convolutions (no exact rule): what the child process
    measured is this process's allocator at the same shapes, threads and flags."""
    extra_bytes = measured_extra_bytes(*measured_case(shape, call, bias))
    assert extra_bytes == predicted_measured[(shape, call, bias)]


def test_exact_rules_run_no_kernel(monkeypatch):
    """The oneDNN forwards at stride 1 the rule is exact for are computed, never measured."""
    def refuse(nodes):
        raise AssertionError(f"measured {list(nodes)}")

    monkeypatch.setattr(temporaries, "measured_temporary_bytes", refuse)
    for shape in (CONVOLUTIONS[1], CONVOLUTIONS[2], CONVOLUTIONS[7]):
        values, weight, bias, stride, padding = convolution_arguments(*shape)
        assert kernel_temporary_bytes(traced(_forward(stride, padding), values, weight, bias)) > 0


def _forward(stride, padding):
    """A plain convolution forward at ``stride`` and ``padding``, of its three tensors only."""
    dims = len(stride)

    def forward(x, w, b):
        return aten.convolution.default(x, w, b, stride, padding, [1] * dims, False, [0] * dims, 1)

    return forward


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 64, 64, 2, 3, 1, 1, 2, False),
                                   (8, 8, 8, 16, 3, 1, 1, 2, False)])
def test_small_resnet_backwards_are_measured_as_the_allocator_sees_them(shape):
    """A ResNet-50-shaped model's small-spatial backwards, where the rule once called exact
    under-counted (1,198,336 B measured against 147,456 B at 8x64x2x2): the prediction is now
    the allocator's."""
    case = (shape, (True, True, False))
    assert measured_extra_bytes(*backward_case(*case)) == predictions({case: backward_case(*case)})[case]


def test_a_failed_measurement_warns_and_estimates(monkeypatch):
    """Without a child process the rule's estimate stands in, and the user is told."""
    monkeypatch.setattr(kernel_probe, "_MEASURED_BYTES", {})
    monkeypatch.setattr(kernel_probe.sys, "executable", "/nonexistent/python")
    function, arguments = measured_case(MEASURED_CONVOLUTIONS[0], (True, True, True), True)
    node = traced(function, *arguments)
    with pytest.warns(UserWarning, match="scratch buffers"):
        estimated = kernel_temporary_bytes(node)
    assert estimated == temporaries._convolution_backward(node)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 16, 32, 32), (2, 4, 16, 16, 16), (3, 5, 7)])
def test_batch_norm_temporaries_match_the_allocator(shape):
    values, channels = torch.randn(shape), shape[1]
    weight, bias = torch.randn(channels), torch.randn(channels)
    running_mean, running_var = torch.zeros(channels), torch.ones(channels)

    def forward(x, w, b, m, v):
        return aten.native_batch_norm.default(x, w, b, m, v, True, 0.1, 1e-5)

    arguments = (values, weight, bias, running_mean, running_var)
    (output, mean, invstd), peak_bytes = allocator_peak_above_start(lambda: forward(*arguments))
    node = traced(forward, *arguments)
    assert peak_bytes - storage_bytes((output, mean, invstd)) == kernel_temporary_bytes(node) > 0

    gradient = torch.randn(shape)

    def backward(g, x, w, m, v, saved_mean, saved_invstd):
        return aten.native_batch_norm_backward.default(g, x, w, m, v, saved_mean, saved_invstd,
                                                       True, 1e-5, [True, True, True])

    arguments = (gradient, values, weight, running_mean, running_var, mean, invstd)
    results, peak_bytes = allocator_peak_above_start(lambda: backward(*arguments))
    node = traced(backward, *arguments)
    assert peak_bytes - storage_bytes(results) == kernel_temporary_bytes(node) > 0


LOSSES = [
    lambda x, t, reduction: aten.mse_loss.default(x, t, reduction),
    lambda x, t, reduction: aten.smooth_l1_loss.default(x, t, reduction, 1.0),
    lambda x, t, reduction: aten.binary_cross_entropy.default(x, t, None, reduction),
]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize(("shape", "target_shape"), [((2, 2, 8, 8, 8), (2, 2, 8, 8, 8)),
                                                     ((3, 5), (1, 5)), ((7,), (7,))])
def test_reduced_losses_keep_their_elementwise_buffer(loss, reduction, shape, target_shape):
    """The storage under a CPU loss's output, by the kernel itself (the fake value says less)."""
    values, target = torch.rand(shape), torch.rand(target_shape)
    if loss is LOSSES[2] and shape != target_shape:  # binary cross-entropy does not broadcast
        target = target.expand(shape).contiguous()
    output = loss(values, target, reduction)
    node = traced(lambda x, t: loss(x, t, reduction), values, target)
    expected = kernel_output_storage_bytes(node) or node.meta["val"].untyped_storage().nbytes()
    assert output.untyped_storage().nbytes() == expected


@pytest.mark.parametrize("strided", [False, True])
def test_embedding_backward_copies_a_strided_gradient(strided):
    """An LSTM's gradient reaches the embedding transposed to batch-first: copied contiguous."""
    gradient = torch.randn(16, 8, 32).transpose(0, 1) if strided else torch.randn(8, 16, 32)
    indices = torch.randint(0, 64, (8, 16))

    def backward(g, i):
        return aten.embedding_dense_backward.default(g, i, 64, -1, False)

    result, peak_bytes = allocator_peak_above_start(lambda: backward(gradient, indices))
    node = traced(backward, gradient, indices)
    assert peak_bytes - storage_bytes(result) == kernel_temporary_bytes(node)
    assert kernel_temporary_bytes(node) == (gradient.nbytes if strided else 0)


# (batch, heads, query length, key length, head size): ViT's attention (8x4x65x16), then each of
# ATen's query block lengths (32, 64 from 192 queries, 256 from 768), keys past one 512 block,
# and blocks longer than the sequence
ATTENTIONS = [(8, 4, 65, 65, 16), (2, 2, 200, 600, 32), (1, 2, 800, 600, 8), (3, 1, 10, 7, 5)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The kernels' scratch is per thread: run at one and at two threads, then put it back."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def attention_case(shape, dtype=torch.float32, causal=False, masked=False):
    """The CPU flash attention's forward and backward at ``shape`` and their real arguments;
    the output gradient in (batch, heads, query) order where the query length is even, else a
    transposed (batch, query, heads) one, which the backward reads without a copy."""
    batch, heads, queries, keys, size = shape
    query, key, value = (torch.randn(batch, heads, length, size, dtype=dtype)
                         for length in (queries, keys, keys))
    mask = torch.randn(queries, keys, dtype=dtype) if masked else None

    def forward(q, k, v, m):
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, causal, attn_mask=m)

    output, logsumexp = forward(query, key, value, mask)
    gradient = (torch.randn(batch, heads, queries, size, dtype=dtype) if queries % 2 == 0 else
                torch.randn(batch, queries, heads, size, dtype=dtype).transpose(1, 2))

    def backward(g, q, k, v, o, lse, m):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, k, v, o, lse, 0.0, causal, attn_mask=m)

    return ((forward, (query, key, value, mask)),
            (backward, (gradient, query, key, value, output, logsumexp, mask)))


@pytest.mark.slow
@pytest.mark.parametrize("shape", ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("causal", "masked"), [(False, False), (True, False), (False, True)])
def test_flash_attention_temporaries_match_the_allocator(shape, dtype, causal, masked, threads,
                                                         monkeypatch):
    """The per-thread blocks of CPU attention, by rule (never measured in a child). Missed
    once: a recomputing ViT plan ran its attention forward again inside the backward, and those
    21,248 B at two threads were the measured peak's 0.84% over its budget.

    The backward's row sums are one per thread, allocated on each OpenMP thread; the profiler's
    allocator events show the calling thread's only, hence ``threads - 1`` row sums unseen."""
    monkeypatch.setattr(temporaries, "measured_temporary_bytes", lambda nodes: {})
    (forward, forward_arguments), (backward, backward_arguments) = attention_case(
        shape, dtype, causal, masked)
    predicted = kernel_temporary_bytes(traced(forward, *forward_arguments))
    assert measured_extra_bytes(forward, forward_arguments) == predicted > 0

    query_block = min(32 if shape[2] < 192 else 64 if shape[2] < 768 else 256, shape[2])
    unseen_bytes = (threads - 1) * query_block * torch.empty((), dtype=dtype).element_size()
    predicted = kernel_temporary_bytes(traced(backward, *backward_arguments))
    assert measured_extra_bytes(backward, backward_arguments) == predicted - unseen_bytes > 0


def test_flash_attention_copies_a_transposed_output_gradient():
    """The backward reads the output gradient as (batch, query, heads): one in (batch, heads,
    query) order is copied contiguous first, beside the per-thread blocks."""
    _, (backward, arguments) = attention_case((2, 2, 64, 64, 16))
    strided = (arguments[0].transpose(1, 2).contiguous().transpose(1, 2), *arguments[1:])
    copied = kernel_temporary_bytes(traced(backward, *arguments))
    assert copied - kernel_temporary_bytes(traced(backward, *strided)) == arguments[0].nbytes


def test_attention_rules_read_a_fake_value_under_another_fake_mode():
    """A region's values may belong to another fake mode than the one active while it is
    analysed (a dynamic region priced at its bound, in a process that compiled other models
    first): the rule reads sizes and strides and runs no op on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, (backward, arguments) = attention_case((2, 2, 64, 64, 16))
    strided = (arguments[0].transpose(1, 2).contiguous().transpose(1, 2), *arguments[1:])
    expected = [kernel_temporary_bytes(traced(backward, *case)) for case in (arguments, strided)]
    nodes = [traced(backward, *case) for case in (arguments, strided)]
    with FakeTensorMode():
        assert [kernel_temporary_bytes(node) for node in nodes] == expected


def test_half_precision_attention_is_measured():
    """bfloat16's kernels block differently from the rule's float blocks: the child process
    measures them, as this process's allocator sees them."""
    (forward, arguments), _ = attention_case(ATTENTIONS[0], torch.bfloat16)
    assert measured_extra_bytes(forward, arguments) == kernel_temporary_bytes(
        traced(forward, *arguments))


def to_channels_last(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("mask", [(True, True, False), (True, False, False)])
def test_channels_last_convolutions_are_measured_in_that_layout(mask):
    """Under inductor's layout optimization a 2D convolution's backward reads its gradient,
    input and weight channels last (inductor converts the weight in the forward), and oneDNN
    then makes none of the blocked copies it makes of plain tensors (a 4 MiB copy at
    16x32x32x32) nor a converted copy of the weight: the bytes counted for a node in
    ``channels_last`` are the allocator's for that layout, and less than the plain layout's."""
    shape = (16, 32, 32, 32, 3, 1, 1, 2, False)
    backward, (gradient, values, weight) = backward_case(shape, mask)
    node = traced(backward, gradient, values, weight)
    plain = kernel_temporary_bytes_of([node]).get(node, 0)
    channels_last = kernel_temporary_bytes_of([node], channels_last={node}).get(node, 0)
    measured = measured_extra_bytes(backward, (to_channels_last(gradient),
                                               to_channels_last(values), to_channels_last(weight)))
    assert channels_last == measured < plain


def test_inductor_lays_out_2d_convolutions_of_a_cnn_channels_last_and_3d_ones_not():
    """``inductor_channels_last`` names the convolutions and their backwards, as inductor's own
    ``decide_layout_opt`` decides on the module; 3D convolutions keep their layout."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w1, w2):
        hidden = aten.convolution.default(x, w1, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        out = aten.convolution.default(hidden.relu(), w2, None, [1, 1], [1, 1], [1, 1], False,
                                       [0, 0], 1)
        return aten.convolution_backward.default(out, hidden, w2, None, [1, 1], [1, 1], [1, 1],
                                                 False, [0, 0], 1, [True, True, False])

    arguments = (torch.randn(8, 16, 32, 32), torch.randn(64, 16, 3, 3), torch.randn(64, 64, 3, 3))
    module = make_fx(step, tracing_mode="fake")(*arguments)
    found = temporaries.inductor_channels_last(module)
    targets = sorted(str(node.target) for node in found)
    assert targets == ["aten.convolution.default"] * 2 + ["aten.convolution_backward.default"]
    three_d = make_fx(lambda x, w: aten.convolution.default(
        x, w, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], False, [0, 0, 0], 1), tracing_mode="fake")(
        torch.randn(2, 16, 8, 8, 8), torch.randn(16, 16, 3, 3, 3))
    assert temporaries.inductor_channels_last(three_d) == frozenset()
