"""Hardware profiles, lookup errors, the roofline with efficiencies, and profiles as JSON."""

from __future__ import annotations

import json
import os

import pytest

from memfit.data.hardware import (
    GB,
    PROFILES,
    TFLOPS,
    Hardware,
    available_host_bytes,
    get_hardware,
)
from memfit.data.op_classes import COMPUTE_CLASSES, FALLBACK_CLASS

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
    assert h100.d2h_pageable_bytes_per_s < h100.d2h_bytes_per_s
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


def test_a_cpu_matmul_with_a_bias_pays_a_pass_over_its_output_first():
    cpu = toy(device_type="cpu")
    plain = cpu.op_time_s(1000, 10, "float32", "aten.mm", elements=25)
    assert cpu.op_time_s(1000, 10, "float32", "aten.addmm", elements=25) == plain + 25 * 4 / 10.0
    assert cpu.op_time_s(1000, 10, "bfloat16", "aten.addmm", elements=25) == pytest.approx(
        cpu.op_time_s(1000, 10, "bfloat16", "aten.mm", elements=25) + 25 * 2 / 10.0)
    gpu = toy(device_type="cuda")  # cuBLASLt adds the bias in the multiply's epilogue
    assert gpu.op_time_s(1000, 10, "float32", "aten.addmm", elements=25) == gpu.op_time_s(
        1000, 10, "float32", "aten.mm", elements=25)


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
        ({"host_bytes": -1}, "host_bytes must be 0 or more"),
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


GPUS = ["a100", "gh200", "h100-pcie", "h100-sxm", "h200"]


@pytest.mark.parametrize("name", GPUS)
def test_gpu_profiles_have_tensor_core_peaks_and_efficiencies(name):
    """Dense tensor-core rates beat the float32 (CUDA core) rate: TF32 by 7-8x, bf16/fp16 by
    2x TF32; every compute class has a fraction below 1, memory-bound ops too."""
    peaks = PROFILES[name].flops_per_s
    assert peaks["bfloat16"] == peaks["float16"]
    assert 1.9 < peaks["bfloat16"] / peaks["tfloat32"] < 2.1
    assert 7 < peaks["tfloat32"] / peaks["float32"] < 8.1
    hardware = PROFILES[name]
    assert set(hardware.compute_efficiency) == set(COMPUTE_CLASSES) - set(FALLBACK_CLASS)
    assert all(0 < value < 1 for value in hardware.compute_efficiency.values())
    assert hardware.class_efficiency("batched_matmul") == hardware.compute_efficiency["matmul"]
    assert 0 < hardware.memory_efficiency < 1 and hardware.compute_ramp_s > 0


def test_efficiency_slows_each_class_by_its_fraction():
    hardware = toy(compute_efficiency={"matmul": 0.5, "attention": 0.25}, memory_efficiency=0.5)
    assert hardware.op_time_s(flops=1000, bytes_accessed=10, kind="aten.mm") == 21.0  # 20 + 1
    assert hardware.op_time_s(1000, 10, kind="aten._scaled_dot_product_flash_attention") == 41.0
    assert hardware.op_time_s(1000, 10, kind="aten.convolution") == 11.0  # not given: 1.0
    assert hardware.op_time_s(flops=0, bytes_accessed=100, kind="aten.add") == 21.0  # 100/5 + 1


def test_small_compute_ops_reach_a_lower_fraction_of_the_peak():
    """The ramp is a saturating curve: an op of x FLOPs runs at efficiency * x / (x + x_half)
    of the peak, x_half = peak * efficiency * ramp (here 100 * 0.5 * 2 = 100 FLOPs)."""
    hardware = toy(compute_efficiency={"matmul": 0.5}, compute_ramp_s=2.0, op_overhead_s=0.0)
    for flops in (10.0, 100.0, 1e6):
        achieved = flops / hardware.op_time_s(flops, 0, kind="aten.mm") / 100.0
        assert achieved == pytest.approx(0.5 * flops / (flops + 100.0))
    assert hardware.op_time_s(0, 10, kind="aten.mm") == 1.0  # no FLOPs: memory only, no ramp


def test_float32_runs_on_tensor_cores_as_pytorchs_tf32_switches_say():
    """cuDNN's TF32 switch is on by default, cuBLAS's is off, as in PyTorch."""
    hardware = toy(flops_per_s={"float32": 100.0, "tfloat32": 1000.0, "bfloat16": 2000.0})
    assert hardware.op_time_s(1000, 0, kind="aten.mm") == 11.0
    assert hardware.op_time_s(1000, 0, kind="aten.convolution") == 2.0
    assert hardware.op_time_s(1000, 0, kind="aten.mkldnn_rnn_layer") == 2.0
    tf32 = hardware.with_(tf32_matmuls=True, tf32_cudnn=False)
    assert tf32.op_time_s(1000, 0, kind="aten.mm") == 2.0
    assert tf32.op_time_s(1000, 0, kind="aten._scaled_dot_product_efficient_attention") == 2.0
    assert tf32.op_time_s(1000, 0, kind="aten.convolution") == 11.0
    assert hardware.op_time_s(1000, 0, dtype="bfloat16", kind="aten.mm") == 1.5
    assert toy().compute_dtype("float32", "convolution") == "float32"  # no TF32 rate known


def test_pageable_copies_take_their_own_rate_or_the_pinned_one():
    hardware = toy(d2h_pageable_bytes_per_s=1.0, h2d_pageable_bytes_per_s=0.5)
    assert hardware.d2h_time_s(8, pinned=False) == 8.5
    assert hardware.h2d_time_s(8, pinned=False) == 16.5
    assert hardware.d2h_time_s(8) == 2.5
    assert toy().h2d_time_s(8, pinned=False) == toy().h2d_time_s(8)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"compute_efficiency": {"matmul": 1.5}}, r"compute_efficiency\['matmul'\] must be a "
                                                  r"fraction in \(0, 1\], got 1.5"),
        ({"compute_efficiency": {"gemm": 0.5}}, r"unknown op classes \['gemm'\]: use"),
        ({"memory_efficiency": 0.0}, "memory_efficiency must be a fraction"),
        ({"compute_ramp_s": -1e-6}, "compute_ramp_s must be 0 or more"),
        ({"h2d_pageable_bytes_per_s": 0.0}, "h2d_pageable_bytes_per_s must be positive"),
    ],
)
def test_invalid_efficiencies_are_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        toy(**changes)


@pytest.mark.parametrize("name", NAMES)
def test_profiles_round_trip_through_json(name, tmp_path):
    profile = PROFILES[name]
    path = tmp_path / f"{name}.json"
    profile.save(path)
    loaded = Hardware.load(path)
    assert loaded == profile and loaded.notes == profile.notes
    assert json.loads(path.read_text())["format"] == "memfit.hardware"


def test_a_host_limit_round_trips_through_json(tmp_path):
    profile = PROFILES["h100-pcie"].with_(host_bytes=512 * 2**30)
    profile.save(tmp_path / "host.json")
    assert Hardware.load(tmp_path / "host.json").host_bytes == 512 * 2**30


def test_the_device_type_round_trips_and_is_inferred_for_older_files():
    """Which device runs the step decides how a plan captures it (``memfit.tracing.target``): the
    CPU profile says ``cpu``, the GPU profiles ``cuda``; a file saved before the field existed
    is read as a CPU profile when its copies run on the compute thread, else as CUDA."""
    assert {name: profile.device_type for name, profile in PROFILES.items()} == {
        name: "cpu" if name == "cpu" else "cuda" for name in NAMES}
    for profile in (PROFILES["cpu"], PROFILES["h100-sxm"]):
        assert Hardware.from_json(profile.to_json()).device_type == profile.device_type
        older = {key: value for key, value in profile.to_json().items() if key != "device_type"}
        assert Hardware.from_json(older).device_type == profile.device_type
    with pytest.raises(ValueError, match="'device_type' must be a string"):
        Hardware.from_json({**PROFILES["cpu"].to_json(), "device_type": 1})


def test_the_gpu_profiles_state_a_host_figure_and_the_cpu_none():
    """Each GPU profile states the host memory swaps may take (a typical host's share, more
    than the GPU's own memory), says so in its notes; the CPU profile, whose host is its device
    memory, has no separate limit."""
    for name, profile in PROFILES.items():
        if name == "cpu":
            assert profile.host_bytes is None
            continue
        assert profile.host_bytes is not None and profile.host_bytes > profile.device_bytes, name
        assert "host" in profile.notes
        assert Hardware.from_json(profile.to_json()).host_bytes == profile.host_bytes


def test_the_available_ram_is_what_a_local_profile_takes():
    available = available_host_bytes()
    if not hasattr(os, "sysconf") or "SC_AVPHYS_PAGES" not in os.sysconf_names:
        assert available is None
        return
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf(
        "SC_PAGE_SIZE")


def test_a_hand_written_profile_needs_only_the_fields_without_defaults():
    data = {"format": "memfit.hardware", "version": 1, "name": "mine",
            "flops_per_s": {"bfloat16": 1e15}, "memory_bytes_per_s": 3e12,
            "d2h_bytes_per_s": 5e10, "h2d_bytes_per_s": 5e10}
    hardware = Hardware.from_json(data)
    assert hardware.name == "mine" and hardware.memory_efficiency == 1.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "memfit.plan"}, "is not a memfit hardware profile"),
        ({"version": 99}, "format version 99, this memfit reads version 1"),
        ({"speed": 1}, r"unknown field\(s\) \['speed'\]"),
        ({"duplex": "yes"}, "field 'duplex' must be a boolean, got 'yes'"),
        ({"memory_bytes_per_s": True}, "field 'memory_bytes_per_s' must be a number"),
        ({"flops_per_s": {"bfloat16": "fast"}}, "field 'flops_per_s' must be an object of numbers"),
        ({"device_bytes": 1.5}, "field 'device_bytes' must be an integer"),
        ({"host_bytes": 1.5}, "field 'host_bytes' must be an integer or null"),
        ({"memory_efficiency": 2.0}, "memory_efficiency must be a fraction"),
    ],
)
def test_a_bad_profile_file_names_the_field(change, message):
    data = {**PROFILES["h100-sxm"].to_json(), **change}
    with pytest.raises(ValueError, match=message):
        Hardware.from_json(data)


def test_a_profile_without_a_required_field_says_which(tmp_path):
    data = PROFILES["a100"].to_json()
    del data["h2d_bytes_per_s"]
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"lacks the field\(s\) \['h2d_bytes_per_s'\]"):
        Hardware.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        Hardware.load(path)


def test_interconnect_fields_round_trip_and_are_checked():
    sxm = get_hardware("h100-sxm")
    assert sxm.collective_bytes_per_s == 360e9 and sxm.network_bytes_per_s == 45e9
    assert Hardware.from_json(sxm.to_json()) == sxm
    assert get_hardware("gh200").collective_bytes_per_s is None  # one GPU: no peer link
    data = {**sxm.to_json(), "gpus_per_node": 8.5}
    with pytest.raises(ValueError, match="'gpus_per_node' must be an integer"):
        Hardware.from_json(data)
    with pytest.raises(ValueError, match="collective_bytes_per_s must be positive"):
        sxm.with_(collective_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        sxm.collective_time_s("broadcast", 1, 2)
    assert sxm.collective_time_s("all_gather", 10**9, 1) == 0.0  # one rank moves nothing
