"""One process of ``test_inductor_warm_cache.py``: a small GPT-2 fitted with ``compiler=
"inductor"`` at a fraction of eager's measured peak, trained two iterations; prints, as one JSON
line, inductor's FX graph cache counters, the ops ``pin_planned_order`` pinned, where the plans
came from, the losses (bit patterns), each iteration's measured peak, each region's peak memfit
measured and its report."""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

import memfit
from memfit import examples
from memfit.fitting.fitted import BACKEND_KEY
from memfit.lowering import inductor
from tests.plan_cache_child import iteration_peaks

MODEL = dict(layers=2, width=64, heads=2, vocab=128, sequence=64)


def counting_pins() -> list[int]:
    """``pin_planned_order`` made to record how many ops it pins in each compiled module."""
    pinned: list[int] = []
    pin = inductor.pin_planned_order

    def recorded(module: torch.fx.GraphModule) -> int:
        pinned.append(pin(module))
        return pinned[-1]

    inductor.pin_planned_order = recorded
    return pinned


def main(fraction: float) -> None:
    torch.set_num_threads(1)
    eager = examples.gpt2(**MODEL)
    _, eager_peaks = iteration_peaks(eager, eager.model, torch.optim.AdamW(eager.model.parameters()))
    budget = int(fraction * max(eager_peaks))
    example = examples.gpt2(**MODEL)
    optimizer = torch.optim.AdamW(example.model.parameters())
    model = memfit.fit(example.model, budget=budget, optimizer=optimizer, compiler="inductor",
                       strategy="checkpoint")
    pinned = counting_pins()
    losses, peaks = iteration_peaks(example, model, optimizer)
    regions = model.__dict__[BACKEND_KEY].regions
    print(json.dumps({
        "budget_bytes": budget, "losses": losses, "peaks": peaks, "pinned": pinned,
        "fxgraph": {name: counters["inductor"][f"fxgraph_cache_{name}"]
                    for name in ("hit", "miss", "bypass")},
        "plans_made": sum(region.planning.plans_made for region in regions),
        "plans_cached": sum(region.planning.plans_cached for region in regions),
        "region_peaks": [region.measured_peak_bytes for region in regions],
        "report": memfit.report(model)}))


if __name__ == "__main__":
    main(float(sys.argv[1]))
