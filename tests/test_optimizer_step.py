"""The optimizer's step after the backward: parameters, every gradient, the optimizer state and
the step's own temporaries alive at once, which no plan of the activations lowers. A budget under
that is refused at the first call, before anything runs (``memfit.compiler.optimizer_step``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.data.errors import BudgetError
from memfit.runtime.measure import measure_allocator_peak
from memfit.runtime.resident import step_temporary_bytes

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def _wide() -> nn.Module:
    """Parameters outweigh the activations of a small batch: the step is the iteration's peak."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.Linear(512, 10))


def _iteration(model: nn.Module, optimizer: torch.optim.Optimizer, inputs, targets):
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_a_budget_under_the_optimizers_step_is_refused_before_anything_runs():
    inputs = torch.randn(32, 512, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    eager = _wide()
    eager_optimizer = torch.optim.AdamW(eager.parameters())
    peaks = [measure_allocator_peak(_iteration, eager, eager_optimizer, inputs, targets,
                                    track=(list(eager.parameters()), eager_optimizer.state)
                                    ).peak_bytes for _ in range(2)]
    # one parameter at a time: the square root of its second moment, and that over a scalar
    largest = max(p.untyped_storage().nbytes() for p in eager.parameters())
    assert 2 * largest <= step_temporary_bytes(eager_optimizer, torch.device("cpu")) <= (
        2 * largest + 8192)  # and a few 0-dim tensors
    budget = int(0.95 * max(peaks))  # the activations of 32 rows are under 5% of it

    model = _wide()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    with pytest.raises(BudgetError, match="optimizer's step alone needs") as refused:
        _iteration(fitted, optimizer, inputs, targets)
    assert budget < refused.value.minimum_bytes <= max(peaks)
    assert "fused=True" in str(refused.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert all(parameter.grad is None for parameter in model.parameters())
    assert not optimizer.state


@pytest.mark.parametrize("make", [
    lambda parameters: torch.optim.AdamW(parameters),
    lambda parameters: torch.optim.AdamW(parameters, foreach=True),
    lambda parameters: torch.optim.AdamW(parameters, fused=True),
    lambda parameters: torch.optim.Adam(parameters, weight_decay=0.01),
    lambda parameters: torch.optim.Adam(parameters, weight_decay=0.01, foreach=True),
    lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9),
    lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9, weight_decay=1e-4,
                                       nesterov=True),
    lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9, weight_decay=1e-4,
                                       nesterov=True, foreach=True),
], ids=["adamw", "adamw-foreach", "adamw-fused", "adam-decay", "adam-decay-foreach", "sgd",
        "sgd-decay-nesterov", "sgd-decay-nesterov-foreach"])
def test_the_steps_temporaries_are_what_the_allocator_measures(make):
    model = _wide()
    optimizer = make(model.parameters())
    for step in range(2):  # the first step makes the state; the second is every later one's
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape,
                                         generator=torch.Generator().manual_seed(step))
        measured = measure_allocator_peak(optimizer.step, track=(
            list(model.parameters()), [p.grad for p in model.parameters()], optimizer.state))
    estimate = step_temporary_bytes(optimizer, torch.device("cpu"))
    temporaries = measured.peak_bytes - measured.start_bytes
    assert abs(temporaries - estimate) <= 32 * 1024, (temporaries, estimate)  # scalars aside


def test_the_smallest_peak_a_refusal_names_fits_the_optimizers_step_too():
    """Where no plan of the activations fits, the refusal's smallest peak is the step's where
    that is higher: a budget at it is not refused, and runs the first iteration within it but
    for what the loop holds that the first call cannot see (the targets, 256 B, and the
    loss)."""
    inputs = torch.randn(32, 512, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    model = _wide()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=1_000_000, optimizer=optimizer)
    with pytest.raises(BudgetError, match="optimizer's step would not fit") as refused:
        _iteration(fitted, optimizer, inputs, targets)
    budget = refused.value.minimum_bytes
    torch._dynamo.reset()
    model = _wide()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    measured = measure_allocator_peak(_iteration, fitted, optimizer, inputs, targets,
                                      track=(list(model.parameters()), optimizer.state))
    assert measured.peak_bytes <= budget + 1024, (measured.peak_bytes, budget)


def _residual_mlp() -> nn.Module:
    """Activations outweigh parameters at 2,048 rows: plans have room to lower the peak."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
                           for _ in range(4)], nn.Linear(128, 10))


def _loop_making_its_optimizer_each_epoch(model, fitted_at=None):
    """Six steps, a new AdamW every two (the old one dropped), each measured with the live
    optimizer's state; where ``fitted_at`` is a budget, the model is fitted to it with the first
    optimizer. Returns losses, peaks, the memfit warnings and a weak reference to the first
    optimizer."""
    import gc
    import warnings
    import weakref

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2048, 128, generator=generator),
                torch.randint(0, 10, (2048,), generator=generator)) for _ in range(6)]
    called, losses, peaks, first = model, [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, (inputs, targets) in enumerate(batches):
            if index % 2 == 0:
                optimizer = torch.optim.AdamW(model.parameters())
                gc.collect()  # the dropped optimizer's state is freed as the loop drops it
                if first is None:
                    first = weakref.ref(optimizer)
                    if fitted_at is not None:
                        called = memfit.fit(model, budget=fitted_at, optimizer=optimizer)
            measured = measure_allocator_peak(_iteration, called, optimizer, inputs, targets,
                                              track=(list(model.parameters()), optimizer.state))
            losses.append(measured.result)
            peaks.append(measured.peak_bytes)
    said = [str(w.message) for w in caught if issubclass(w.category, memfit.BudgetWarning)]
    return losses, peaks, said, first


def test_an_optimizer_the_loop_makes_again_each_epoch_is_not_kept_nor_counted_once_dropped():
    """memfit held every optimizer it counted: one the loop dropped kept its state alive, and
    was counted beside the new one until no plan fitted (refused at the sixth step)."""
    reference_losses, eager_peaks, _, _ = _loop_making_its_optimizer_each_epoch(_residual_mlp())
    budget = int(0.6 * max(eager_peaks))
    losses, peaks, said, first = _loop_making_its_optimizer_each_epoch(_residual_mlp(), budget)
    assert first() is None  # freed once the loop dropped it
    assert max(peaks) <= budget and not said, (peaks, budget, said)
    assert all(torch.equal(mine, theirs)
               for mine, theirs in zip(losses, reference_losses, strict=True))
