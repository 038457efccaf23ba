"""measure_hardware on the CPU: a valid Hardware with positive, finite numbers; the CUDA probe's
code on a fake device."""

import math
from types import SimpleNamespace

import pytest
import torch

from memfit.data.hardware import PROFILES, Hardware
from memfit.runtime import probe
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
    assert hardware.host_bytes is not None and 0 < hardware.host_bytes <= hardware.device_bytes
    assert hardware.async_copies is False and hardware.duplex is False
    assert hardware.op_time_s(1e9, 1e6) > 0


def test_cuda_probe_code_runs_on_a_fake_device(monkeypatch):
    """The CUDA probe's own code, run on the CPU as a fake CUDA device (small sizes, a no-op
    synchronize, a device named like an H100 PCIe, a fixed pinned link): the profile holds each
    measured rate at efficiency 1, the other classes relative to the H100 PCIe profile's matmul
    fraction, a non-negative ramp, and PyTorch's TF32 switches, put back after."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(probe, "available_host_bytes", lambda: 123 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
        name="NVIDIA H100 PCIe", total_memory=80 * 2**30))
    monkeypatch.setattr(probe, "measure_link", lambda device, size: probe.LinkRates(
        5e10, 4e10, 9e10, True))
    allowed = torch.backends.cuda.matmul.allow_tf32
    sizes = probe.ProbeSizes(matmul=64, small_matmul=16, memory_bytes=2**20, link_bytes=2**20)
    hardware = probe._measure_cuda(torch.device("cpu"), sizes)
    assert torch.backends.cuda.matmul.allow_tf32 == allowed
    assert set(hardware.flops_per_s) == {"float32", "tfloat32", "bfloat16", "float16"}
    assert hardware.name == "measured-NVIDIA H100 PCIe"
    assert (hardware.d2h_bytes_per_s, hardware.h2d_bytes_per_s, hardware.duplex) == (
        5e10, 4e10, True)
    assert hardware.d2h_pageable_bytes_per_s > 0 and hardware.h2d_pageable_bytes_per_s > 0
    reference = PROFILES["h100-pcie"].compute_efficiency
    assert hardware.compute_efficiency == {
        name: value / reference["matmul"] for name, value in reference.items()}
    assert hardware.compute_efficiency["matmul"] == 1.0 and hardware.memory_efficiency == 1.0
    assert hardware.compute_ramp_s >= 0 and hardware.op_overhead_s > 0
    assert hardware.tf32_matmuls == allowed
    assert hardware.host_bytes == 123 * 2**30  # this machine's available RAM, not a stated one
    assert Hardware.from_json(hardware.to_json()) == hardware


@pytest.mark.parametrize("device_name, profile", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", "h100-sxm"),
])
def test_closest_profile_by_device_name(device_name, profile):
    assert probe.closest_profile(device_name) is PROFILES[profile]
