"""Graph-broken models in a user's loop: the measured peak of a region after the break against
the allocator's own events."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import memfit
from tests.measured_peaks import tolerance_bytes
from tests.test_backend import Broken, batches

pytestmark = pytest.mark.usefixtures("compiled_fresh")


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
