"""One process of ``test_plan_cache.py``'s acceptance test: a small GPT-2 fitted at a fraction of
eager's measured peak and trained a few iterations; prints, as one JSON line, what its plans
cost, where they came from, the plans, the losses (bit patterns) and each iteration's measured
peak beside the budget."""

from __future__ import annotations

import json
import sys

import torch

import memfit
from memfit import examples
from memfit.fitting.fitted import BACKEND_KEY
from memfit.runtime.measure import measure_allocator_peak

ITERATIONS = 2


def iteration_peaks(example: examples.Example, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[list[str], list[int]]:
    """The loop: forward, backward, step; each iteration's loss (``float.hex``) and peak."""
    losses, peaks = [], []
    for index in range(ITERATIONS):
        inputs = example.inputs()

        def step(index: int = index, inputs: tuple = inputs) -> torch.Tensor:
            torch.manual_seed(100 + index)  # dropout draws the same in every process
            loss = example.loss_fn(model, *inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        parameters = list(model.parameters())
        measured = measure_allocator_peak(step, track=(parameters, optimizer.state, inputs))
        losses.append(measured.result.item().hex())
        peaks.append(measured.peak_bytes)
    return losses, peaks


def main(fraction: float) -> None:
    torch.use_deterministic_algorithms(True)
    eager = examples.gpt2(layers=4, width=64, sequence=64)
    _, eager_peaks = iteration_peaks(eager, eager.model, torch.optim.AdamW(eager.model.parameters()))
    budget = int(fraction * max(eager_peaks))
    example = examples.gpt2(layers=4, width=64, sequence=64)
    optimizer = torch.optim.AdamW(example.model.parameters())
    model = memfit.fit(example.model, budget=budget, optimizer=optimizer, strategy="auto")
    losses, peaks = iteration_peaks(example, model, optimizer)
    regions = model.__dict__[BACKEND_KEY].regions
    print(json.dumps({
        "budget_bytes": budget, "losses": losses, "peaks": peaks,
        "planning_s": sum(region.planning.choosing_s for region in regions),
        "plans_made": sum(region.planning.plans_made for region in regions),
        "plans_cached": sum(region.planning.plans_cached for region in regions),
        "plans": [region.plan.to_json() for region in regions],
        "report": memfit.report(model)}))


if __name__ == "__main__":
    main(float(sys.argv[1]))
