"""measure_hardware: fill in a ``Hardware`` profile by timing the machine at hand.

Example:
    >>> hardware = measure_hardware()          # the CUDA device if there is one, else the CPU
    >>> hardware.flops_per_s["bfloat16"], hardware.h2d_pageable_bytes_per_s
    >>> hardware.save("h100.json")             # plan with Hardware.load("h100.json") anywhere

Note:
    Each figure is the best of a few repeats of one large operation, so it is a sustained rate,
    which the profile stores at efficiency 1: on CUDA a matmul per dtype (float32 with TF32 off
    and on, bfloat16, float16), a small matmul (the ramp of small kernels), a large elementwise
    add (memory bandwidth), tiny ops back to back (per-op overhead), and pinned and pageable
    copies both ways. On a CPU it measures the CPU, the device memfit runs on there (a CPU
    profile plans CPU runs; for a GPU you do not have, use a built-in profile or one saved on
    that GPU): ``memfit.runtime.cpu_probe``, medians of a few seconds' probes (matmul and
    convolution rates, memory bandwidth, per-op overhead, copy speed); copies between "device"
    and "host" are memcpys on the compute thread, hence ``async_copies=False``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from memfit.data.hardware import PROFILES, TENSOR_FLOAT32, Hardware, available_host_bytes
from memfit.runtime.cpu_probe import measure_cpu

# A combined (both directions at once) rate at least this many times one direction's means the
# link is full duplex; 2.0 is perfect, PCIe hosts usually reach 1.6-1.9.
DUPLEX_RATIO = 1.5


def measure_hardware(device: torch.device | str | None = None) -> Hardware:
    """Measure FLOP/s, memory bandwidth and host-link bandwidth of ``device``.

    Args:
        device: the device to measure; defaults to the current CUDA device if there is one,
            else the CPU.

    Returns:
        A ``Hardware`` named ``"measured-cpu"`` or ``"measured-<device name>"``; on CUDA its
        TF32 switches are PyTorch's at the time (``torch.backends.cuda.matmul.allow_tf32``,
        ``torch.backends.cudnn.allow_tf32``); its ``host_bytes`` the RAM available at the
        time (``available_host_bytes``), the host memory swaps may take on this machine.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(device)
    return measure_cpu()


def _best_time_s(operation: Callable[[], object], synchronize: Callable[[], None], repeats: int) -> float:
    """The fastest of ``repeats`` timed runs of ``operation``, after one warm-up run."""
    operation()
    synchronize()
    best_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        operation()
        synchronize()
        best_s = min(best_s, time.perf_counter() - start_s)
    return max(best_s, 1e-9)


def _matmul_flops_per_s(size: int, dtype: torch.dtype, device: torch.device, sync, repeats: int) -> float:
    left = torch.randn(size, size, device=device).to(dtype)
    right = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _best_time_s(lambda: left @ right, sync, repeats)


def _copy_bytes_per_s(size_bytes: int, device: torch.device, sync, repeats: int) -> float:
    """Device memory bandwidth: a copy reads and writes ``size_bytes`` each."""
    source = torch.empty(size_bytes // 4, device=device)
    target = torch.empty_like(source)
    return 2 * size_bytes / _best_time_s(lambda: target.copy_(source), sync, repeats)


# the dtypes whose matmul rate a CUDA probe measures, and the flops_per_s key of each
_CUDA_MATMULS = {"float32": torch.float32, TENSOR_FLOAT32: torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}


class ProbeSizes(NamedTuple):
    """How large the CUDA probe's operations are: large enough for sustained rates."""

    matmul: int = 8192  # a square matmul's side: a large one shows the rate
    small_matmul: int = 1024  # a small one's time shows the ramp
    memory_bytes: int = 2**30  # each operand of the elementwise add
    link_bytes: int = 256 * 2**20  # each host copy


CUDA_SIZES = ProbeSizes()


def _measure_cuda(device: torch.device, sizes: ProbeSizes = CUDA_SIZES) -> Hardware:
    """Time the device: large matmuls per dtype (the peaks, at the efficiency cuBLAS reaches),
    a small one (the ramp), a large elementwise add (memory bandwidth), tiny adds back to back
    (the per-op overhead), pinned and pageable copies both ways (the host link).

    The measured matmul rate is stored as each dtype's peak with a matmul efficiency of 1; the
    other classes keep their fraction *relative to matmul* from the closest built-in profile
    (``closest_profile``), as the probe does not time convolutions, attention or RNNs.
    """
    def sync() -> None:
        torch.cuda.synchronize(device)

    flops_per_s = {key: _cuda_matmul_flops_per_s(key, dtype, sizes.matmul, device, sync)
                   for key, dtype in _CUDA_MATMULS.items()}
    overhead_s = _per_op_time_s(lambda out: torch.add(out, 1, out=out), 1, device, sync)
    small_flops = 2 * sizes.small_matmul**3
    small_s = _per_op_time_s(lambda out: torch.mm(out, out), sizes.small_matmul, device, sync,
                             torch.bfloat16)
    ramp_s = max(0.0, small_s - small_flops / flops_per_s["bfloat16"] - overhead_s)
    link = measure_link(device, sizes.link_bytes)
    pageable = measure_pageable_link(device, sizes.link_bytes)
    properties = torch.cuda.get_device_properties(device)
    base = closest_profile(properties.name)
    return Hardware(
        name=f"measured-{properties.name}",
        flops_per_s=flops_per_s,
        memory_bytes_per_s=_elementwise_bytes_per_s(sizes.memory_bytes, device, sync),
        d2h_bytes_per_s=link.d2h_bytes_per_s,
        h2d_bytes_per_s=link.h2d_bytes_per_s,
        duplex=link.duplex,
        async_copies=True,
        device_bytes=properties.total_memory,
        op_overhead_s=overhead_s,
        compute_efficiency=_relative_to_matmul(base.compute_efficiency),
        memory_efficiency=1.0,
        compute_ramp_s=ramp_s,
        tf32_matmuls=torch.backends.cuda.matmul.allow_tf32,
        tf32_cudnn=torch.backends.cudnn.allow_tf32,
        d2h_pageable_bytes_per_s=pageable[0],
        h2d_pageable_bytes_per_s=pageable[1],
        host_bytes=available_host_bytes(),
        device_type=device.type,
        notes=f"measured on {properties.name}; convolution, attention and RNN efficiencies "
              f"relative to matmul from the {base.name!r} profile",
    )


def closest_profile(device_name: str) -> Hardware:
    """The built-in profile for a CUDA device name (``"NVIDIA H100 PCIe"``), else ``h100-sxm``."""
    name = device_name.lower()
    for marker, profile in (("gh200", "gh200"), ("h200", "h200"), ("h100 pcie", "h100-pcie"),
                            ("h100", "h100-sxm"), ("a100", "a100")):
        if marker in name:
            return PROFILES[profile]
    return PROFILES["h100-sxm"]


def _relative_to_matmul(efficiency: Mapping[str, float]) -> dict[str, float]:
    matmul = efficiency.get("matmul", 1.0)
    return {name: min(1.0, value / matmul) for name, value in efficiency.items()}


def _cuda_matmul_flops_per_s(key: str, dtype: torch.dtype, size: int, device: torch.device,
                             sync) -> float:
    """A matmul's rate, float32 with TF32 off (``"float32"``) or on (``"tfloat32"``); PyTorch's
    TF32 switch is put back after."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = key == TENSOR_FLOAT32
    try:
        return _matmul_flops_per_s(size, dtype, device, sync, 5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def _per_op_time_s(operation: Callable[[torch.Tensor], object], size: int,
                   device: torch.device, sync, dtype: torch.dtype = torch.float32,
                   count: int = 50) -> float:
    """The time per op of ``count`` launched back to back, as eager runs a step's ops."""
    value = torch.ones(size, size, device=device, dtype=dtype)
    return _best_time_s(lambda: [operation(value) for _ in range(count)], sync, 3) / count


def _elementwise_bytes_per_s(size_bytes: int, device: torch.device, sync) -> float:
    """Memory bandwidth as a large elementwise op sees it: an add reads two and writes one."""
    left = torch.empty(size_bytes // 4, device=device)
    right, out = torch.empty_like(left), torch.empty_like(left)
    return 3 * size_bytes / _best_time_s(lambda: torch.add(left, right, out=out), sync, 5)


class LinkRates(NamedTuple):
    """Pinned copy rates of the host link, each direction alone and both at once (summed)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    both_bytes_per_s: float
    duplex: bool


def measure_link(device: torch.device, size_bytes: int = 256 * 2**20) -> LinkRates:
    """Pinned copy rates device→host and host→device, alone and both at once (two streams)."""

    def sync() -> None:
        torch.cuda.synchronize(device)

    device_source = torch.empty(size_bytes // 4, device=device)
    device_target = torch.empty_like(device_source)
    host_target = torch.empty(size_bytes // 4, pin_memory=True)
    host_source = torch.empty(size_bytes // 4, pin_memory=True)
    d2h_stream, h2d_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def d2h() -> None:
        with torch.cuda.stream(d2h_stream):
            host_target.copy_(device_source, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(h2d_stream):
            device_target.copy_(host_source, non_blocking=True)

    def both() -> None:
        d2h()
        h2d()

    d2h_bytes_per_s = size_bytes / _best_time_s(d2h, sync, 5)
    h2d_bytes_per_s = size_bytes / _best_time_s(h2d, sync, 5)
    both_bytes_per_s = 2 * size_bytes / _best_time_s(both, sync, 5)
    duplex = both_bytes_per_s >= DUPLEX_RATIO * (d2h_bytes_per_s + h2d_bytes_per_s) / 2
    return LinkRates(d2h_bytes_per_s, h2d_bytes_per_s, both_bytes_per_s, duplex)


def measure_pageable_link(device: torch.device, size_bytes: int = 256 * 2**20) -> tuple[float, float]:
    """Copy rates device->host and host->device with pageable (not pinned) host memory: the
    driver stages them through a pinned buffer of its own, on the calling thread."""

    def sync() -> None:
        torch.cuda.synchronize(device)

    device_tensor = torch.empty(size_bytes // 4, device=device)
    host_tensor = torch.empty(size_bytes // 4)
    d2h_bytes_per_s = size_bytes / _best_time_s(lambda: host_tensor.copy_(device_tensor), sync, 3)
    h2d_bytes_per_s = size_bytes / _best_time_s(lambda: device_tensor.copy_(host_tensor), sync, 3)
    return d2h_bytes_per_s, h2d_bytes_per_s
