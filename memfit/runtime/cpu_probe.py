"""The CPU side of ``measure_hardware``: a profile of the CPU memfit runs on, in a few seconds.

What it times, each the median of interleaved repeats (a shared machine's load changes within
a second; the median of several runs of each probe is what a step sees):

- matmul FLOP/s per dtype (the median over matmuls shaped as a small model's layers, forward
  and backward: ``MATMUL_SHAPES``; bfloat16 where this CPU has a fast path), and a small one's
  time beyond that rate (``compute_ramp_s``);
- convolution FLOP/s over a forward and its backward (both gradients), as a training step runs
  them, the median over a small CNN's stages (``CONVOLUTION_SHAPES``): the float32 peak is the
  faster of matmul's and convolution's rates, each class at its fraction of it
  (``compute_efficiency``);
- memory bandwidth as an elementwise add of activations' size sees it (what a memory-bound op
  of a step reaches, caches included);
- elements per second of memory-bound ops that compute more than they move
  (``Hardware.element_rates``): transcendental functions (``tanh``, ``exp``, ``erf``), random
  draws (``bernoulli_``, dropout's mask), and batch norm and layer norm in training, each over
  a forward and its backward (a training step runs both);
- the per-op overhead of eager dispatch (tiny adds back to back, called as an ``OpOverload``
  as compiled code calls them), and the copy speed (a memcpy
  of the same size: "device" and "host" are one memory, copies run on the compute thread).

Sizes are those of the small models memfit plans on a CPU; the profile is measured on the
threads the caller runs (``torch.get_num_threads()``), which the notes record.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from memfit.data.hardware import PROFILES, Hardware, available_host_bytes

REPEATS = 7  # timed runs of each probe; the median is kept
# (rows, inner, columns): a layer's forward, its input gradient and its weight gradient
MATMUL_SHAPES = ((2048, 128, 512), (2048, 512, 128), (128, 2048, 512))
ELEMENTS = 2**20  # the elements of each per-element probe
SMALL_MATMUL_SIDE = 48  # a small one: its time beyond the rate is the ramp
ELEMENTWISE_BYTES = 4 * 2**20  # each operand of the add and the copy
COMPILED_KERNEL_OVERHEAD_S = 2e-6  # estimate: a generated C++ kernel called from inductor's wrapper
# convolutions of a small CNN's stages (the side halves as the channels double): batch, channels
# in and out, side, kernel side; a convolution's rate depends on its channels (oneDNN's blocks)
CONVOLUTION_SHAPES = ((8, 16, 16, 56, 3), (8, 32, 32, 28, 3), (8, 64, 64, 14, 3))
LAYER_NORM_SHAPE = (4096, 256)  # rows (batch x sequence) and width of a small transformer's


def median_time_s(operation: Callable[[], object], repeats: int = REPEATS,
                  inner: int = 1) -> float:
    """The median over ``repeats`` timed runs of ``inner`` calls of ``operation``, per call,
    after one warm-up call."""
    operation()
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        for _ in range(inner):
            operation()
        times.append((time.perf_counter() - start_s) / inner)
    return max(statistics.median(times), 1e-9)


def matmul_time_s(shape: tuple[int, int, int], dtype: torch.dtype) -> float:
    """The median time of one (rows x inner) @ (inner x columns) matmul in ``dtype``."""
    rows, inner, columns = shape
    left = torch.randn(rows, inner).to(dtype)
    right = torch.randn(inner, columns).to(dtype)
    calls = max(1, int(2e7 // (rows * inner * columns)))
    return median_time_s(lambda: torch.mm(left, right), inner=calls)


def matmul_flops_per_s(dtype: torch.dtype, shapes=MATMUL_SHAPES) -> float:
    """The median rate over ``shapes``."""
    return statistics.median(2 * rows * inner * columns / matmul_time_s((rows, inner, columns),
                                                                         dtype)
                             for rows, inner, columns in shapes)


def element_rates() -> dict[str, float]:
    """Elements per second of each element family: the median over a few of its ops."""
    values = torch.randn(ELEMENTS)
    out = torch.empty_like(values)
    probes = {
        "transcendental": (lambda: torch.tanh(values, out=out), lambda: torch.exp(values, out=out),
                           lambda: torch.erf(values, out=out)),
        "random": (lambda: out.bernoulli_(0.5), lambda: out.uniform_()),
    }
    return {family: ELEMENTS / statistics.median(median_time_s(probe) for probe in family_probes)
            for family, family_probes in probes.items()}


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
    channel) and layer norm (``LAYER_NORM_SHAPE``, per row) in training: a forward and its
    backward each make as many elements as their input, so the rate is twice the elements over
    the two times together."""
    batch, _, channels, side, _ = CONVOLUTION_SHAPES[1]
    images = torch.randn(batch, channels, side, side)
    scale, shift = torch.ones(channels), torch.zeros(channels)
    mean, variance = torch.zeros(channels), torch.ones(channels)
    _, saved_mean, saved_inverse, _, _ = torch.ops.aten._native_batch_norm_legit_functional(
        images, scale, shift, mean, variance, True, 0.1, 1e-5)
    batch_norm_s = median_time_s(lambda: torch.ops.aten._native_batch_norm_legit_functional(
        images, scale, shift, mean, variance, True, 0.1, 1e-5)) + median_time_s(
        lambda: torch.ops.aten.native_batch_norm_backward(
            images, images, scale, mean, variance, saved_mean, saved_inverse, True, 1e-5,
            [True, True, True]))
    rows = torch.randn(*LAYER_NORM_SHAPE)
    width = [LAYER_NORM_SHAPE[-1]]
    weight, bias = torch.ones(width), torch.zeros(width)
    _, row_mean, row_inverse = torch.ops.aten.native_layer_norm(rows, width, weight, bias, 1e-5)
    layer_norm_s = median_time_s(lambda: torch.ops.aten.native_layer_norm(
        rows, width, weight, bias, 1e-5)) + median_time_s(
        lambda: torch.ops.aten.native_layer_norm_backward(
            rows, rows, width, row_mean, row_inverse, weight, bias, [True, True, True]))
    return {"batch_norm": 2 * images.numel() / batch_norm_s,
            "layer_norm": 2 * rows.numel() / layer_norm_s}


def elementwise_bytes_per_s(size_bytes: int = ELEMENTWISE_BYTES) -> tuple[float, float]:
    """Memory bandwidth as an elementwise add sees it (reads two operands, writes one), and a
    copy's rate in bytes copied per second (a memcpy reads and writes each byte)."""
    left = torch.randn(size_bytes // 4)
    right, out = torch.randn_like(left), torch.empty_like(left)
    add_s = median_time_s(lambda: torch.add(left, right, out=out), inner=4)
    copy_s = median_time_s(lambda: out.copy_(left), inner=4)
    return 3 * size_bytes / add_s, size_bytes / copy_s


def op_overhead_s() -> float:
    """The time of a tiny op back to back, called as ``aot_eager``'s generated code calls each
    op (an ``OpOverload``, ``torch.ops.aten.add.Tensor``, a Python call before the dispatcher):
    the fixed cost per eager op."""
    one = torch.ones(1)
    add = torch.ops.aten.add.Tensor
    return median_time_s(lambda: add(one, one), inner=200)


def measure_cpu() -> Hardware:
    """The CPU's profile (module docstring), named ``"measured-cpu"``, planning CPU runs."""
    base = PROFILES["cpu"]
    overhead_s = op_overhead_s()
    flops_per_s = {"float32": matmul_flops_per_s(torch.float32)}
    tiny = torch.randn(32, 32, dtype=torch.bfloat16)
    if median_time_s(lambda: tiny @ tiny, repeats=1) < 1e-3:  # slow bf16 paths take seconds
        flops_per_s["bfloat16"] = matmul_flops_per_s(torch.bfloat16, MATMUL_SHAPES[:1])
    small = (SMALL_MATMUL_SIDE,) * 3
    small_s = matmul_time_s(small, torch.float32)
    ramp_s = max(0.0, small_s - 2 * SMALL_MATMUL_SIDE**3 / flops_per_s["float32"] - overhead_s)
    # the float32 peak is the faster of the two classes, each class at its fraction of it
    matmul_rate, convolution_rate = flops_per_s["float32"], convolution_flops_per_s()
    flops_per_s["float32"] = max(matmul_rate, convolution_rate)
    efficiency = {"matmul": matmul_rate / flops_per_s["float32"],
                  "convolution": convolution_rate / flops_per_s["float32"]}
    memory_bytes_per_s, copy_bytes_per_s = elementwise_bytes_per_s()
    return base.with_(
        name="measured-cpu",
        flops_per_s=flops_per_s,
        compute_efficiency=efficiency,
        compute_ramp_s=ramp_s,
        memory_bytes_per_s=memory_bytes_per_s,
        memory_efficiency=1.0,
        element_rates={**element_rates(), **normalization_rates()},
        d2h_bytes_per_s=copy_bytes_per_s,
        h2d_bytes_per_s=copy_bytes_per_s,
        duplex=False,
        async_copies=False,
        device_type="cpu",
        device_bytes=host_memory_bytes(base.device_bytes),
        host_bytes=available_host_bytes(),
        op_overhead_s=overhead_s,
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
