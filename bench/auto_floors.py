"""auto's floor on the real models: ``memfit.fit`` at a tiny budget, then at the minimum it reports.

For each model (bert, gpt2, vit, llama, t5 by default), in the user's loop (forward,
``loss.backward()``, AdamW step, two iterations): ``memfit.fit`` at a budget of two bytes raises
``BudgetError``; its ``minimum_bytes`` is auto's floor. The loop then runs again at that minimum
(and at each new minimum a re-plan reports, four tries at most), which gives the smallest budget
auto fits, and the peak measured there (``measure_allocator_peak``). The graphs auto planned are
saved as JSON (``--graphs DIR``) so that candidates can be compared on them without torch.

Usage: ``python -m bench.auto_floors [--graphs DIR] [model ...]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import memfit
import memfit.compiler.backend
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

MODELS = ("bert", "gpt2", "vit", "llama", "t5")
ATTEMPTS = 4  # as tests/models/test_fit_models.py: a re-plan may report a higher minimum
TINY_BYTES = 2  # a bare 1 would mean the whole unplanned peak (a fraction)


def _recording_plan_step(saved: list[dict]):
    """``plan_step`` that keeps each graph, hardware and outside bytes it is given."""
    original = memfit.compiler.backend.plan_step

    def plan_step(graph, hardware, budget, strategy, params, outside_bytes=0, *rest, **named):
        saved.append({"graph": graph.to_json(), "hardware": hardware.to_json(),
                      "outside_bytes": outside_bytes})
        return original(graph, hardware, budget, strategy, params, outside_bytes, *rest, **named)

    return plan_step


def _train(example, model, budget_bytes: int, iterations: int = 2) -> list[int]:
    """The measured peak of each iteration of the loop under ``memfit.fit`` at ``budget_bytes``."""
    optimizer = torch.optim.AdamW(model.parameters())
    runner = memfit.fit(model, budget=budget_bytes, optimizer=optimizer)
    inputs = example.inputs()
    peaks = []
    for index in range(iterations):
        def iteration(index=index):
            torch.manual_seed(100 + index)
            loss = example.loss_fn(runner, *inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        measured = measure_allocator_peak(
            iteration, track=(list(model.parameters()), list(model.buffers()), optimizer.state,
                              inputs))
        peaks.append(measured.peak_bytes)
    return peaks


def floor(name: str, graphs_dir: Path | None) -> dict:
    """auto's minimum at a two-byte budget, the budget it fits and the peaks measured there."""
    import copy

    example = getattr(examples, name)()
    saved: list[dict] = []
    memfit.compiler.backend.plan_step = _recording_plan_step(saved)
    budget, minimums, started_s = TINY_BYTES, [], time.perf_counter()
    peaks = None
    for _attempt in range(ATTEMPTS):  # main() puts the original plan_step back
        torch._dynamo.reset()
        try:
            peaks = _train(example, copy.deepcopy(example.model), budget)
            break
        except memfit.BudgetError as error:
            minimums.append(error.minimum_bytes)
            budget = error.minimum_bytes
    if graphs_dir is not None:
        graphs_dir.mkdir(parents=True, exist_ok=True)
        (graphs_dir / f"{name}.json").write_text(json.dumps(saved[-1]))
    return {"model": name, "minimums": minimums, "fits_at": budget if peaks else None,
            "measured": peaks, "time_s": round(time.perf_counter() - started_s, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=Path, default=None)
    parser.add_argument("models", nargs="*", default=list(MODELS))
    arguments = parser.parse_args(argv)
    original = memfit.compiler.backend.plan_step
    for name in arguments.models:
        try:
            print(json.dumps(floor(name, arguments.graphs)), flush=True)
        finally:
            memfit.compiler.backend.plan_step = original


if __name__ == "__main__":
    main(sys.argv[1:])
