"""Two fitted models in one loop (a GAN: a generator and a discriminator, each fitted with the
device's budget, each with its own Adam): every region's plan leaves room for what the other
model keeps resident (parameters, gradients, optimizer state), which a CPU's eager watch does not
see. Every iteration from the second on within the budget, training bit for bit eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]

BATCH = 512


def _mlp(inputs: int, outputs: int, width: int = 256, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.LeakyReLU(0.2)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers, nn.Linear(width, outputs))


def _gan_loop(generator, discriminator, budget_bytes=None, iterations=3):
    """Losses and measured peaks of a GAN loop: the discriminator's step on real and generated
    samples, then the generator's through the discriminator."""
    real = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(1))
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    generator_optimizer = torch.optim.Adam(generator.parameters(), 1e-4)
    discriminator_optimizer = torch.optim.Adam(discriminator.parameters(), 1e-4)
    if budget_bytes is not None:
        memfit.fit(generator, budget=budget_bytes, optimizer=generator_optimizer)
        memfit.fit(discriminator, budget=budget_bytes, optimizer=discriminator_optimizer)
    criterion = nn.functional.binary_cross_entropy_with_logits
    losses, peaks = [], []
    for index in range(iterations):
        def iteration(index=index):
            noise = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(10 + index))
            fake = generator(noise)
            discriminator_loss = (criterion(discriminator(real), ones)
                                  + criterion(discriminator(fake.detach()), zeros))
            discriminator_loss.backward()
            discriminator_optimizer.step()
            discriminator_optimizer.zero_grad(set_to_none=True)
            generator_loss = criterion(discriminator(fake), ones)
            generator_loss.backward()
            generator_optimizer.step()
            generator_optimizer.zero_grad(set_to_none=True)
            discriminator.zero_grad(set_to_none=True)
            return torch.stack([discriminator_loss.detach(), generator_loss.detach()])

        tracked = (list(generator.parameters()), list(discriminator.parameters()),
                   generator_optimizer.state, discriminator_optimizer.state, real, ones, zeros)
        measured = measure_allocator_peak(iteration, track=tracked)
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def test_a_gan_fitted_twice_holds_the_budget_for_both():
    torch.manual_seed(0)
    generator, discriminator = _mlp(32, 64), _mlp(64, 1)
    reference_losses, eager_peaks = _gan_loop(copy.deepcopy(generator),
                                              copy.deepcopy(discriminator))
    budget = int(0.7 * max(eager_peaks))
    losses, peaks = _gan_loop(generator, discriminator, budget)
    print(f"budget {budget:,} B, eager {eager_peaks}, memfit {peaks}")
    assert all(map(torch.equal, losses, reference_losses))
    assert max(peaks[1:]) <= budget, (peaks, budget)
    # each counts the other: the discriminator's Adam state, parameters and gradients
    assert generator._memfit_backend.partners()
    assert discriminator._memfit_backend.partners()
