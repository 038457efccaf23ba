"""The CUDA swap path: streams, events, pinned buffers. Skipped without a CUDA device."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.data.hardware import Hardware
from memfit.ops.host import is_host_storage
from memfit.ops.swap import SWAP_IN, SWAP_OUT, WAIT
from memfit.runtime.executor import Executor
from memfit.runtime.measure import measure_peak
from memfit.runtime.probe import measure_hardware
from memfit.runtime.streams import CopyEngine, active_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
N = 1 << 20  # elements: 4 MiB float32 tensors, a multiple of the allocator's block size


def test_cuda_round_trip_uses_pinned_buffers_and_events():
    device = torch.device("cuda", torch.cuda.current_device())
    engine = CopyEngine(device)
    tensor = torch.randn(N, device=device).view(1024, -1).t()
    with active_engine(engine):
        host = SWAP_OUT(tensor, 0)
        back = SWAP_IN(host, 0, 1, device)
        WAIT(back, 1)
        result = back * 1  # runs on the compute stream after the wait
    torch.cuda.synchronize(device)
    assert host.is_pinned() and host.device.type == "cpu" and is_host_storage(host.untyped_storage())
    assert back.device == device and set(engine.events) == {0, 1}
    assert torch.equal(result, tensor)


def chain(x):
    a = x * 2
    b = a.sin()
    c = torch.cat([b, b, b]).cos()
    return a * c.mean()


def test_cuda_executor_swap_keeps_results_and_drops_the_peak():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(N, device=device)
    graph_module = make_fx(chain)(x)
    kept = measure_peak(Executor(graph_module, device).run, x)
    graph = graph_module.graph
    first_mul, last_mul = [n for n in graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    mean = next(n for n in graph.nodes if n.target == torch.ops.aten.mean.default)
    with graph.inserting_after(first_mul):
        host = graph.call_function(SWAP_OUT, (first_mul, 0))
    with graph.inserting_after(mean):
        back = graph.call_function(SWAP_IN, (host, 0, 1, device))
    with graph.inserting_before(last_mul):
        graph.call_function(WAIT, (back, 1))
    last_mul.replace_input_with(first_mul, back)
    graph_module.recompile()
    swapped = measure_peak(Executor(graph_module, device).run, x)
    assert torch.equal(swapped.result, kept.result)
    assert kept.peak_bytes - swapped.peak_bytes == 4 * N


def test_cuda_probe(tmp_path):
    """Tensor cores beat CUDA cores (TF32 and bf16 over plain float32 on any GPU with them),
    pageable copies are measured beside pinned ones, and the profile saves and loads."""
    hardware = measure_hardware()
    assert hardware.name.startswith("measured-")
    assert hardware.h2d_bytes_per_s > 1e9 and hardware.flops_per_s["bfloat16"] > 1e12
    if torch.cuda.get_device_capability()[0] >= 8:
        rates = hardware.flops_per_s
        assert rates["bfloat16"] > rates["tfloat32"] > rates["float32"]
    assert hardware.h2d_pageable_bytes_per_s > 1e8 and hardware.d2h_pageable_bytes_per_s > 1e8
    assert hardware.memory_bytes_per_s > 1e11 and 0 < hardware.op_overhead_s < 1e-3
    hardware.save(tmp_path / "measured.json")
    assert Hardware.load(tmp_path / "measured.json") == hardware
