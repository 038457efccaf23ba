"""measure_hardware on the CPU: a valid Hardware with positive, finite numbers."""

import math

from memfit.core.hardware import Hardware
from memfit.runtime.probe import measure_hardware


def test_cpu_probe_returns_a_valid_hardware():
    hardware = measure_hardware("cpu")
    assert isinstance(hardware, Hardware)
    assert hardware.name == "measured-cpu"
    assert hardware.flops_per_s["float32"] > 0
    rates = [*hardware.flops_per_s.values(), hardware.memory_bytes_per_s,
             hardware.d2h_bytes_per_s, hardware.h2d_bytes_per_s, hardware.op_overhead_s]
    assert all(rate > 0 and math.isfinite(rate) for rate in rates)
    assert hardware.device_bytes > 0
    assert hardware.async_copies is False and hardware.duplex is False
    assert hardware.op_time_s(1e9, 1e6) > 0
