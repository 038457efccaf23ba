"""oneDNN's LSTM layer as memfit traces, sizes and runs it (``memfit.tracing.rnn``)."""

import pytest
import torch
from torch._C import DispatchKey
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.runtime.measure import allocator_peak_above_start
from memfit.tracing import rnn
from memfit.tracing.temporaries import kernel_temporary_bytes

aten = torch.ops.aten

# (steps, batch, input size, hidden size): the example's layer, odd sizes, an input of one
# feature (its weight is not reordered), a 256-wide hidden state (padded leading dimensions,
# the transposed weight copy in the backward), a forward batch of 130 (gates step by step)
SHAPES = [(16, 8, 64, 64), (5, 3, 7, 11), (3, 4, 1, 16), (2, 3, 16, 256), (4, 130, 8, 8)]


def layer_arguments(steps, batch, inputs, hidden, shared_state=False):
    tensors = (torch.randn(steps, batch, inputs), torch.randn(4 * hidden, inputs),
               torch.randn(4 * hidden, hidden), torch.randn(4 * hidden), torch.randn(4 * hidden),
               torch.randn(batch, hidden))
    cell = tensors[-1] if shared_state else torch.randn(batch, hidden)
    return (*tensors, cell)


def layer(x, w_ih, w_hh, b_ih, b_hh, h, c):
    return aten.mkldnn_rnn_layer.default(x, w_ih, w_hh, b_ih, b_hh, h, c, False, [], 2,
                                         h.shape[-1], 1, True, False, False, True)


def layer_backward(arguments, outputs, gradient, gradient_state):
    return aten.mkldnn_rnn_layer_backward.default(
        *arguments, outputs[0], outputs[1], outputs[2], gradient, gradient_state, None, False, 2,
        arguments[5].shape[-1], 1, True, True, False, [], False, outputs[3])


def traced_layer_and_backward(arguments, gradient, gradient_state):
    """The two nodes with fake values, the layer's workspace read by its backward (training)."""
    def step(*values):
        outputs = layer(*values[:7])
        return layer_backward(values[:7], outputs, values[7], values[8])

    module = make_fx(step, tracing_mode="fake")(*arguments, gradient, gradient_state)
    (forward,) = module.graph.find_nodes(op="call_function", target=aten.mkldnn_rnn_layer.default)
    (backward,) = module.graph.find_nodes(op="call_function",
                                          target=aten.mkldnn_rnn_layer_backward.default)
    return forward, backward


def new_storage_bytes(results, arguments) -> int:
    seen = {a.untyped_storage().data_ptr() for a in arguments if isinstance(a, torch.Tensor)}
    owned = {r.untyped_storage().data_ptr(): r.untyped_storage().nbytes() for r in results
             if isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() not in seen}
    return sum(owned.values())


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided_gradient, shared_state", [(False, False), (True, True)])
def test_layer_temporaries_match_the_allocator(shape, strided_gradient, shared_state):
    """The training kernel's and its backward's own buffers, by the CPU allocator: summed bias,
    reordered weights, scratchpad; and in the backward zeros for missing state gradients, a
    contiguous copy of a strided gradient, a copy of a cell state sharing the hidden one's
    storage."""
    steps, batch, _, hidden = shape
    arguments = layer_arguments(*shape, shared_state=shared_state)
    outputs, peak_bytes = allocator_peak_above_start(
        lambda: rnn.rnn_layer_for_training(*arguments, False, [], 2, hidden, 1, True, False,
                                           False, True))
    gradient = (torch.randn(batch, steps, hidden).transpose(0, 1) if strided_gradient
                else torch.randn(steps, batch, hidden))
    gradient_state = None if shared_state else torch.randn(batch, hidden)
    forward, backward = traced_layer_and_backward(arguments, gradient, gradient_state)
    assert peak_bytes - new_storage_bytes(outputs, arguments) == kernel_temporary_bytes(forward)

    results, peak_bytes = allocator_peak_above_start(
        lambda: layer_backward(arguments, outputs, gradient, gradient_state))
    assert (peak_bytes - new_storage_bytes(results, (*arguments, *outputs, gradient))
            == kernel_temporary_bytes(backward) > 0)


def test_workspace_gets_the_size_the_kernel_gives_it():
    """The meta kernel's workspace is empty; ``size_lstm_buffers`` gives the traced one the
    training kernel's bytes, for the joint graph's forward layer whose backward reads it."""
    arguments = layer_arguments(16, 8, 32, 64)
    forward, backward = traced_layer_and_backward(arguments, torch.randn(16, 8, 64), None)
    assert forward.meta["val"][3].numel() == 0
    rnn.size_lstm_buffers(forward.graph, num_fwd_outputs=0)
    workspace = rnn.rnn_layer_for_training(*arguments, False, [], 2, 64, 1, True, False, False,
                                           True)[3]
    assert forward.meta["val"][3].numel() == workspace.numel() > 0
    (getter,) = (user for user in forward.users if user.args[1] == 3)
    assert getter.meta["val"] is forward.meta["val"][3]


def test_training_kernel_is_the_one_eager_runs_under_autograd():
    """Without grad mode the layer takes its inference kernel (no workspace); the wrapper takes
    the training kernel: eager's outputs under autograd, bit for bit, and a workspace of the
    same size (its padding is not written, so its bytes are not compared). At this shape the
    inference kernel's outputs were 5e-6 from the training kernel's (AVX2)."""
    arguments = layer_arguments(16, 8, 64, 64)
    with torch.no_grad():
        assert layer(*arguments)[3] is None
        wrapped = rnn.rnn_layer_for_training(*arguments, False, [], 2, 64, 1, True, False, False,
                                             True)
    eager = layer(*[a.clone().requires_grad_() for a in arguments])
    assert not wrapped[0].requires_grad and wrapped[3].shape == eager[3].shape
    for mine, expected in zip(wrapped[:3], eager[:3], strict=True):
        assert torch.equal(mine, expected)


def test_torchs_lstm_kernels_are_put_back():
    before = {op: dict(op.py_kernels) for op in (aten.lstm.input, aten.lstm.data)}
    assert DispatchKey.Autograd in before[aten.lstm.input]  # what tracing takes otherwise
    with pytest.raises(RuntimeError, match="inside"):
        with rnn.eager_lstm_kernels():
            assert DispatchKey.Autograd not in aten.lstm.input.py_kernels
            raise RuntimeError("inside")
    assert {op: dict(op.py_kernels) for op in before} == before
