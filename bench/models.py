"""Per-model figures: unplanned vs swap-all peaks, simulated H100 step times, the largest batch
that fits a fixed budget with and without memfit (predicted, then verified by a measured run),
and the executor's overhead against eager PyTorch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

import memfit
from bench.common import (
    compare_gradients,
    eager_step,
    gradients,
    interleaved_medians_s,
    mib,
    ms,
)
from memfit import examples
from memfit.data.errors import BudgetError

PLANNING_HARDWARE = "h100-pcie"
SEARCH_LIMIT = 16  # search batches up to this many times the base batch


@dataclass(frozen=True)
class BenchModel:
    """One model at its bench size, with the ratio TFLMS reported for it (if any)."""

    name: str
    build: Callable[[], examples.Example]
    base_batch: int
    tflms_ratio: str


BENCH_MODELS = (
    BenchModel("GPT-2 (4 layers, width 128, sequence 256)",
               lambda: examples.gpt2(layers=4, width=128, heads=4, vocab=256, sequence=256), 4,
               "-"),
    BenchModel("ResNet-50-shaped (stage widths 32-256, 128x128 images)",
               lambda: examples.resnet50_shaped(widths=(32, 64, 128, 256), image=128), 4,
               "4.7x (ResNet-50)"),
    BenchModel("3D U-Net (MONAI, channels 4-32, 48^3 volumes)",
               lambda: examples.unet3d(channels=(4, 8, 16, 32), size=48), 2, "2x (3D U-Net)"),
)


def run_step(example: examples.Example, batch: int, strategy: str, budget=None,
             measure: bool = True) -> memfit.Step:
    """Compile on a copy of the model and run one step on the CPU; the Step keeps the figures."""
    model = copy.deepcopy(example.model)
    step = memfit.compile(model, example.loss_fn, budget=budget, strategy=strategy,
                          hardware=PLANNING_HARDWARE, measure=measure)
    step(*example.inputs(batch))
    return step


def fits(example: examples.Example, batch: int, strategy: str, budget_bytes: int) -> bool:
    """Whether ``strategy`` predicts a plan within ``budget_bytes`` at ``batch`` (nothing runs)."""
    try:
        memfit.plan(example.model, example.loss_fn, *example.inputs(batch), budget=budget_bytes,
                    hardware=PLANNING_HARDWARE, strategy=strategy)
    except BudgetError:
        return False
    return True


def largest_predicted_batch(example: examples.Example, strategy: str, budget_bytes: int,
                            base: int) -> int:
    """Doubling then bisection over batch sizes on predicted fit; 0 if even batch 1 fails."""
    low, high = 0, None  # low fits (0: nothing yet), high does not
    batch = base
    while high is None:
        if fits(example, batch, strategy, budget_bytes):
            low = batch
            if batch >= SEARCH_LIMIT * base:
                return batch
            batch *= 2
        else:
            high = batch
    while high - low > 1:
        middle = (low + high) // 2
        if fits(example, middle, strategy, budget_bytes):
            low = middle
        else:
            high = middle
    return low


def verified_batch(example: examples.Example, strategy: str, budget_bytes: int,
                   base: int) -> tuple[int, int]:
    """The largest batch predicted to fit, stepped down until a measured run is within budget.

    Returns:
        (batch, measured peak bytes); (0, 0) if nothing fits.
    """
    batch = largest_predicted_batch(example, strategy, budget_bytes, base)
    while batch > 0:
        step = run_step(example, batch, strategy, budget=budget_bytes)
        assert step.measured is not None
        if step.measured.peak_bytes <= budget_bytes:
            return batch, step.measured.peak_bytes
        batch -= 1
    return 0, 0


def model_rows(bench: BenchModel, log: Callable[[str], None]) -> tuple[tuple, tuple]:
    """One row of the capacity table and one of the overhead table for ``bench``."""
    example = bench.build()
    base = bench.base_batch
    keep = run_step(example, base, "keep")
    swap_all = run_step(example, base, "swap")
    assert keep.measured is not None and swap_all.measured is not None
    budget_bytes = keep.measured.peak_bytes
    log(f"{bench.name}: unplanned {mib(budget_bytes)}; searching batch sizes")
    without_batch, without_peak = verified_batch(example, "keep", budget_bytes, base)
    with_batch, with_peak = verified_batch(example, "swap", budget_bytes, base)
    ratio = f"{with_batch / without_batch:.2f}x" if without_batch else "-"
    capacity = (bench.name, base, mib(keep.measured.peak_bytes),
                mib(swap_all.measured.peak_bytes),
                mib(swap_all.predicted.peak_bytes + swap_all.compiled.outside_bytes),
                ms(swap_all.baseline.step_time_s), ms(swap_all.predicted.step_time_s),
                mib(budget_bytes), f"{without_batch} ({mib(without_peak)})",
                f"{with_batch} ({mib(with_peak)})", ratio, bench.tflms_ratio)
    return capacity, overhead_row(bench.name, example, base)


def overhead_row(name: str, example: examples.Example, batch: int) -> tuple:
    """CPU step time of eager ``loss.backward()`` vs memfit ``keep`` (tracker off), same model."""
    inputs = example.inputs(batch)
    model = example.model
    eager = eager_step(model, example.loss_fn, inputs)
    torch.manual_seed(0)
    eager()  # warm-up, and the reference gradients
    reference = gradients(model)
    step = memfit.compile(model, example.loss_fn, strategy="keep", measure=False)

    def planned() -> None:
        model.zero_grad(set_to_none=True)
        step(*inputs)

    torch.manual_seed(0)
    planned()  # capture and plan once; these gradients are compared
    same = compare_gradients(reference, gradients(model))
    eager_s, keep_s = interleaved_medians_s([eager, planned])
    return name, batch, ms(eager_s), ms(keep_s), f"{keep_s / eager_s:.2f}x", same


CAPACITY_HEADERS = ("model", "base batch", "unplanned peak (measured)",
                    "swap-all peak (measured)", "swap-all peak (predicted)",
                    "H100 step unplanned (simulated)",
                    "H100 step swap-all (simulated)", "fixed budget",
                    "largest batch without memfit (measured peak)",
                    "largest batch with memfit swap (measured peak)", "ratio", "TFLMS reported")
OVERHEAD_HEADERS = ("model", "batch", "eager step (median of 5)", "memfit keep step (median of 5)",
                    "keep / eager", "gradients vs eager")
