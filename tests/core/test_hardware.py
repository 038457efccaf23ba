"""Hardware profiles, lookup errors and the roofline op-time estimate."""

from __future__ import annotations

import pytest

from memfit.core.hardware import GB, PROFILES, TFLOPS, Hardware, get_hardware

NAMES = ["a100", "cpu", "gh200", "h100-pcie", "h100-sxm", "h200"]


def toy(**changes) -> Hardware:
    fields = dict(
        name="toy",
        flops_per_s={"float32": 100.0, "bfloat16": 400.0},
        memory_bytes_per_s=10.0,
        d2h_bytes_per_s=4.0,
        h2d_bytes_per_s=2.0,
        op_overhead_s=1.0,
        copy_latency_s=0.5,
    )
    return Hardware(**{**fields, **changes})


def test_built_in_profiles():
    assert sorted(PROFILES) == NAMES
    for name, hardware in PROFILES.items():
        assert hardware.name == name
        assert get_hardware(name) is hardware
    h100 = get_hardware("h100-pcie")
    assert (h100.d2h_bytes_per_s, h100.h2d_bytes_per_s) == (52 * GB, 52 * GB)
    assert h100.flops_per_s["bfloat16"] == 756 * TFLOPS
    assert (h100.duplex, h100.async_copies) == (True, True)
    cpu = get_hardware("cpu")
    assert (cpu.duplex, cpu.async_copies) == (False, False)


def test_get_hardware_passes_a_hardware_through():
    hardware = toy()
    assert get_hardware(hardware) is hardware


def test_unknown_profile_lists_the_names():
    with pytest.raises(ValueError, match="unknown hardware profile 'h300'") as error:
        get_hardware("h300")
    assert str(NAMES) in str(error.value)
    assert "measure_hardware()" in str(error.value)


def test_roofline_takes_the_slower_of_compute_and_memory_plus_overhead():
    hardware = toy()
    assert hardware.op_time_s(flops=1000, bytes_accessed=10) == 11.0  # compute-bound: 10 + 1
    assert hardware.op_time_s(flops=10, bytes_accessed=1000) == 101.0  # memory-bound: 100 + 1
    assert hardware.op_time_s(flops=1000, bytes_accessed=10, dtype="bfloat16") == 3.5


def test_flops_rate_falls_back_to_float32_then_to_the_slowest():
    assert toy().flops_rate("float16") == 100.0
    assert toy(flops_per_s={"bfloat16": 400.0, "float16": 300.0}).flops_rate("int8") == 300.0


def test_copy_times_include_the_latency():
    hardware = toy()
    assert hardware.d2h_time_s(8) == 2.5
    assert hardware.h2d_time_s(8) == 4.5
    assert hardware.d2h_time_s(0) == 0.5


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"memory_bytes_per_s": 0.0}, "memory_bytes_per_s must be positive, got 0.0"),
        ({"d2h_bytes_per_s": -1.0}, "d2h_bytes_per_s must be positive, got -1.0"),
        ({"h2d_bytes_per_s": 0}, "h2d_bytes_per_s must be positive, got 0"),
        ({"flops_per_s": {}}, "positive rate for at least one dtype"),
        ({"flops_per_s": {"float32": 0.0}}, "positive rate for at least one dtype"),
    ],
)
def test_invalid_numbers_are_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        toy(**changes)


def test_with_changes_a_copy_and_checks_it_again():
    hardware = toy()
    smaller = hardware.with_(device_bytes=16 * 2**30, duplex=False)
    assert (smaller.device_bytes, smaller.duplex) == (16 * 2**30, False)
    assert (hardware.device_bytes, hardware.duplex) == (80 * 2**30, True)
    with pytest.raises(ValueError, match="d2h_bytes_per_s must be positive"):
        hardware.with_(d2h_bytes_per_s=0)


def test_hardware_is_frozen():
    hardware = toy()
    with pytest.raises(TypeError):
        hardware.flops_per_s["float32"] = 1.0  # type: ignore[index]
