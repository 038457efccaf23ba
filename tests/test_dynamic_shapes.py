"""memfit.fit in loops whose batch shapes change: one plan priced at the largest sizes serves
every smaller shape (Dynamo traces the region once more with symbolic sizes), a larger shape plans
once more, and every iteration, the first included, stays within the budget, bitwise eager's."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak
from tests.test_backend import _bert, _train_hf  # the same BERT and loop as the static test

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 1))


def _mlp_batches(sizes):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 128, generator=generator), torch.randn(size, 1, generator=generator))
            for size in sizes]


def _train(model, optimizer, data):
    """The user's loop; losses and each iteration's measured peak."""
    losses, peaks = [], []
    for index, (x, y) in enumerate(data):
        def iteration(x=x, y=y, index=index):
            torch.manual_seed(100 + index)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        parameters = list(optimizer.param_groups[0]["params"])
        measured = measure_allocator_peak(iteration, track=(parameters, optimizer.state, x, y))
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def _fitted_at(fraction: float, data, build=_mlp):
    """An eager model (``build``'s, the MLP by default) trained on ``data`` (the reference), and
    a fresh one fitted at ``fraction`` of the eager loop's largest iteration peak: reference,
    its losses, model, optimizer, the fitted model and the budget."""
    reference = build()
    reference_losses, eager_peaks = _train(reference, torch.optim.AdamW(reference.parameters()),
                                           data)
    budget = int(fraction * max(eager_peaks))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    return reference, reference_losses, model, optimizer, fitted, budget


def _assert_same_training(model, reference, losses, reference_losses):
    for loss, expected in zip(losses, reference_losses, strict=True):
        assert torch.equal(loss, expected)
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(),
                                           strict=True):
        assert torch.equal(parameter, expected), name


def _assert_close_training(model, reference, losses, reference_losses):
    """Losses and weights within ``assert_close``'s float32 defaults (inductor's kernels)."""
    for loss, expected in zip(losses, reference_losses, strict=True):
        torch.testing.assert_close(loss, expected)
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter, expected)


@pytest.mark.slow
def test_a_varying_batch_size_is_planned_twice_and_fits_every_iteration():
    """Batch sizes 2048, then 12 smaller ones, then a smaller last batch: the first shape is
    planned as it is, the second traces the region with a symbolic batch size, priced at that
    shape's size; every later shape runs that plan, Dynamo tracing nothing again."""
    sizes = [2048, 2040, *range(1024, 2040, 90), 300]
    data = _mlp_batches(sizes)
    reference, reference_losses, model, optimizer, fitted, budget = _fitted_at(0.7, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        losses, peaks = _train(fitted, optimizer, data)
    _assert_same_training(model, reference, losses, reference_losses)
    planner = fitted._memfit_backend
    assert len(planner.regions) == 2, [region.shape_bound for region in planner.regions]
    assert planner.regions[1].shape_bound, "the second plan is the dynamic one"
    assert max(peaks) <= budget, (peaks, budget)
    assert "2 plans made" in memfit.report(fitted)


@pytest.mark.slow
def test_a_larger_shape_plans_once_more_at_the_raised_bound():
    """Past the bound the plan was priced at, the region is planned again from the same trace
    before the run, so that run is within the budget too; smaller shapes after it run that plan."""
    sizes = [512, 640, 768, 1536, 700, 1200]
    data = _mlp_batches(sizes)
    reference, reference_losses, model, optimizer, fitted, budget = _fitted_at(0.7, data)
    losses, peaks = _train(fitted, optimizer, data)
    _assert_same_training(model, reference, losses, reference_losses)
    planner = fitted._memfit_backend
    assert planner.bound_replans == 2  # 768, then 1536
    assert [max(r.shape_bound.values()) for r in planner.regions if r.shape_bound] == [640, 768,
                                                                                      1536]
    assert max(peaks) <= budget, (peaks, budget)


@pytest.mark.slow
def test_inductor_serves_changing_batch_sizes_within_budget_close_to_torch_compile():
    """compiler="inductor": the symbolic program memfit rewrote, compiled by inductor, runs
    every batch size within the budget with two plans; results are torch.compile's, close."""
    data = _mlp_batches([2048, 2040, 1500, 1200, 2000, 300])
    reference = _mlp()
    _, eager_peaks = _train(reference, torch.optim.AdamW(reference.parameters()), data)
    compiled_reference = _mlp()
    reference_losses, _ = _train(torch.compile(compiled_reference),
                                 torch.optim.AdamW(compiled_reference.parameters()), data)
    budget = int(0.7 * max(eager_peaks))
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer, compiler="inductor")
    losses, peaks = _train(fitted, optimizer, data)
    _assert_close_training(model, compiled_reference, losses, reference_losses)
    assert len(fitted._memfit_backend.regions) == 2
    assert max(peaks) <= budget, (peaks, budget)


def _padded_batches(lengths, batch_size: int = 8, last_batch_size: int = 3):
    """Batches padded to their longest sequence: one length each, the last batch smaller."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for index, length in enumerate(lengths):
        size = batch_size if index < len(lengths) - 1 else last_batch_size
        input_ids = torch.randint(0, 128, (size, length), generator=generator)
        attention_mask = torch.ones(size, length, dtype=torch.long)
        attention_mask[::2, length * 3 // 4:] = 0  # padded rows: the mask matters
        labels = torch.randint(0, 2, (size,), generator=generator)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask,
                        "labels": labels})
    return batches


@pytest.mark.slow
def test_bert_fine_tuned_on_padded_batches_of_13_lengths_is_planned_twice_within_budget():
    """13 sequence lengths and a smaller last batch at 0.7 of eager's largest iteration peak:
    the first length is planned as it is, the second traces the region with symbolic length and
    batch size, priced at the length's range (the position embeddings bound it) and that batch
    size; every later batch runs that plan. Every iteration within budget, bitwise eager's."""
    lengths = [200, 96, 40, 64, 128, 80, 112, 56, 144, 176, 160, 48, 120]
    data = _padded_batches(lengths)
    reference = _bert()
    reference_losses, eager_peaks = _train_hf(
        reference, torch.optim.AdamW(reference.parameters()), data)
    budget = int(0.7 * max(eager_peaks))
    model = _bert()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        losses, peaks = _train_hf(fitted, optimizer, data)
    _assert_same_training(model, reference, losses, reference_losses)
    assert max(peaks) <= budget, (peaks, budget)
    report = memfit.report(fitted)
    print(f"budget {budget:,} B, peaks {peaks}\n{report}")
    assert len(fitted._memfit_backend.regions) <= 2
    assert "2 plans made" in report


@pytest.mark.slow
def test_bert_on_padded_batches_with_inductor_is_planned_twice_within_budget_close_to_compile():
    """The same fine-tune with ``compiler="inductor"``: every iteration within 0.7 of eager's
    largest peak, two plans, no ``BudgetWarning``; losses and weights close to
    ``torch.compile(dynamic=True)``'s, dropout drawn as eager draws it in both (memfit compiles
    with ``fallback_random``, so the reference does too)."""
    lengths = [200, 96, 40, 64, 128, 80, 112, 56, 144, 176, 160, 48, 120]
    data = _padded_batches(lengths)
    reference = _bert()
    _, eager_peaks = _train_hf(reference, torch.optim.AdamW(reference.parameters()), data)
    budget = int(0.7 * max(eager_peaks))
    compiled_reference = _bert()
    with torch._inductor.config.patch(fallback_random=True):
        reference_losses, _ = _train_hf(torch.compile(compiled_reference, dynamic=True),
                                        torch.optim.AdamW(compiled_reference.parameters()), data)
    fitted = _fitted_with_inductor(_bert, data, budget, compiled_reference, reference_losses)
    assert "2 plans made" in memfit.report(fitted)


def _fitted_with_inductor(build, data, budget: int, compiled_reference, reference_losses):
    """``build()`` fitted with ``compiler="inductor"`` at ``budget`` and fine-tuned on ``data``
    with no ``BudgetWarning``, every iteration within the budget, losses and weights close to
    ``compiled_reference``'s; the fitted model."""
    torch._dynamo.reset()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer, compiler="inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        losses, peaks = _train_hf(fitted, optimizer, data)
    _assert_close_training(model, compiled_reference, losses, reference_losses)
    assert max(peaks) <= budget, (peaks, budget)
    return fitted


@pytest.mark.slow
def test_a_swap_plan_at_the_length_bound_holds_its_prediction_under_inductor():
    """BERT (positions up to 128) on padded lengths 64, 96, 128 under ``compiler="inductor"`` at
    0.6 of plain ``torch.compile``'s largest iteration peak: the plan at the bound swaps
    activations to the host, and every measured run is within that plan's prediction and every
    iteration within the budget, with no ``BudgetWarning``. It measured 7.64 MiB against a
    5.51 MiB prediction (the 128 batch 7.22 MB at a 6.23 MB budget): inductor saved a device
    copy of each attention value's host copy, held swapped-in copies to their ``memfit::wait``
    and freed buffers until it reused them (``memfit.lowering.inductor``)."""
    from memfit import examples

    def bert() -> nn.Module:
        return examples.bert(layers=2, width=64, heads=2, vocab=128, sequence=128).model

    data = _padded_batches([64, 96, 128], last_batch_size=8)
    compiled_reference = bert()
    reference_losses, compiled_peaks = _train_hf(
        torch.compile(compiled_reference), torch.optim.AdamW(compiled_reference.parameters()),
        data)
    budget = int(0.6 * max(compiled_peaks))
    fitted = _fitted_with_inductor(bert, data, budget, compiled_reference, reference_losses)
    regions = fitted._memfit_backend.regions
    bounded = [region for region in regions if region.shape_bound]
    assert bounded and all(region.plan.swapped for region in bounded), memfit.report(fitted)
    for region in regions:
        assert region.measured_peak_bytes <= region.predicted_peak_bytes, memfit.report(fitted)


def test_a_run_past_the_sizes_measured_so_far_is_measured_too():
    """A plan priced at a declared maximum is checked on its first runs, at their sizes; a later
    run at larger sizes within the bound (a longer padded batch) has its forward and backward
    measured too, so a peak over the budget there (inductor's kernels at that shape, the loop's
    loss growing with it) is said at that call, not missed. Smaller runs after it are not."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fitted = memfit.fit(model, budget="64MB", optimizer=optimizer)
    measured = []
    for x, y in _mlp_batches([300, 600, 400, 1024, 500, 1024]):
        torch._dynamo.mark_dynamic(x, 0, min=2, max=1024)
        nn.functional.mse_loss(fitted(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        region = fitted._memfit_backend.regions[-1]
        measured.append((region.index, region.measured_runs, region.measured_forward_bytes))
    (plan, before, _), (at_largest, runs, largest_bytes) = measured[2], measured[3]
    assert plan == at_largest == measured[5][0], measured  # one plan from the third run on
    assert runs == before + 2, "the forward and backward at 1024 rows measured"
    assert measured[5][1] == runs, "runs within the sizes measured already are not measured"
    assert largest_bytes > measured[2][2], measured


def test_a_plan_made_again_on_fakes_counts_what_the_loop_holds_beside_it():
    """A dynamic region is planned again from fake inputs (here: a batch past its bound), beside
    which eager code holds nothing; what the loop holds by then (a kept evaluation's outputs,
    metrics) is read beside the real arguments. Where the plan has no room for it, the call is
    refused before anything runs (before, that iteration ran over the budget, and said so
    after), and the model is as it was."""
    data = _mlp_batches([512, 640, 1536])
    _, _, model, optimizer, fitted, budget = _fitted_at(0.7, data)
    _, peaks = _train(fitted, optimizer, data[:2])
    assert max(peaks) <= budget, (peaks, budget)
    kept = torch.zeros(budget // 16 // 4)  # a sixteenth of the budget, made after both plans
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with pytest.raises(memfit.BudgetError, match="held by eager code") as refused:
        _train(fitted, optimizer, data[2:])
    assert refused.value.minimum_bytes > budget
    assert all(torch.equal(parameter, was)
               for parameter, was in zip(model.parameters(), before, strict=True))
    del kept


def test_a_smaller_last_batch_of_volumes_is_planned_at_the_sizes_seen_not_at_a_guards_limit():
    """A 3D segmentation net with a loss in the loop, batches of 4, a last batch of 2, then 4
    again. Tracing the batch size as a symbol, a CPU 3D convolution guards ``batch < 16`` to
    pick its kernel, so Dynamo's range for it ends at 15: priced there, no plan fit ("the
    smallest peak it can reach is 13.42 MiB" at 4.03 MiB, at the third call, one thread). No
    plan fitting that limit, the region is planned at the sizes it was traced with, and planned
    again for the batch of 4 after it: every iteration within the budget, bitwise eager's. (The
    loop's targets, made before it, count in their iteration and the next, not all at once.)"""
    from tests.test_eager_room import _Segmenter
    from tests.test_eager_room import _step as _segmentation_step

    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(size, 1, 16, 16, 16, generator=generator),
             torch.randint(0, 3, (size, 16, 16, 16), generator=generator)) for size in (4, 4, 2, 4)]
    torch.manual_seed(0)
    reference = _Segmenter()
    model = _Segmenter()
    model.load_state_dict(reference.state_dict())
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    eager = [measure_allocator_peak(_segmentation_step, reference, reference_optimizer, *batch,
                                    track=(list(reference.parameters()),
                                           reference_optimizer.state, *batch))
             for batch in data]
    budget = int(0.76 * max(measured.peak_bytes for measured in eager))
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        measured = [measure_allocator_peak(_segmentation_step, fitted, optimizer, *batch,
                                           track=(list(model.parameters()), optimizer.state,
                                                  *batch))
                    for batch in data]
    peaks = [run.peak_bytes for run in measured]
    assert max(peaks) <= budget, (peaks, budget)
    assert all(torch.equal(mine.result, theirs.result)
               for mine, theirs in zip(measured, eager, strict=True))
    dynamic = [region for region in fitted._memfit_backend.regions if region.shape_bound]
    assert [list(region.shape_bound.values()) for region in dynamic] == [[2], [4]]


def _convolution_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 1))


def test_inputs_whose_strides_change_are_planned_again_within_budget_bitwise():
    """The same batch shapes, the layout changing from the second batch on (channels-last
    images): Dynamo traces the region again with the input's strides as symbolic int inputs,
    and the storage sizes of the graph it hands over are ``SymInt`` constants. Planned on them
    as ints, every iteration fits, bitwise eager's (before, the second call raised ``Object of
    type SymInt is not JSON serializable``)."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 32, 32, generator=generator),
             torch.randn(16, 1, generator=generator))
            for _ in range(3)]
    data = [(x if index == 0 else x.contiguous(memory_format=torch.channels_last), y)
            for index, (x, y) in enumerate(data)]
    reference, reference_losses, model, optimizer, fitted, budget = _fitted_at(
        0.9, data, _convolution_net)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        losses, peaks = _train(fitted, optimizer, data)
    assert max(peaks) <= budget, (peaks, budget)
    _assert_same_training(model, reference, losses, reference_losses)
    assert len(fitted._memfit_backend.regions) == 2
