"""memfit.measure_hardware on this CPU: sane positive figures (matmul and convolution rates,
memory bandwidth, per-op overhead, copy speed), a profile that saves, loads back equal and
plans wherever a profile name does. No timing assertions: speed goals live in bench/."""

import math

import pytest
import torch

import memfit
from memfit.api import analyzed
from memfit.data.hardware import Hardware
from memfit.model.kernels import priced_for, repriced
from memfit.tracing.capture import capture


@pytest.fixture(scope="module")
def measured() -> Hardware:
    return memfit.measure_hardware("cpu")


def test_the_measured_cpu_profile_has_sane_figures(measured):
    assert "measure_hardware" in memfit.__all__
    assert measured.name == "measured-cpu" and measured.device_type == "cpu"
    rates = [*measured.flops_per_s.values(), measured.memory_bytes_per_s,
             measured.d2h_bytes_per_s, measured.h2d_bytes_per_s, measured.op_overhead_s,
             measured.kernel_overhead_s]
    assert all(rate > 0 and math.isfinite(rate) for rate in rates)
    efficiency = measured.compute_efficiency
    assert 0 < efficiency["convolution"] <= 1 and 0 < efficiency["matmul"] <= 1
    assert max(efficiency["convolution"], efficiency["matmul"]) == 1  # the faster is the peak
    assert measured.compute_ramp_s >= 0 and measured.memory_efficiency == 1.0
    # a matmul's FLOPs per second and a second's worth of bytes: both within physical reason
    assert 1e8 < measured.flops_per_s["float32"] < 1e14
    assert 1e8 < measured.memory_bytes_per_s < 1e13
    assert measured.op_overhead_s < 1e-2


def test_the_profile_round_trips_through_a_file(measured, tmp_path):
    path = tmp_path / "cpu.json"
    measured.save(path)
    loaded = Hardware.load(path)
    assert loaded == measured
    assert loaded.kernel_overhead_s == measured.kernel_overhead_s


def test_a_profile_saved_before_kernel_overhead_loads_with_the_default(measured):
    data = measured.to_json()
    del data["kernel_overhead_s"]
    assert Hardware.from_json(data).kernel_overhead_s == Hardware.kernel_overhead_s


def test_the_measured_profile_plans_and_prices_both_compilers(measured):
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8))

    def loss_fn(model, x):
        return model(x).square().mean()

    inputs = (torch.randn(512, 32),)
    plan = memfit.plan(model, loss_fn, *inputs, hardware=measured, strategy="keep")
    assert plan.hardware == "measured-cpu"
    graph = analyzed(capture(model, loss_fn, *inputs, hardware=measured), measured, "", False)[1]
    assert graph.step_time_s > 0
    again = repriced(graph, measured, "aot_eager")
    assert [op.time_s for op in again.ops] == [op.time_s for op in graph.ops]
    fused = priced_for(graph, measured, "inductor")
    assert repriced(graph, measured, "inductor").step_time_s == fused.step_time_s
    assert 0 < fused.step_time_s < graph.step_time_s  # GELU's chain fused, fewer launches
