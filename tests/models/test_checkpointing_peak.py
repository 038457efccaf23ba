"""memfit.fit at per-block checkpointing's measured peak (issue 28's acceptance), in a user's loop.

Per model: transformers' ``gradient_checkpointing_enable()`` (non-reentrant, as bench/fit.py
turns it on) is trained for two iterations (forward, ``loss.backward()``, AdamW ``step``,
``zero_grad``) and its largest measured iteration peak is memfit's budget; memfit.fit then trains
a fresh copy of the same weights for three iterations. Claims: every iteration's measured peak,
the first included, within that budget; the weights after them bit for bit eager's (the same
iterations unfitted; deterministic algorithms on); no ``BudgetWarning``.

Llama computes its ``labels=`` loss inside one compiled region and returns its logits and its
key/value cache beside the loss: planned with those held to the iteration's end, no plan fit
checkpointing's peak. It is planned for the loop as it runs (the loop keeps only ``.loss``:
``memfit.compiler.loop_lifetimes``). GPT-2 with ``labels=`` (its loss behind a graph break) and
BERT with a padded mask stand beside it. Per model, too: the ``BudgetError`` at half that peak
names a minimum at most the peak, and a loop that keeps its loss, fitted at exactly that minimum,
runs every iteration within it, fitted inside the handler of that error (the failed call's
traceback alive).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import memfit
from bench.fit import _builder
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]

MODELS = {
    "llama": functools.partial(examples.llama, layers=4, width=128, heads=4, kv_heads=2,
                               vocab=1024, sequence=256, batch_size=8),  # bench's
    "gpt2": functools.partial(examples.gpt2, layers=2, width=64, heads=4, vocab=1024,
                              sequence=128, batch_size=4),
    "bert": functools.partial(examples.bert, layers=2, width=64, heads=2, vocab=1024,
                              sequence=128, batch_size=8),  # a padded mask
}
ITERATIONS = 3


def _trained(example: examples.Example, inputs: tuple, iterations: int, wrap=None,
             checkpointed: bool = False) -> tuple[torch.nn.Module, list[int]]:
    """A fresh copy of the example's model trained ``iterations`` times (``bench.fit``'s loop,
    which keeps each iteration's loss), and each iteration's measured peak."""
    model, run, optimizer = _builder(example, inputs, wrap,
                                     block_types=() if checkpointed else None)()
    peaks = []
    for _ in range(iterations):
        measured = measure_allocator_peak(run, track=(list(model.parameters()), optimizer.state,
                                                      inputs))
        peaks.append(measured.peak_bytes)
    return model, peaks


def _fitted(budget_bytes: int):
    return lambda model, optimizer: memfit.fit(model, budget=budget_bytes, optimizer=optimizer)


def _assert_bitwise(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fit_holds_checkpointings_measured_peak(name):
    example = MODELS[name]()
    inputs = example.inputs()
    _, checkpoint_peaks = _trained(example, inputs, 2, checkpointed=True)
    budget = max(checkpoint_peaks)
    eager, _ = _trained(example, inputs, ITERATIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        fitted, peaks = _trained(example, inputs, ITERATIONS, _fitted(budget))
    print(name, "checkpointing", checkpoint_peaks, "memfit", peaks)
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    _assert_bitwise(fitted, eager)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fits_at_its_budget_errors_minimum(name):
    example = MODELS[name]()
    inputs = example.inputs()
    _, checkpoint_peaks = _trained(example, inputs, 2, checkpointed=True)
    eager, _ = _trained(example, inputs, ITERATIONS)
    try:
        _trained(example, inputs, 1, _fitted(max(checkpoint_peaks) // 2))
    except memfit.BudgetError as error:  # fitted again inside the handler, as a user would:
        minimum = error.minimum_bytes  # the failed call's traceback is alive meanwhile
        assert minimum <= max(checkpoint_peaks)
        with warnings.catch_warnings():
            warnings.simplefilter("error", memfit.BudgetWarning)
            fitted, peaks = _trained(example, inputs, ITERATIONS, _fitted(minimum))
    else:
        pytest.fail("memfit.fit ran at half checkpointing's peak: pick a smaller budget")
    print(name, "checkpointing", checkpoint_peaks, "minimum", minimum, "memfit", peaks)
    assert all(peak <= minimum for peak in peaks), (peaks, minimum)
    _assert_bitwise(fitted, eager)
