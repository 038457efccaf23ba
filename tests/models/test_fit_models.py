"""memfit.fit on real models in the user's loop (forward, ``loss.backward()``, AdamW step, three
iterations), auto at 0.5 and 0.3 of *eager's* measured iteration peak, or at auto's true minimum
where the fraction does not fit (the test prints the budget it ran at).

Claims, per model:
- always: losses, every step's gradients, weights and buffers after the loop bit for bit eager's
  (deterministic algorithms on);
- every iteration's measured peak from ``BUDGET_HOLDS_FROM`` on (1: the first included, AdamW
  state included) within the budget. The CPU kernels' own buffers are counted
  (``memfit/tracing/temporaries.py``: dropout, batch norm, oneDNN convolutions by rule or, for 3D and
  transposed ones, measured once per shape; reduced losses' elementwise buffers).
  ``unet3d_loss_outside`` computes its loss eagerly, outside the compiled model: CPU ``mse_loss``
  keeps its elementwise buffer (65,536 B) under the 0-dim loss until the backward ends, beside
  the target (65,536 B), in memory no first plan knows of (before memfit read it, every
  iteration measured budget + 65,540 B). memfit reads what eager code holds at the region's
  start on its measured runs (``memfit.runtime.outside``) and plans again with room for it:
  from the second iteration on the budget holds. Where no plan has that room, the re-plan
  raises ``BudgetError`` with the smallest peak (eager code's bytes included), and the test
  runs again at that budget, as a user would (measured: auto's minimum with them, 1,045,484 B,
  is what iterations 2 and 3 measure). ``unet3d`` computes the same loss inside the compiled
  module (as a Hugging Face model returns its loss), where it is planned from the first
  iteration: predicted peak = measured peak.
``vit`` runs at auto's minimum (half of eager's peak is below it). It once measured 20,608 B
(0.84%) over that budget in its second iteration, 21,248 B over its prediction (the first
iteration, AdamW's state not yet real, 21,248 B over its own prediction as well): the
recomputing plan runs the CPU flash attention's forward again inside the backward, and its
per-thread blocks (21,248 B at two threads, 8x4x65x16) were in no memory model until
``memfit/tracing/temporaries.py`` counted them; now predicted peak = measured peak.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy
import pytest
import torch
from torch import nn

import memfit
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]


class _LossInside(nn.Module):
    """A model with its example's loss inside: ``forward(*inputs)`` returns the loss."""

    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs):
        return self.loss_fn(self.model, *inputs)


def _loss_inside(example: examples.Example) -> examples.Example:
    return dataclasses.replace(example, model=_LossInside(example.model, example.loss_fn),
                               loss_fn=lambda model, *inputs: model(*inputs))


def _unet3d() -> examples.Example:
    return examples.unet3d(channels=(4, 8, 16), size=16)


BUDGET_HOLDS_FROM = {"llama": 1, "t5": 1, "bert": 1, "gpt2": 1, "cnn": 1, "vit": 1, "resnet50": 1,
                     "unet3d": 1, "unet3d_loss_outside": 2}  # the iteration the budget holds from
BUILDERS = {"llama": examples.llama, "t5": examples.t5, "bert": examples.bert,
            "gpt2": examples.gpt2, "cnn": examples.cnn, "vit": examples.vit,
            "resnet50": lambda: examples.resnet50_shaped(widths=(8, 16, 32, 64), image=32,
                                                         batch_size=2),
            "unet3d": lambda: _loss_inside(_unet3d()), "unet3d_loss_outside": _unet3d}
# of eager's peak: both of the acceptance's budgets on its models, 0.5 on the others
FRACTIONS = {name: (0.5, 0.3) for name in ("bert", "cnn", "llama", "t5", "unet3d", "vit")}
# where the region's predicted peak is the measured one within 1%: every model whose loss is
# inside its one region (with the loss outside, the eager loss's buffers are in no plan).
# The transformers models' predictions follow what the loop held (memfit.compiler.region_lifetimes): the
# logits and key/value caches the loop drops, the tangents autograd passes or leaves None
PREDICTION_MATCHES = {"llama", "t5", "bert", "gpt2", "cnn", "vit", "resnet50", "unet3d"}


def train(example, model, runner=None, iterations: int = 3, gradients: list | None = None):
    """Losses and measured peaks of ``iterations`` AdamW steps; with ``gradients``, each step's
    gradients are appended to it (copied before the optimizer reads them, by ``host_copy``, into
    memory that the measurement does not see: a user's loop keeps no such copies)."""
    optimizer = torch.optim.AdamW(model.parameters())
    if gradients is not None:
        optimizer.register_step_pre_hook(lambda *_: gradients.append(
            [host_copy(p.grad) for p in model.parameters()]))
    runner = runner(model, optimizer) if runner else model
    inputs = example.inputs()
    losses, peaks = [], []
    for index in range(iterations):
        def iteration(index=index):
            torch.manual_seed(100 + index)
            loss = example.loss_fn(runner, *inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().clone()  # not a view that keeps a CPU mse_loss buffer alive

        measured = measure_allocator_peak(
            iteration, track=(list(model.parameters()), list(model.buffers()), optimizer.state,
                              inputs))
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def host_copy(tensor: torch.Tensor | None) -> numpy.ndarray | None:
    """A copy of ``tensor`` in numpy's memory, which torch's CPU allocator (so the measured peak
    and memfit's reading of eager code's bytes) does not own."""
    return None if tensor is None else tensor.detach().numpy().copy()


def same_bits(copy_: numpy.ndarray | None, expected: numpy.ndarray | None) -> bool:
    """Both absent, or the same dtype, shape and bytes (NaNs and signed zeros included)."""
    if copy_ is None or expected is None:
        return copy_ is None and expected is None
    return (copy_.dtype == expected.dtype and copy_.shape == expected.shape
            and copy_.tobytes() == expected.tobytes())


@functools.cache
def eager_run(name: str):
    """The example, and eager's model, losses, measured peaks and gradients after the loop (shared
    by a model's budgets: read only)."""
    example = BUILDERS[name]()
    reference, gradients = copy.deepcopy(example.model), []
    losses, peaks = train(example, reference, gradients=gradients)
    return example, reference, losses, peaks, gradients


@pytest.mark.parametrize(("name", "fraction"), [
    (name, fraction) for name in sorted(BUILDERS) for fraction in FRACTIONS.get(name, (0.5,))])
def test_fit_trains_real_models_as_eager(name, fraction):
    example, reference, reference_losses, eager_peaks, reference_gradients = eager_run(name)
    holds_from = BUDGET_HOLDS_FROM[name]
    budget = int(fraction * max(eager_peaks))

    compiled = []

    def fitted(model, optimizer):
        compiled.append(memfit.fit(model, budget=budget, optimizer=optimizer))
        return compiled[-1]

    for _attempt in range(4):  # the fraction may not fit: then auto's minimum must
        model, gradients = copy.deepcopy(example.model), []
        try:
            losses, peaks = train(example, model, fitted, gradients=gradients)
            break
        except memfit.BudgetError as error:  # at compile, or at a re-plan with eager code's bytes
            assert error.minimum_bytes > budget
            budget = error.minimum_bytes
            print(f"{name}: refused, smallest peak {budget:,} B")
    else:
        pytest.fail(f"no run fit the budget {budget:,} B in 4 attempts")
    for loss, expected in zip(losses, reference_losses, strict=True):
        assert torch.equal(loss, expected)
    for step, expected_step in zip(gradients, reference_gradients, strict=True):
        for gradient, expected in zip(step, expected_step, strict=True):
            assert same_bits(gradient, expected)
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected)
    for buffer, expected in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(buffer, expected)
    print(f"{name} at {fraction}: budget {budget:,} B ({budget / max(eager_peaks):.3f} of eager's "
          f"peak), measured {peaks}")
    assert max(peaks[holds_from - 1:]) <= budget, (peaks, budget)
    if name in PREDICTION_MATCHES:  # one region, AdamW's state reserved: its predicted peak
        predicted = max(r.predicted_peak_bytes for r in compiled[-1]._memfit_backend.regions)
        print(f"{name}: predicted {predicted:,} B, measured {max(peaks):,} B")
        assert abs(max(peaks) - predicted) <= 0.01 * max(peaks), (peaks, predicted)
