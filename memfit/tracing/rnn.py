"""``nn.LSTM`` traced with the kernels eager runs on a CPU: oneDNN's one-layer LSTM and its backward.

Eager CPU training sends ``aten::lstm`` to oneDNN when ATen's own test holds (``use_mkldnn`` in
``aten/src/ATen/native/RNN.cpp``: mkldnn enabled, CPU tensors, float32 or bfloat16, no
projections): one ``mkldnn_rnn_layer`` per layer and direction, whose autograd formula is
``mkldnn_rnn_layer_backward``. Traced, three things differ, and each breaks bit-for-bit equality:

1. torch's Python kernel for ``aten.lstm`` (``torch/_decomp/decompositions.py``, registered on the
   ``Autograd`` key, so AOTAutograd's tracing takes it) picks oneDNN for inference only: with an
   input that requires grad it unrolls the sequence into per-step ``linear``/``sigmoid``/``tanh``
   ops, with other rounding than oneDNN's fused cell. ``eager_lstm_kernels`` sets it aside
   while memfit traces, so ATen's own kernel traces the ops eager runs.
2. ``mkldnn_rnn_layer`` picks its training kernel, which fills the workspace its backward
   reads, by grad mode, not by its ``train`` argument; AOTAutograd runs the compiled forward
   without grad, where the kernel returns no workspace (and rounds differently).
   ``run_rnn_layers_for_training`` makes each layer of a training region run as eager's does.
3. The op's meta kernel gives the workspace 0 bytes; oneDNN's holds every gate value and state
   of the sequence. ``size_lstm_buffers`` gives the traced
   workspace its real size, so the planner counts, swaps and frees it; the kernels' own
   buffers are ``RNN_TEMPORARIES`` (``memfit.tracing.temporaries`` counts them).

Note:
    Dynamo skips a frame with an ``nn.LSTM`` unless ``torch._dynamo.config.allow_rnn``;
    ``memfit.fit`` sets it while its model runs and puts it back after. The flag lets Dynamo
    trace ``nn.GRU`` too, whose traced gradients are not eager's bit for bit (the in-place
    gate updates on views of one matmul's output become functional ops, and the backward
    sums in another order: 1.9e-6 apart); ``memfit.fit`` leaves it off for a model with one.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._C import DispatchKey

aten = torch.ops.aten
_LSTMS = (aten.lstm.input, aten.lstm.data)
_RNN_LAYER = aten.mkldnn_rnn_layer.default
_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
_WORKSPACE = 3  # mkldnn_rnn_layer returns (output, hy, cy, workspace)
_BIAS_GRADIENTS = (3, 4)  # its backward returns (dx, dw_ih, dw_hh, db_ih, db_hh, dhx, dcx)


@contextlib.contextmanager
def eager_lstm_kernels() -> Iterator[None]:
    """While tracing, ``aten.lstm`` runs ATen's own composite kernel, the code eager runs: on a
    CPU one ``mkldnn_rnn_layer`` per layer and direction where ATen's ``use_mkldnn`` holds, its
    cell loop elsewhere (projections, float64, packed sequences). torch's Python kernels, which
    tracing takes otherwise, are put back after.

    Note:
        The kernels of an op are process-wide: a trace in another thread meanwhile traces the
        LSTM as eager runs it too.
    """
    saved = {(op, key): op.py_kernels.pop(key) for op in _LSTMS for key in _KEYS
             if key in op.py_kernels}
    for op in _LSTMS:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for (op, key), kernel in saved.items():
            op.py_kernels[key] = kernel
        for op in _LSTMS:
            op._dispatch_cache.clear()


def rnn_layer_for_training(*args: Any) -> tuple[torch.Tensor, ...]:
    """``mkldnn_rnn_layer`` with its training kernel, as eager runs it under autograd: grad
    mode on (the kernel's test), inputs detached so nothing is recorded."""
    detached = [arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args]
    with torch.enable_grad():
        return _RNN_LAYER(*detached)


def run_rnn_layers_for_training(graph: fx.Graph) -> int:
    """Make each oneDNN LSTM layer of ``graph``, a forward or backward module of a training
    region, run its training kernel, as eager does under autograd; returns how many.

    Note:
        Every layer, also one whose workspace the plan does not save (it is recomputed in the
        backward): the inference kernel rounds differently, so a forward that ran it would
        not be eager's. An inference region (no backward) is not passed here and keeps the
        inference kernel that eager runs without grad.
    """
    layers = graph.find_nodes(op="call_function", target=_RNN_LAYER)
    for node in layers:
        node.target = rnn_layer_for_training
    return len(layers)


def size_lstm_buffers(graph: fx.Graph, num_fwd_outputs: int) -> None:
    """Give the traced oneDNN layers of a joint graph the buffers eager's kernels make, so the
    planner counts them: each workspace that is read its real size (the meta kernel's is empty),
    and each backward's second bias gradient its own storage."""
    for node in graph.find_nodes(op="call_function", target=_RNN_LAYER):
        _size_workspace(node)
    for node in graph.find_nodes(op="call_function",
                                 target=aten.mkldnn_rnn_layer_backward.default):
        _own_bias_gradients(graph, node, num_fwd_outputs)


def _own_bias_gradients(graph: fx.Graph, node: fx.Node, num_fwd_outputs: int) -> None:
    """The meta kernel returns one tensor for both bias gradients where the kernel returns the
    gradient and a clone of it. Traced so, the joint graph returns the clone for both biases (a
    trace that meets the fake-tensor cache gets two, so plans of one model would differ by the
    bias bytes): give the clone its own fake storage and return each gradient to its bias."""
    first_index, second_index = _BIAS_GRADIENTS
    value = list(node.meta["val"])
    first, second = value[first_index], value[second_index]
    if _storage(first) == _storage(second):
        with first.fake_mode:
            value[second_index] = torch.empty_like(first)
        node.meta["val"] = tuple(value)
    getters = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    if second_index in getters:
        getters[second_index].meta["val"] = value[second_index]
    if first_index in getters or second_index not in getters:
        return
    output = graph.find_nodes(op="output")[0]
    primals = [p for p in graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
    position = num_fwd_outputs + primals.index(node.args[first_index]) \
        if node.args[first_index] in primals else None
    results = list(output.args[0])
    if position is None or results[position] is not getters[second_index]:
        return
    with graph.inserting_after(getters[second_index]):
        results[position] = graph.call_function(operator.getitem, (node, first_index))
    results[position].meta.update(getters[second_index].meta)
    results[position].meta["val"] = value[first_index]
    output.args = (tuple(results), *output.args[1:])


def _size_workspace(node: fx.Node) -> None:
    getters = _workspace_nodes(node, read=False)
    if not any(getter.users for getter in getters):
        return
    traced = node.meta["val"][_WORKSPACE]
    size = workspace_bytes(*(_signature(arg) for arg in node.args))
    if traced.numel() == size:
        return
    with traced.fake_mode:
        real = torch.empty(size, dtype=torch.uint8, device=traced.device)
    node.meta["val"] = (*node.meta["val"][:_WORKSPACE], real)
    for getter in getters:
        getter.meta["val"] = real


def _workspace_nodes(node: fx.Node, read: bool) -> list[fx.Node]:
    return [user for user in node.users
            if user.target is operator.getitem and user.args[1] == _WORKSPACE
            and (user.users or not read)]


def _signature(argument: Any) -> Any:
    """A hashable stand-in for an argument: (shape, dtype) for a tensor."""
    if isinstance(argument, fx.Node):
        value = argument.meta["val"]
        return (tuple(value.shape), value.dtype)
    return tuple(argument) if isinstance(argument, list) else argument


@functools.lru_cache(maxsize=64)
def workspace_bytes(*signature: Any) -> int:
    """The bytes of oneDNN's workspace for a layer of this signature, from one run of the layer
    on zeros.

    Note:
        oneDNN sizes the workspace from its primitive descriptor (leading dimensions padded,
        each part page aligned, depending on the CPU's instruction set); Python cannot ask the
        descriptor without running the layer. The run holds the layer's input, output and
        workspace, which the planned step holds at that layer too, so it needs no more memory
        than the plan already allows there; it is made once per shape, on real tensors (outside
        the fake mode the planner runs in).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        arguments = [torch.zeros(item[0], dtype=item[1]) if _is_tensor_signature(item) else item
                     for item in signature]
        return rnn_layer_for_training(*arguments)[_WORKSPACE].numel()


def _is_tensor_signature(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.dtype)


# ---- bytes oneDNN's LSTM kernels allocate for themselves (measured on torch 2.13, AVX2) ---------
#
# Beside its outputs, a layer holds: the sum of its two biases, its weights reordered into
# oneDNN's layout (leading dimensions padded: ``_padded``), and a scratchpad holding the gates
# of every step (of one step in a forward with a batch of 128 or more) and two state buffers,
# each part page aligned. The backward also holds zeros for each missing output gradient, a
# contiguous copy of a strided output gradient, a copy of ``cx`` when it shares ``hx``'s
# storage, and, where padding makes them differ, the weights in a second, transposed layout.
# A weight with one row (an input of one feature, a hidden state of one) is not reordered in
# the forward and reordered unpadded in the backward. ``tests/graph/test_rnn.py`` runs both
# ops alone under the allocator.

_PAGE_BYTES = 4096
_SCRATCH_FIXED_BYTES = _PAGE_BYTES + 568  # measured, the same for every shape and thread count
_FLOAT_BYTES = 4
_MERGED_GATES_MAX_BATCH = 127  # a forward with a larger batch computes gates step by step


def _padded(count: int) -> int:
    """oneDNN's leading dimension for ``count`` floats: a multiple of 16 (one cache line), one
    line more where it is a multiple of 256 (to avoid cache-set aliasing)."""
    padded = -(-count // 16) * 16
    return padded + 16 if padded % 256 == 0 else padded


def _pages(size_bytes: int) -> int:
    return -(-size_bytes // _PAGE_BYTES) * _PAGE_BYTES


def _layer_shape(node: fx.Node) -> tuple[int, int, int, int]:
    """(steps, batch, input size, hidden size) of a traced layer or its backward."""
    steps, batch, inputs = _schema_argument(node, "input").shape
    return steps, batch, inputs, _schema_argument(node, "hidden_size")


def _schema_argument(node: fx.Node, name: str) -> Any:
    assert isinstance(node.target, torch._ops.OpOverload)
    names = [argument.name for argument in node.target._schema.arguments]
    index = names.index(name)
    argument = node.args[index] if index < len(node.args) else node.kwargs[name]
    return argument.meta.get("val") if isinstance(argument, fx.Node) else argument


def _common_bytes(node: fx.Node, forward: bool) -> int:
    """The summed bias, the reordered weights and the scratchpad."""
    steps, batch, inputs, hidden = _layer_shape(node)
    gates = _padded(4 * hidden)
    one_row = 0 if forward else 4 * hidden
    reordered = sum(size * gates if size > 1 else one_row for size in (inputs, hidden))
    reordered *= _FLOAT_BYTES
    merged = not forward or batch <= _MERGED_GATES_MAX_BATCH
    gate_bytes = (steps if merged else 1) * batch * gates * _FLOAT_BYTES
    state_bytes = batch * _padded(hidden) * _FLOAT_BYTES
    scratch = _pages(gate_bytes) + 2 * _pages(state_bytes) + _SCRATCH_FIXED_BYTES
    return 4 * hidden * _FLOAT_BYTES + reordered + scratch


def _layer_forward_bytes(node: fx.Node) -> int:
    if not _is_float(node) or not _workspace_nodes(node, read=True):
        return 0  # the inference kernel (no workspace) was not measured
    return _common_bytes(node, forward=True)


def _layer_backward_bytes(node: fx.Node) -> int:
    if not _is_float(node):
        return 0
    steps, batch, inputs, hidden = _layer_shape(node)
    state = batch * hidden * _FLOAT_BYTES
    gradient = _schema_argument(node, "grad_output")
    extra = sum(state for name in ("grad_hy", "grad_cy")
                if _schema_argument(node, name) is None)
    if gradient is None or not gradient.is_contiguous():
        extra += steps * batch * hidden * _FLOAT_BYTES
    hx, cx = _schema_argument(node, "hx_"), _schema_argument(node, "cx_tmp")
    if _storage(hx) == _storage(cx):
        extra += state
    transposed = sum(4 * hidden * _padded(size) for size in (inputs, hidden)
                     if _padded(size) != size) * _FLOAT_BYTES
    # oneDNN's bias-gradient buffer (one bias's bytes) is alive at the peak, and the clone of
    # the bias gradient, an output, is made only after it: the two cancel
    return extra + transposed + _common_bytes(node, forward=False)


def _storage(tensor: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


def _is_float(node: fx.Node) -> bool:
    return _schema_argument(node, "input").dtype == torch.float32


RNN_TEMPORARIES: dict[object, Callable[[fx.Node], int]] = {
    _RNN_LAYER: _layer_forward_bytes,
    aten.mkldnn_rnn_layer_backward.default: _layer_backward_bytes,
}
