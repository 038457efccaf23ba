"""max_batch_size: the fastest (or the largest) batch that fits, found by planning on meta tensors,
then measured."""

import pytest

import memfit
from memfit import examples
from memfit.planning.batches import PlannedBatch, Trial, bracket_largest, search_fastest
from memfit.runtime.measure import measure_allocator_peak
from memfit.search import meta_inputs

BUDGET_BYTES = 1_080_000  # parameters and gradients are ~1.06 MB: room for a batch of about 20


def test_the_largest_batch_fits_when_measured_and_the_next_one_does_not():
    example = examples.mlp(depth=8, width=128)
    model, loss_fn = example.model, example.loss_fn
    found = memfit.max_batch_size(model, loss_fn, example.make_inputs, budget=BUDGET_BYTES,
                                  objective="largest")
    batch = found.batch_size
    assert 10 <= batch <= 40, found
    assert found.largest_batch_size == batch and found.frontier[-1].batch_size == batch
    assert found.predicted_peak_bytes <= BUDGET_BYTES and found.budget_bytes == BUDGET_BYTES
    assert found.predicted_throughput == pytest.approx(batch / found.predicted_step_time_s)
    assert found.verified is not None and found.verified.peak_bytes <= BUDGET_BYTES
    assert [t.how for t in found.tried][-1] == "measured" and not found.note
    assert all(p.grad is None for p in model.parameters())  # verifying left no gradients behind

    # the answer, measured outside the step (which does not measure itself here): fits
    step = memfit.compile(model, loss_fn, budget=BUDGET_BYTES, strategy=found.plan.strategy,
                          measure=False)
    inputs = example.make_inputs(batch)
    step(*inputs)  # trace and plan outside the measurement
    model.zero_grad(set_to_none=True)
    peak = measure_allocator_peak(step, *inputs, track=list(model.parameters())).peak_bytes
    assert step.regions == [step.compiled]  # the measured call ran the plan made before
    assert peak <= BUDGET_BYTES
    # the next batch up: no plan fits
    with pytest.raises(memfit.BudgetError) as error:
        memfit.plan(model, loss_fn, *meta_inputs(example.make_inputs, batch + 1),
                    budget=BUDGET_BYTES, hardware="cpu", strategy=found.plan.strategy)
    assert error.value.minimum_bytes > BUDGET_BYTES
    assert f"| {batch + 1} " in str(found) and "over" in str(found)


def test_meta_inputs_allocate_nothing():
    example = examples.mlp(depth=2, width=8)
    inputs = meta_inputs(example.make_inputs, 1 << 40)  # a terabyte-sized batch, made for free
    assert all(t.device.type == "meta" for t in inputs) and inputs[0].shape[0] == 1 << 40


def test_a_budget_must_be_bytes():
    example = examples.mlp(depth=2, width=8)
    with pytest.raises(ValueError, match="bytes"):
        memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs, budget=0.5)


@pytest.mark.parametrize("per_sample", [1, 7, 1000])
@pytest.mark.parametrize("answer", [1, 2, 3, 17, 100, 4095, 4096])
def test_the_search_finds_the_boundary_of_any_monotone_peak(answer, per_sample):
    """Synthetic peaks (affine with a wiggle, steeper past the answer): the exact answer."""

    def peak(batch):  # increasing: the wiggle never undoes a step of per_sample
        return 10_000 + batch * per_sample + (batch * batch) % per_sample + (batch > answer) * 3 * batch

    budget = peak(answer)
    tried: list[Trial] = []

    def attempt(batch):
        fits = peak(batch) <= budget
        tried.append(Trial(batch, fits, "planned", peak(batch)))
        timeline = memfit.Timeline("simulated", peak(batch), 1.0)
        return PlannedBatch(batch, None, timeline, budget, 0) if fits else None

    best = bracket_largest(attempt, tried, budget, max_batch=4096)
    expected = max(b for b in range(1, 4097) if peak(b) <= budget)
    assert best is not None and best.batch_size == expected
    assert len(tried) <= 2 * 13 + 2


def test_nothing_fits_and_everything_fits_up_to_max_batch():
    assert bracket_largest(lambda batch: None, [], 100, max_batch=64) is None
    tried: list[Trial] = []

    def always(batch):
        tried.append(Trial(batch, True, "planned", 1))
        return PlannedBatch(batch, None, memfit.Timeline("simulated", 1, 1.0), 100, 0)

    assert bracket_largest(always, tried, 100, max_batch=1000).batch_size == 1000
    assert len(tried) <= 5


def test_the_default_picks_the_fastest_batch_which_is_not_the_largest():
    """A budget where the largest batch swaps megabytes: the default stops before that, at the
    frontier's best predicted samples/s; ``objective="largest"`` returns the largest, slower."""
    example = examples.mlp(depth=3, width=256)  # ~1.5 MiB of weights and gradients
    search = dict(budget=6_000_000, hardware="cpu", verify=False)
    found = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs, **search)
    assert found.objective == "throughput"
    best = max(found.frontier, key=lambda point: point.samples_per_s)
    assert found.batch_size == best.batch_size
    assert found.predicted_throughput == pytest.approx(best.samples_per_s)
    assert [p.batch_size for p in found.frontier] == sorted({t.batch_size for t in found.tried
                                                             if t.fits})
    assert all(p.peak_bytes <= found.budget_bytes for p in found.frontier)
    largest = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                                    objective="largest", **search)
    assert largest.batch_size == found.largest_batch_size > found.batch_size
    assert any(t.batch_size == largest.batch_size + 1 and not t.fits
               for t in largest.tried)  # the bracket closed: one more sample does not fit
    assert largest.predicted_throughput < found.predicted_throughput
    assert largest.frontier[-1].host_bytes > 0  # what the largest batch pays in swapping
    assert "fastest batch" in str(found) and "largest batch" in str(largest)


def _fake_planned(batch, full_speed_up_to, fixed_s=1e-3, per_sample_s=1e-5, extra_s=3e-5):
    """A fake clock: a step costs fixed_s plus per_sample_s a sample up to
    ``full_speed_up_to``; each sample past it is recomputed at extra_s (more than it adds)."""
    recompute_s = extra_s * max(batch - full_speed_up_to, 0)
    timeline = memfit.Timeline("simulated", batch, fixed_s + per_sample_s * batch + recompute_s,
                               recompute_s=recompute_s)
    return PlannedBatch(batch, None, timeline, 1 << 40, 0)


@pytest.mark.parametrize("full_speed_up_to", [1, 37, 400, 1000, 2999, 3000])
def test_the_fastest_batch_is_found_in_a_few_plans(full_speed_up_to):
    largest = _fake_planned(3000, full_speed_up_to)
    fitting = {3000: largest}
    planned: list[int] = []

    def attempt(batch):
        planned.append(batch)
        fitting[batch] = _fake_planned(batch, full_speed_up_to)
        return fitting[batch]

    best = search_fastest(attempt, largest, fitting)
    throughput = {b: b / _fake_planned(b, full_speed_up_to).predicted.step_time_s
                  for b in range(1, 3001)}
    true_best = max(throughput.values())
    assert throughput[best.batch_size] >= 0.95 * true_best, (best.batch_size, planned)
    assert len(planned) <= 12 + 2 * 3  # halving from 3000, then three rounds of two midpoints
    if full_speed_up_to == 3000:  # the largest runs at full speed: nothing else is planned
        assert best is largest and not planned


@pytest.mark.slow
def test_no_plan_swaps_more_than_the_host_holds():
    """``host_bytes`` on the profile: the strategies plan within it, so every batch on the
    frontier holds at most that on the host, and the largest batch is no larger than with an
    unlimited host."""
    from memfit.data.hardware import get_hardware

    example = examples.mlp(depth=3, width=256)
    host_bytes = 1 << 20
    search = dict(budget=6_000_000, verify=False, objective="largest")
    free = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                                 hardware=get_hardware("cpu"), **search)
    assert max(point.host_bytes for point in free.frontier) > host_bytes
    found = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                                  hardware=get_hardware("cpu").with_(host_bytes=host_bytes),
                                  **search)
    assert all(point.host_bytes <= host_bytes for point in found.frontier)
    assert found.batch_size <= free.batch_size


def test_a_host_limited_refusal_is_shown_and_batch_one_names_the_host(monkeypatch):
    """A fake planner (of each batch's own trace) that fits batches up to 2 and refuses larger ones for the host limit:
    the search says so; where batch 1 is refused too, its BudgetError names host_bytes."""
    from memfit import search
    from memfit.data.hardware import get_hardware

    fits_up_to = 2

    def host_limited_planner(model, loss_fn, make_inputs, batch, *rest):
        if batch > fits_up_to:
            raise memfit.BudgetError(10**6, 2 * 10**6, strategy="auto", host_bytes=1)
        return PlannedBatch(batch, memfit.Plan("auto"), memfit.Timeline("simulated", 100, 1.0),
                            10**6, 0, 1)

    monkeypatch.setattr(search, "_plan_batch", host_limited_planner)
    example = examples.mlp(depth=2, width=8)
    hardware = get_hardware("cpu").with_(host_bytes=1)
    found = memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                                  budget=10**6, hardware=hardware, verify=False,
                                  objective="largest", symbolic=False)
    assert found.batch_size == fits_up_to
    assert any(t.host_limited and not t.fits for t in found.tried)
    assert "over, host-limited" in str(found)
    fits_up_to = 0
    with pytest.raises(memfit.BudgetError, match="host_bytes"):
        memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs, budget=10**6,
                              hardware=hardware, verify=False, symbolic=False)
