"""Graph-broken models in a user's loop: a fraction budget whose first region is small (planned
before the step's peak is known), and the measured peak of a region after the break against
the allocator's own events."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.compiler.graph_breaks import latest_regions
from memfit.data.errors import BudgetWarning
from tests.measured_peaks import tolerance_bytes
from tests.test_backend import Broken, batches, train

pytestmark = pytest.mark.usefixtures("compiled_fresh")


class SmallFirst(nn.Module):
    """One linear layer, a graph break (a ``print``, or a ``.item()`` that a trace on fake
    inputs cannot take), optionally another small region and break, then the rest of the
    model: the regions before the last hold a small part of the step's peak."""

    def __init__(self, reads_a_value: bool = False, middle: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reads_a_value = reads_a_value
        self.first = nn.Linear(128, 128)
        self.middle = nn.Linear(128, 128) if middle else None
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        self.rest = nn.Sequential(*layers, nn.Linear(128, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if self.reads_a_value:
            if hidden.sum().item() > 1e30:
                raise AssertionError("a value no batch here reaches")
        else:
            print("first layer done", end="")
        if self.middle is not None:
            hidden = self.middle(torch.tanh(hidden))
            print("middle layer done", end="")
        return self.rest(hidden)


@pytest.mark.parametrize("reads_a_value, middle", [(False, False), (False, True), (True, False)],
                         ids=["traced-on-fakes", "three-regions", "not-traced"])
def test_a_fraction_is_of_the_whole_step_from_the_first_call_when_the_first_region_is_small(
        reads_a_value, middle):
    """The first region (one linear layer) is compiled before the regions after its graph break
    exist: resolved against its own peak, 0.75 of it was below anything that layer can run at,
    so the first call raised ``BudgetError`` though the whole step fits 0.75 of its peak. It is
    planned provisionally and again once the step is known: before its first run where the call
    is traced on fakes (twice with three regions: unplanned, then under the budget), after the
    first iteration where that trace fails (``.item()``). No call errs or warns, every region
    is planned for the same fraction of the step's peak, every iteration is within it, and
    training is bitwise eager's."""
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(2048, 128, generator=generator), torch.randn(2048, 1, generator=generator))
            for _ in range(4)]
    reference = SmallFirst(reads_a_value, middle)
    reference_losses, _ = train(reference, torch.optim.Adam(reference.parameters()), data)
    model = SmallFirst(reads_a_value, middle)
    optimizer = torch.optim.Adam(model.parameters())
    fitted = memfit.fit(model, 0.75, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        losses, peaks = train(fitted, optimizer, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                                 strict=True))
    backend = fitted._memfit_backend
    regions = latest_regions(backend.regions)
    count = 3 if middle else 2
    assert len(regions) == count and not any(region.provisional for region in regions)
    assert backend.regions[0].provisional and backend.regions[0].replaced
    budget_bytes = int(0.75 * max(region.baseline_peak_bytes for region in regions))
    for region in regions:  # a plan made again for eager code's bytes counts them in its peak
        assert abs(region.budget_bytes - budget_bytes) <= tolerance_bytes(budget_bytes)
    assert max(peaks) <= min(region.budget_bytes for region in regions), (peaks, budget_bytes)
    assert backend.joint_first_regions == (0 if reads_a_value else count)


def _region_windows(run) -> list[tuple[str, int]]:
    """Run ``run()`` under the profiler and return, for each compiled forward and backward in
    the order they ran, its name and the CPU allocator's most bytes live inside it, counted
    from the bytes at the profile's start (the caller adds what was alive before)."""
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = list(profiler.profiler.kineto_results.events())
    memory = sorted((event.start_ns(), event.nbytes()) for event in events
                    if event.name() == "[memory]" and event.device_type() == DeviceType.CPU)
    windows = sorted((event.start_ns(), event.end_ns(), event.name()) for event in events
                     if event.name() in ("CompiledFunction", "CompiledFunctionBackward"))
    found = []
    for start_ns, end_ns, name in windows:
        live = sum(size for at_ns, size in memory if at_ns < start_ns)
        peak = live
        for at_ns, size in memory:
            if start_ns <= at_ns <= end_ns:
                live += size
                peak = max(peak, live)
        found.append((name, peak))
    return found


def test_a_region_after_a_graph_break_measures_what_the_allocator_saw():
    """The first region ends in a ReLU, which saves its output; the second region takes that
    output as its input. Its measured runs counted the tensor twice, as the earlier region's
    save and as its own argument (2 MiB over the allocator here), and each parameter's
    transpose the first region saves twice too. Measured against the allocator's events inside
    each compiled forward and backward of a later iteration (same shapes, same plans): each
    region's measured peak is at least the allocator's and within the measurement tolerance
    above it."""
    model = Broken()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # no state: every iteration alike
    fitted = memfit.fit(model, optimizer=optimizer)
    data = batches(count=4, size=4096)
    for x, y in data:
        gc.collect()  # no garbage of an earlier iteration freed inside a measured run

        def iteration(x=x, y=y):
            nn.functional.mse_loss(fitted(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if x is not data[-1][0]:
            iteration()  # memfit measures the first two (measure_runs)
            continue
        resident = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in [*model.parameters(), x, y]}
        windows = _region_windows(iteration)
    first, second = fitted._memfit_backend.regions
    assert second.measured_by == "allocator"
    measured = [("CompiledFunction", first.measured_forward_bytes),
                ("CompiledFunction", second.measured_forward_bytes),
                ("CompiledFunctionBackward", second.measured_backward_bytes),
                ("CompiledFunctionBackward", first.measured_backward_bytes)]
    start_bytes = sum(resident.values())
    assert [name for name, _ in windows] == [name for name, _ in measured]
    for (name, seen), (_, reported) in zip(windows, measured, strict=True):
        truth = start_bytes + seen
        assert truth <= reported <= truth + tolerance_bytes(truth), (name, reported, truth)


class SequentiallyCheckpointed(nn.Module):
    """Blocks run through ``torch.utils.checkpoint.checkpoint_sequential``, which Dynamo does not
    trace: they run eagerly around the compiled head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(128, 512), nn.GELU(),
                                                  nn.Linear(512, 128)) for _ in range(4)))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint_sequential

        return self.head(checkpoint_sequential(self.body, 2, x, use_reentrant=False))


def test_a_refusal_for_eager_codes_bytes_names_the_graph_break_that_runs_it():
    """A budget the eager blocks alone exceed is refused before anything runs, and the error
    names the function Dynamo would not trace, so that the user knows what to change."""
    model = SequentiallyCheckpointed()
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget="18MiB", optimizer=optimizer)
    x = torch.randn(2048, 128, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (2048,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(memfit.BudgetError, match="held by eager code") as refused:
        nn.functional.cross_entropy(fitted(x), y).backward()
    assert "checkpoint_sequential" in str(refused.value), refused.value
