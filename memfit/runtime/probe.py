"""measure_hardware: fill in a ``Hardware`` profile by timing the machine at hand.

Example:
    >>> hardware = measure_hardware()          # the CUDA device if there is one, else the CPU
    >>> hardware.flops_per_s["float32"], hardware.h2d_bytes_per_s

Note:
    Each figure is the best of a few repeats of one large operation (matmul, device copy, pinned
    host copy), so it is a sustained rate close to what the planner's roofline assumes. On the
    CPU sizes are small so the probe takes well under a few seconds; copies between "device"
    and "host" are memcpys on the compute thread there, hence ``async_copies=False``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from memfit.core.hardware import PROFILES, Hardware

# A combined (both directions at once) rate at least this many times one direction's means the
# link is full duplex; 2.0 is perfect, PCIe hosts usually reach 1.6-1.9.
DUPLEX_RATIO = 1.5


def measure_hardware(device: torch.device | str | None = None) -> Hardware:
    """Measure FLOP/s, memory bandwidth and host-link bandwidth of ``device``.

    Args:
        device: the device to measure; defaults to the current CUDA device if there is one,
            else the CPU.

    Returns:
        A ``Hardware`` named ``"measured-cpu"`` or ``"measured-<device name>"``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(device)
    return _measure_cpu()


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


def _measure_cpu() -> Hardware:
    base = PROFILES["cpu"]
    no_sync = lambda: None  # noqa: E731
    cpu = torch.device("cpu")
    flops_per_s = {"float32": _matmul_flops_per_s(256, torch.float32, cpu, no_sync, 5)}
    tiny = torch.randn(32, 32, dtype=torch.bfloat16)
    if _best_time_s(lambda: tiny @ tiny, no_sync, 1) < 1e-3:  # slow bf16 paths would take seconds
        flops_per_s["bfloat16"] = _matmul_flops_per_s(256, torch.bfloat16, cpu, no_sync, 3)
    copy_bytes_per_s = _copy_bytes_per_s(32 * 2**20, cpu, no_sync, 5)
    one = torch.ones(1)
    overhead_s = _best_time_s(lambda: torch.add(one, one), no_sync, 50)
    return base.with_(
        name="measured-cpu",
        flops_per_s=flops_per_s,
        memory_bytes_per_s=copy_bytes_per_s,
        d2h_bytes_per_s=copy_bytes_per_s / 2,  # one read + one write per copied byte
        h2d_bytes_per_s=copy_bytes_per_s / 2,
        duplex=False,
        async_copies=False,
        device_bytes=_host_memory_bytes(base.device_bytes),
        op_overhead_s=overhead_s,
        notes=f"measured on the CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
    )


def _measure_cuda(device: torch.device) -> Hardware:
    def sync() -> None:
        torch.cuda.synchronize(device)

    flops_per_s = {
        "float32": _matmul_flops_per_s(4096, torch.float32, device, sync, 5),
        "bfloat16": _matmul_flops_per_s(8192, torch.bfloat16, device, sync, 5),
    }
    flops_per_s["float16"] = flops_per_s["bfloat16"]
    link = measure_link(device, 256 * 2**20)
    d2h_bytes_per_s, h2d_bytes_per_s, duplex = link.d2h_bytes_per_s, link.h2d_bytes_per_s, link.duplex
    properties = torch.cuda.get_device_properties(device)
    return Hardware(
        name=f"measured-{properties.name}",
        flops_per_s=flops_per_s,
        memory_bytes_per_s=_copy_bytes_per_s(1 * 2**30, device, sync, 5),
        d2h_bytes_per_s=d2h_bytes_per_s,
        h2d_bytes_per_s=h2d_bytes_per_s,
        duplex=duplex,
        async_copies=True,
        device_bytes=properties.total_memory,
        notes=f"measured on {properties.name}",
    )


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


def _host_memory_bytes(default_bytes: int) -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return default_bytes
