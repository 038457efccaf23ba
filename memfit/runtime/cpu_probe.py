"""The CPU side of ``measure_hardware``: a profile of the CPU memfit runs on, in a few seconds.

What it times, each the median of interleaved repeats (a shared machine's load changes within
a second; the median of several runs of each probe is what a step sees):

- matmul FLOP/s per dtype (the median over matmuls shaped as a small model's layers, forward
  and backward, on operands no cache holds: ``MATMUL_SHAPES``; bfloat16 where this CPU has a
  fast path), the batched matmuls of attention as a fraction of it
  (``BATCHED_MATMUL_SHAPES``), and a small one's time beyond that rate (``compute_ramp_s``);
- convolution FLOP/s over a forward and its backward (both gradients), as a training step runs
  them, the median over a small CNN's stages (``CONVOLUTION_SHAPES``): the float32 peak is the
  faster of matmul's and convolution's rates, each class at its fraction of it
  (``compute_efficiency``);
- memory bandwidth as an elementwise add of activations' size sees it in a step: operands
  written a while before, a new output (what a memory-bound op of a step reaches);
- elements per second of memory-bound ops that compute more than they move
  (``Hardware.element_rates``), on cold operands into new outputs as the add's:
  transcendental functions (``tanh``, ``exp``, ``erf``), random draws (``bernoulli_``,
  dropout's mask), batch norm and layer norm in training, each over a forward and its
  backward (a training step runs both), and eager kernels of several passes
  (softmax, ``_safe_softmax``, dropout's backward), and the kernel inductor generates for
  attention's masked softmax (``compiled_softmax``);
- the per-op overhead of eager dispatch (a tiny transformer layer's ops back to back, called
  as ``OpOverload``s as compiled code calls them, per kernel, its views' calls apart: a view's
  own dispatch is ``view_overhead_s``), the same calls' extra time right after an op that
  streamed more than a core's cache (``cold_overhead_s``), and a swap's fixed time and
  speed each way as memfit's swap ops run it ("device" and "host" are one memory: a copy is
  a memcpy on the compute thread).

Sizes are those of the small models memfit plans on a CPU; the profile is measured on the
threads the caller runs (``torch.get_num_threads()``), which the notes record.
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from memfit.data.hardware import PROFILES, Hardware, available_host_bytes
from memfit.data.op_classes import COMPILED_SOFTMAX
from memfit.ops.engine_slot import active_engine
from memfit.ops.swap import SWAP_IN, SWAP_OUT, WAIT
from memfit.runtime.streams import CopyEngine

REPEATS = 7  # timed runs of each probe; the median is kept
# (batch, rows, inner, columns) of a small model's matmuls: a transformer's projections (a
# layer's forward, its input gradient and its weight gradient) and an MLP's
MATMUL_SHAPES = ((1, 2048, 128, 512), (1, 2048, 512, 128), (1, 128, 2048, 512),
                 (1, 512, 256, 256), (1, 256, 512, 256), (1, 2048, 128, 384))
# attention's batched matmuls at a head width of 32: scores, scores times values, a gradient
BATCHED_MATMUL_SHAPES = ((32, 256, 32, 256), (32, 256, 256, 32), (32, 32, 256, 256))
OPERAND_POOL_BYTES = 32 * 2**20  # more than a core's caches: each matmul reads cold operands
MAX_POOL_PAIRS = 16
ELEMENTS = 2**20  # the elements of each per-element probe
SMALL_MATMUL_SIDE = 48  # a small one: its time beyond the rate is the ramp
ELEMENTWISE_BYTES = 4 * 2**20  # each operand of the add and the copy
COMPILED_KERNEL_OVERHEAD_S = 2e-6  # estimate: a generated C++ kernel called from inductor's wrapper
# convolutions of a small CNN's stages (the side halves as the channels double): batch, channels
# in and out, side, kernel side; a convolution's rate depends on its channels (oneDNN's blocks)
CONVOLUTION_SHAPES = ((8, 16, 16, 56, 3), (8, 32, 32, 28, 3), (8, 64, 64, 14, 3))
LAYER_NORM_SHAPE = (4096, 256)  # rows (batch x sequence) and width of a small transformer's
ATTENTION_SCORES_SHAPE = (8, 4, 256, 256)  # batch, heads, queries, keys of a small transformer's


def median_time_s(operation: Callable[[], object], repeats: int = REPEATS,
                  inner: int = 1, before: Callable[[], object] | None = None) -> float:
    """The median over ``repeats`` timed runs of ``inner`` calls of ``operation``, per call,
    after one warm-up call; ``before``, where given, runs untimed before each timed run."""
    operation()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start_s = time.perf_counter()
        for _ in range(inner):
            operation()
        times.append((time.perf_counter() - start_s) / inner)
    return max(statistics.median(times), 1e-9)


def matmul_time_s(shape: tuple[int, int, int, int], dtype: torch.dtype) -> float:
    """The median time of one (rows x inner) @ (inner x columns) matmul in ``dtype``, batched
    ``batch`` times (``shape``: batch, rows, inner, columns; a batch of 1 is ``torch.mm``).

    A step's matmul reads operands another op wrote a while before, not the ones it read a
    moment ago: each call takes the next operand pair of a pool of ``OPERAND_POOL_BYTES``, so
    no call finds its operands in a cache the previous call warmed."""
    batch, rows, inner, columns = shape
    lead = (batch,) if batch > 1 else ()
    pair_bytes = batch * (rows * inner + inner * columns) * dtype.itemsize
    operands = cold_operands(lambda: (torch.randn(*lead, rows, inner).to(dtype),
                                      torch.randn(*lead, inner, columns).to(dtype)),
                             pair_bytes, most=MAX_POOL_PAIRS)
    multiply = torch.bmm if batch > 1 else torch.mm
    return median_time_s(lambda: multiply(*operands()))


def matmul_flops_per_s(dtype: torch.dtype, shapes=MATMUL_SHAPES) -> float:
    """The median rate over ``shapes``."""
    return statistics.median(2 * batch * rows * inner * columns
                             / matmul_time_s((batch, rows, inner, columns), dtype)
                             for batch, rows, inner, columns in shapes)


def cold_operands(make: Callable[[], Any], size_bytes: int,
                  most: int | None = None) -> Callable[[], Any]:
    """Operands as a step's op finds them: each call returns the next of a pool of ``make()``
    results (``size_bytes`` each) filling ``OPERAND_POOL_BYTES`` (at least 2, at most ``most``),
    written a while before, so no call reads what the previous call left in a cache."""
    count = max(2, OPERAND_POOL_BYTES // size_bytes)
    return itertools.cycle([make() for _ in range(min(count, most or count))]).__next__


def element_rates() -> dict[str, float]:
    """Elements per second of each element family: the median over a few of its ops, each
    reading cold operands into a new output as a step's op does (``cold_operands``)."""
    values = cold_operands(lambda: torch.randn(ELEMENTS), 4 * ELEMENTS)
    gradients = cold_operands(lambda: (torch.randn(ELEMENTS), torch.randn(ELEMENTS) > 0),
                              5 * ELEMENTS)
    probes = {
        "transcendental": (lambda: torch.tanh(values()), lambda: torch.exp(values()),
                           lambda: torch.erf(values())),
        "random": (lambda: torch.ops.aten.bernoulli.p(values(), 0.5),
                   lambda: torch.rand_like(values())),
        "dropout": (lambda: torch.ops.aten.native_dropout(values(), 0.5, True),),
        "dropout_backward": (
            lambda: torch.ops.aten.native_dropout_backward(*gradients(), 2.0),),
    }
    return {family: ELEMENTS / statistics.median(median_time_s(probe) for probe in family_probes)
            for family, family_probes in probes.items()}


def softmax_rates() -> dict[str, float]:
    """Elements per second of eager softmax over ``ATTENTION_SCORES_SHAPE`` (last dimension):
    ``_softmax`` and its backward as a training step runs both (twice the elements over the two
    times together), and ``_safe_softmax``'s forward alone (its backward is softmax's), on cold
    operands (``cold_operands``)."""
    size_bytes = 4 * torch.Size(ATTENTION_SCORES_SHAPE).numel()
    scores = cold_operands(lambda: torch.randn(*ATTENTION_SCORES_SHAPE), size_bytes)
    gradients = cold_operands(lambda: (torch.randn(*ATTENTION_SCORES_SHAPE),
                                       torch.softmax(torch.randn(*ATTENTION_SCORES_SHAPE), -1)),
                              2 * size_bytes)
    softmax_s = median_time_s(lambda: torch.ops.aten._softmax(scores(), -1, False)) + median_time_s(
        lambda: torch.ops.aten._softmax_backward_data(*gradients(), -1, torch.float32))
    safe_softmax_s = median_time_s(lambda: torch.ops.aten._safe_softmax(scores(), -1))
    elements = size_bytes // 4
    return {"softmax": 2 * elements / softmax_s, "safe_softmax": elements / safe_softmax_s}


def _masked_softmax(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Attention's probabilities as a transformer computes them: scaled scores plus a padding
    mask made from the batch's token mask (``tokens``, 1 for a token, 0 for padding)."""
    keep = tokens[:, None, None, :].bool()
    bias = torch.where(keep, 0.0, torch.finfo(scores.dtype).min)
    return torch.softmax(scores * scores.shape[-1] ** -0.5 + bias, -1)


@functools.cache
def _compiled_masked_softmax() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return torch.compile(_masked_softmax, backend="inductor", dynamic=False, fullgraph=True)


def compiled_softmax_rates() -> dict[str, float]:
    """Elements per second of the kernel inductor generates for attention's softmax
    (``_masked_softmax`` over ``ATTENTION_SCORES_SHAPE``, a quarter of each row padding), on
    cold operands: the ``compiled_softmax`` family. Compiled once per process (a second or
    more). ``{}`` where inductor cannot compile on this machine (no C++ compiler): such
    kernels are then priced op by op."""
    batch, _, _, keys = ATTENTION_SCORES_SHAPE
    tokens = torch.ones(batch, keys, dtype=torch.long)
    tokens[:, keys * 3 // 4:] = 0
    elements = torch.Size(ATTENTION_SCORES_SHAPE).numel()
    scores = cold_operands(lambda: torch.randn(*ATTENTION_SCORES_SHAPE), 4 * elements)
    softmax = _compiled_masked_softmax()
    try:
        time_s = median_time_s(lambda: softmax(scores(), tokens))
    except (torch._dynamo.exc.BackendCompilerFailed, RuntimeError, OSError):
        return {}
    return {COMPILED_SOFTMAX: elements / time_s}


def convolution_time_s(shape: tuple[int, int, int, int, int]) -> float:
    """The median time of a 3x3-style float32 convolution's forward plus its backward (the
    input's and the weight's gradients) at ``shape`` (batch, channels in and out, side, kernel
    side), padded to keep its size."""
    batch, channels_in, channels_out, side, kernel = shape
    images = torch.randn(batch, channels_in, side, side)
    weight = torch.randn(channels_out, channels_in, kernel, kernel)
    padding = [kernel // 2] * 2
    gradient = torch.randn(batch, channels_out, side, side)
    forward_s = median_time_s(lambda: torch.nn.functional.conv2d(images, weight,
                                                                 padding=kernel // 2))
    return forward_s + median_time_s(lambda: torch.ops.aten.convolution_backward(
        gradient, images, weight, None, [1, 1], padding, [1, 1], False, [0, 0], 1,
        [True, True, False]))


def convolution_flops_per_s(shapes=CONVOLUTION_SHAPES) -> float:
    """The median over ``shapes`` of a convolution's rate over its forward and its backward
    (three times the forward's FLOPs: the forward, the input's gradient, the weight's)."""
    return statistics.median(
        3 * 2 * batch * channels_out * side * side * channels_in * kernel * kernel
        / convolution_time_s((batch, channels_in, channels_out, side, kernel))
        for batch, channels_in, channels_out, side, kernel in shapes)


def normalization_rates() -> dict[str, float]:
    """Elements per second of batch norm (the middle of ``CONVOLUTION_SHAPES``' outputs, per
    channel) and layer norm (``LAYER_NORM_SHAPE``, per row) in training, on cold operands
    (``cold_operands``): a forward and its backward each make as many elements as their input,
    so the rate is twice the elements over the two times together."""
    batch, _, channels, side, _ = CONVOLUTION_SHAPES[1]
    image_shape = (batch, channels, side, side)
    image_bytes = 4 * torch.Size(image_shape).numel()
    images = cold_operands(lambda: torch.randn(*image_shape), image_bytes)
    image_pairs = cold_operands(lambda: (torch.randn(*image_shape), torch.randn(*image_shape)),
                                2 * image_bytes)
    scale, shift = torch.ones(channels), torch.zeros(channels)
    mean, variance = torch.zeros(channels), torch.ones(channels)
    _, saved_mean, saved_inverse, _, _ = torch.ops.aten._native_batch_norm_legit_functional(
        images(), scale, shift, mean, variance, True, 0.1, 1e-5)
    batch_norm_s = median_time_s(lambda: torch.ops.aten._native_batch_norm_legit_functional(
        images(), scale, shift, mean, variance, True, 0.1, 1e-5)) + median_time_s(
        lambda: torch.ops.aten.native_batch_norm_backward(
            *image_pairs(), scale, mean, variance, saved_mean, saved_inverse, True, 1e-5,
            [True, True, True]))
    row_bytes = 4 * torch.Size(LAYER_NORM_SHAPE).numel()
    rows = cold_operands(lambda: torch.randn(*LAYER_NORM_SHAPE), row_bytes)
    row_pairs = cold_operands(lambda: (torch.randn(*LAYER_NORM_SHAPE),
                                       torch.randn(*LAYER_NORM_SHAPE)), 2 * row_bytes)
    width = [LAYER_NORM_SHAPE[-1]]
    weight, bias = torch.ones(width), torch.zeros(width)
    _, row_mean, row_inverse = torch.ops.aten.native_layer_norm(rows(), width, weight, bias, 1e-5)
    layer_norm_s = median_time_s(lambda: torch.ops.aten.native_layer_norm(
        rows(), width, weight, bias, 1e-5)) + median_time_s(
        lambda: torch.ops.aten.native_layer_norm_backward(
            *row_pairs(), width, row_mean, row_inverse, weight, bias, [True, True, True]))
    return {"batch_norm": 2 * image_bytes / 4 / batch_norm_s,
            "layer_norm": 2 * row_bytes / 4 / layer_norm_s}


def elementwise_bytes_per_s(size_bytes: int = ELEMENTWISE_BYTES) -> float:
    """Memory bandwidth as a step's elementwise add sees it: it reads two operands another op
    wrote a while before (the next pair of a pool of ``OPERAND_POOL_BYTES``) into a new
    output."""
    operands = cold_operands(lambda: (torch.randn(size_bytes // 4), torch.randn(size_bytes // 4)),
                             2 * size_bytes)
    return 3 * size_bytes / median_time_s(lambda: torch.add(*operands()))


def swap_costs(size_bytes: int = ELEMENTWISE_BYTES) -> tuple[float, float, float]:
    """Swaps as a rewritten step runs them on this CPU: memfit's ``swap_out`` of several
    activations (``OPERAND_POOL_BYTES`` of them), each into a new host buffer, their copies all
    alive together until the backward, then ``swap_in`` and ``wait`` of each (into new tensors,
    alive together too), each called as an op. One buffer copied back and forth would reuse the
    same pages each time; a step's copies take new ones, which the kernel maps on their first
    write.

    Returns:
        The fixed time per copy (half of a tiny tensor's round trip: the ops' dispatch), and the
        bytes per second of a copy to the host and of one back, beyond that fixed time.
    """
    engine = CopyEngine("cpu")
    device = torch.device("cpu")
    count = max(2, OPERAND_POOL_BYTES // size_bytes)
    tiny = torch.ones(1)
    values = [torch.randn(size_bytes // 4) for _ in range(count)]
    with active_engine(engine):
        tiny_host, hosts = SWAP_OUT(tiny, 0), [SWAP_OUT(value, 0) for value in values]

        def back(copy: torch.Tensor) -> torch.Tensor:
            result = SWAP_IN(copy, 0, 1, device)
            WAIT(result, 1)
            return result

        round_trip_s = median_time_s(lambda: SWAP_OUT(tiny, 0), inner=20) + median_time_s(
            lambda: back(tiny_host), inner=20)
        out_s = median_time_s(lambda: [SWAP_OUT(value, 0) for value in values]) / count
        in_s = median_time_s(lambda: [back(host) for host in hosts]) / count
    latency_s = round_trip_s / 2
    return (latency_s, size_bytes / max(out_s - latency_s, 1e-9),
            size_bytes / max(in_s - latency_s, 1e-9))


def _tiny_layer(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A transformer layer's ops on tiny tensors, called as ``aot_eager``'s generated code calls
    them (``OpOverload``s, a Python call before the dispatcher each), views among its kernels
    as a captured graph has them: ``TINY_LAYER_KERNELS`` kernels, ``TINY_LAYER_VIEWS`` views."""
    aten = torch.ops.aten
    rows = aten.view.default(inputs, [-1, inputs.shape[-1]])
    projected = aten.addmm.default(bias, rows, aten.t.default(weight))
    summed = aten.add.Tensor(aten.view.default(projected, list(inputs.shape)), inputs)
    normed = aten.native_layer_norm.default(summed, [inputs.shape[-1]], bias, bias, 1e-5)[0]
    heads = aten.clone.default(aten.transpose.int(normed, 1, 2),
                               memory_format=torch.contiguous_format)
    scaled = aten.mul.Tensor(aten._softmax.default(heads, -1, False), 0.5)
    flat = aten._unsafe_view.default(aten.clone.default(aten.expand.default(
        scaled, list(scaled.shape))), [-1, scaled.shape[-1]])
    return aten.sum.dim_IntList(aten.relu.default(flat), [0], True)


TINY_LAYER_KERNELS = 9  # addmm, add, layer norm, clone, softmax, mul, clone, relu, sum
TINY_LAYER_VIEWS = 6  # view, t, view, transpose, expand, _unsafe_view


def view_overhead_s() -> float:
    """The fixed cost of an eager op that allocates nothing: the median over the kinds of view a
    captured transformer step has most of, each called as ``aot_eager``'s generated code calls
    it (an ``OpOverload``)."""
    aten = torch.ops.aten
    values, weight = torch.randn(2, 4, 8), torch.randn(8, 8)
    views = (lambda: aten.view.default(values, [8, 8]), lambda: aten.t.default(weight),
             lambda: aten.transpose.int(values, 1, 2),
             lambda: aten.expand.default(values, [2, 4, 8]),
             lambda: aten._unsafe_view.default(values, [8, 8]),
             lambda: aten.unsqueeze.default(values, 0))
    return statistics.median(median_time_s(view, inner=50) for view in views)


def cold_overhead_s() -> float:
    """The fixed time an eager op takes beyond its own overhead right after an op that streamed
    more than a core's cache through it: the tiny layer (``_tiny_layer``) timed right after an
    add over ``ELEMENTWISE_BYTES`` of cold operands (untimed), less its time back to back, per
    call (its kernels and views)."""
    inputs, weight, bias = torch.randn(2, 4, 8), torch.randn(8, 8), torch.randn(8)
    operands = cold_operands(lambda: torch.randn(ELEMENTWISE_BYTES // 4), ELEMENTWISE_BYTES)
    warm_s = median_time_s(lambda: _tiny_layer(inputs, weight, bias), inner=20)
    cold_s = median_time_s(lambda: _tiny_layer(inputs, weight, bias), repeats=3 * REPEATS,
                           before=lambda: operands().add_(1.0))
    return max(0.0, cold_s - warm_s) / (TINY_LAYER_KERNELS + TINY_LAYER_VIEWS)


def cache_bytes(default_bytes: int) -> int:
    """A core's L2 cache as the kernel reports it, else ``default_bytes``."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as size:
            text = size.read().strip()
    except OSError:
        return default_bytes
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except ValueError:
        return default_bytes


def op_overhead_s(view_s: float) -> float:
    """The fixed cost per eager kernel: a tiny transformer layer's ops (``_tiny_layer``) back
    to back, less its views' calls at ``view_s`` each, per kernel."""
    inputs, weight, bias = torch.randn(2, 4, 8), torch.randn(8, 8), torch.randn(8)
    layer_s = median_time_s(lambda: _tiny_layer(inputs, weight, bias), inner=20)
    return max(0.0, layer_s - TINY_LAYER_VIEWS * view_s) / TINY_LAYER_KERNELS


def measure_cpu() -> Hardware:
    """The CPU's profile (module docstring), named ``"measured-cpu"``, planning CPU runs."""
    base = PROFILES["cpu"]
    view_s = view_overhead_s()
    overhead_s = op_overhead_s(view_s)
    flops_per_s = {"float32": matmul_flops_per_s(torch.float32)}
    tiny = torch.randn(32, 32, dtype=torch.bfloat16)
    if median_time_s(lambda: tiny @ tiny, repeats=1) < 1e-3:  # slow bf16 paths take seconds
        flops_per_s["bfloat16"] = matmul_flops_per_s(torch.bfloat16, MATMUL_SHAPES[:1])
    small = (1,) + (SMALL_MATMUL_SIDE,) * 3
    small_s = matmul_time_s(small, torch.float32)
    ramp_s = max(0.0, small_s - 2 * SMALL_MATMUL_SIDE**3 / flops_per_s["float32"] - overhead_s)
    # the float32 peak is the faster of the two classes, each class at its fraction of it
    matmul_rate, convolution_rate = flops_per_s["float32"], convolution_flops_per_s()
    flops_per_s["float32"] = max(matmul_rate, convolution_rate)
    efficiency = {"matmul": matmul_rate / flops_per_s["float32"],
                  "batched_matmul": min(1.0, matmul_flops_per_s(torch.float32,
                                                                BATCHED_MATMUL_SHAPES)
                                        / flops_per_s["float32"]),
                  "convolution": convolution_rate / flops_per_s["float32"]}
    memory_bytes_per_s = elementwise_bytes_per_s()
    copy_latency_s, d2h_bytes_per_s, h2d_bytes_per_s = swap_costs()
    return base.with_(
        name="measured-cpu",
        flops_per_s=flops_per_s,
        compute_efficiency=efficiency,
        compute_ramp_s=ramp_s,
        memory_bytes_per_s=memory_bytes_per_s,
        memory_efficiency=1.0,
        element_rates={**element_rates(), **normalization_rates(), **softmax_rates(),
                       **compiled_softmax_rates()},
        d2h_bytes_per_s=d2h_bytes_per_s,
        h2d_bytes_per_s=h2d_bytes_per_s,
        copy_latency_s=copy_latency_s,
        duplex=False,
        async_copies=False,
        device_type="cpu",
        device_bytes=host_memory_bytes(base.device_bytes),
        host_bytes=available_host_bytes(),
        op_overhead_s=overhead_s,
        view_overhead_s=view_s,
        cold_overhead_s=cold_overhead_s(),
        cache_bytes=cache_bytes(base.cache_bytes),
        kernel_overhead_s=COMPILED_KERNEL_OVERHEAD_S,
        notes=f"measured on the CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads "
              f"timed): medians of {REPEATS}; {COMPILED_KERNEL_OVERHEAD_S * 1e6:g} us per "
              "compiled kernel is an estimate",
    )


def host_memory_bytes(default_bytes: int) -> int:
    """The machine's physical memory (the CPU "device"'s), else ``default_bytes``."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return default_bytes
