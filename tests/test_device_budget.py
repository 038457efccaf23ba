"""``memfit.fit(model)`` with no budget: on CUDA the device's free memory at the first call less
a stated margin, said in the report; on a CPU no limit (``keep``). The CUDA logic runs on a CPU
with the free-memory reading injected."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.data.units import format_bytes
from memfit.fitting import device_budget, fitted
from memfit.runtime.measure import measure_allocator_peak

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def mlp(depth: int = 4, width: int = 128) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def data(count: int = 2, size: int = 2048, width: int = 128):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, width, generator=generator),
             torch.randn(size, 1, generator=generator)) for _ in range(count)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    peaks = []
    for x, y in data():
        def iteration(x=x, y=y):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        peaks.append(measure_allocator_peak(iteration, track=(
            list(model.parameters()), optimizer.state, x, y)).peak_bytes)
    return peaks


def test_the_margin_is_a_tenth_and_at_least_512_mib():
    assert device_budget.automatic_budget(40 * 2**30) == (36 * 2**30, 4 * 2**30)
    assert device_budget.automatic_budget(2**30) == (2**29, 2**29)
    with pytest.raises(ValueError, match="give memfit.fit a budget="):
        device_budget.automatic_budget(2**29)


@pytest.mark.slow
def test_on_cuda_no_budget_is_the_free_memory_less_the_margin(monkeypatch):
    """The device reads as CUDA with as many usable bytes as eager's measured peak; the margin
    is a tenth (its floor set to 0 for a small model): memfit plans 0.9 of eager's peak, holds
    it, trains bitwise like eager, and the report names the number."""
    reference = mlp()
    eager_peak = max(train(reference, torch.optim.AdamW(reference.parameters())))
    monkeypatch.setattr(device_budget, "MARGIN_MIN_BYTES", 0)
    monkeypatch.setattr(device_budget, "usable_device_bytes", lambda device: eager_peak)
    monkeypatch.setattr(fitted, "_call_device", lambda module, values: torch.device("cuda"))
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    fit = memfit.fit(model, optimizer=optimizer)
    peaks = train(fit, optimizer)
    budget_bytes = eager_peak - int(0.1 * eager_peak)
    planner = fit._memfit_backend
    assert planner.budget.bytes == budget_bytes and planner.strategy == "auto"
    assert max(peaks) <= budget_bytes < eager_peak, (peaks, budget_bytes)
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected)
    assert f"budget: {format_bytes(budget_bytes)}, chosen by memfit" in memfit.report(fit)


def test_on_a_cpu_no_budget_stays_keep():
    model = mlp()
    fit = memfit.fit(model)
    train(fit, torch.optim.AdamW(model.parameters()))
    planner = fit._memfit_backend
    assert planner.budget is None and planner.strategy == "keep" and not planner.budget_note
    assert "chosen by memfit" not in memfit.report(fit)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_no_budget_fits_the_free_memory():
    device = torch.device("cuda", torch.cuda.current_device())
    model = mlp().to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    usable = device_budget.usable_device_bytes(device)
    fit = memfit.fit(model, optimizer=optimizer)
    x, y = (tensor.to(device) for tensor in data(count=1)[0])
    torch.cuda.reset_peak_memory_stats(device)
    nn.functional.mse_loss(fit(x), y).backward()
    optimizer.step()
    planner = fit._memfit_backend
    assert planner.budget.bytes == device_budget.automatic_budget(usable)[0]
    assert torch.cuda.max_memory_allocated(device) <= planner.budget.bytes
    assert "chosen by memfit" in memfit.report(fit)
