"""memfit.fit(compiler="inductor") on a BatchNorm CNN of residual basic blocks holds the budget a
user would otherwise reach by checkpointing every block.

The budget is per-block checkpointing's measured peak (``torch.utils.checkpoint`` around each
basic block, eager); every iteration of the fitted loop, the first included, is measured within
it by the allocator's own events, and the step computes what ``torch.compile``'s inductor
computes (within ``torch.testing.assert_close``'s float32 defaults: its min-cut partitioner
re-runs other ops, and inductor fuses the two programs differently).

Note:
    Before ``memfit.lowering.inductor.planned_order_kept``, inductor's reordering for peak memory
    moved each ``memfit::wait`` to the backward's end, keeping every swapped-in tensor alive
    until then: 1,909,432 B measured at this 1,706,528 B budget, every iteration.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from memfit.runtime.measure import measure_allocator_peak
from tests.test_backend_inductor import assert_trained_as

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                       reason="inductor needs a C++ compiler on the CPU (install g++)"),
]

WIDTH = 16  # channels of every block
BLOCKS = 4
STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions (no bias, as before batch norm), each with
    batch norm, a ReLU after each, the block's input added before the second."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(y)) + x)


class BlockNet(nn.Module):
    """A stem, ``BLOCKS`` basic blocks (each checkpointed where ``checkpointed``), pooling and a
    linear classifier."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(WIDTH), nn.ReLU())
        self.blocks = nn.ModuleList(BasicBlock(WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 10)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x.mean((2, 3)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 16, 16, generator=generator),
             torch.randint(0, 10, (8,), generator=generator)) for _ in range(STEPS)]


def train(model: nn.Module, call, optimizer: torch.optim.Optimizer):
    """SGD steps over ``batches()``: each step's loss and measured allocator peak."""
    losses, peaks = [], []
    for x, y in batches():
        def step(x=x, y=y):
            loss = nn.functional.cross_entropy(call(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        resident = (list(model.parameters()), list(model.buffers()), optimizer.state, x, y)
        measured = measure_allocator_peak(step, track=resident)
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


def test_inductor_holds_per_block_checkpointing_peak_on_a_basic_block_cnn():
    checkpointed = BlockNet(checkpointed=True)
    _, checkpointed_peaks = train(checkpointed, checkpointed, sgd(checkpointed))
    budget = max(checkpointed_peaks)

    reference = BlockNet()
    reference_losses, _ = train(reference, torch.compile(reference), sgd(reference))
    torch._dynamo.reset()

    model = BlockNet()
    optimizer = sgd(model)
    fitted = memfit.fit(model, budget=budget, compiler="inductor", optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)  # no measured run over its budget
        losses, peaks = train(model, fitted, optimizer)
    print(f"budget {budget}, memfit inductor peaks {peaks}")

    regions = fitted._memfit_backend.regions
    assert any(region.plan.swapped or region.plan.reruns for region in regions)
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    assert_trained_as(model, losses, reference, reference_losses)


def test_fused_chains_trains_at_the_peak_torch_compiles_budget_reaches():
    """``strategy="fused-chains"``: the CNN's batch norms and ReLUs re-run inside the backward's
    kernels, convolutions re-run where that lowers the peak, as ``torch.compile``'s partitioner
    plans under ``activation_memory_budget=0.5``; at that run's measured peak, every iteration
    within it and torch.compile's losses, weights and running statistics."""
    compiled = BlockNet()
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        _, compile_peaks = train(compiled, torch.compile(compiled), sgd(compiled))
    torch._dynamo.reset()
    budget = max(compile_peaks)
    reference = BlockNet()
    reference_losses, _ = train(reference, torch.compile(reference), sgd(reference))
    torch._dynamo.reset()

    model = BlockNet()
    optimizer = sgd(model)
    fitted = memfit.fit(model, budget=budget, strategy="fused-chains", compiler="inductor",
                        optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        losses, peaks = train(model, fitted, optimizer)
    print(f"budget {budget}, fused chains peaks {peaks}")

    (region,) = fitted._memfit_backend.regions
    assert region.plan.strategy == "fused-chains" and region.plan.recomputed
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    assert_trained_as(model, losses, reference, reference_losses)
