"""A user's profiler around memfit's first (measured) calls keeps its session: it records the
step's ops and exports a trace. memfit measures by ops while it is open, and starts no profiler
of its own (profilers do not nest: one started inside ended the user's session, and inside a
scheduled profiler's warm-up the next profiler call crashed the process)."""

import json

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import ProfilerRunning, measure_allocator_peak, profiler_running
from tests.measured_peaks import tolerance_bytes

WIDTH, BATCH = 64, 512


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(12)])


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _compile_step():
    step = memfit.compile(_mlp(), _loss, budget="0.75")
    return lambda x: step(x), step


def _fit_step():
    fitted = memfit.fit(_mlp(), budget="0.75")
    return lambda x: _loss(fitted, x).backward(), fitted


def _backend_step():
    model = _mlp()
    compiled = torch.compile(model, backend=memfit.backend(budget="0.75", model=model),
                             dynamic=False)
    return lambda x: _loss(compiled, x).backward(), compiled


def _events(profiler) -> list[str]:
    events = profiler.events() if hasattr(profiler, "events") else profiler.function_events
    return [event.name for event in events]


def _assert_recorded_and_exports(profiler, steps: int, tmp_path) -> None:
    names = _events(profiler)
    assert names.count("user_step") == steps
    assert sum(name in ("aten::mm", "aten::addmm") for name in names) >= steps * 4
    trace = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "user_step" for event in events)


def _profiled(run, profiler, steps: int, x: torch.Tensor, step_each: bool = False):
    with profiler:
        for _ in range(steps):
            with torch.profiler.record_function("user_step"):
                run(x)
            if step_each:
                profiler.step()
    assert not profiler_running()


@pytest.mark.slow
@pytest.mark.parametrize("make", [_compile_step, _fit_step, _backend_step],
                         ids=["compile", "fit", "backend"])
def test_a_users_profiler_around_the_first_calls_records_and_exports(make, tmp_path):
    run, _ = make()
    x = torch.randn(BATCH, WIDTH)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      profile_memory=True)
    _profiled(run, profiler, 2, x)
    _assert_recorded_and_exports(profiler, 2, tmp_path)


@pytest.mark.slow
def test_a_scheduled_profiler_warming_up_during_the_measured_calls_keeps_its_session(tmp_path):
    """Its wait and warm-up steps are memfit's measured first calls: no profiler is started
    then (the session's warm-up would be cancelled, and the process crashed after)."""
    run, fitted = _fit_step()
    x = torch.randn(BATCH, WIDTH)
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=2), profile_memory=True)
    _profiled(run, profiler, 4, x, step_each=True)
    _assert_recorded_and_exports(profiler, 2, tmp_path)
    assert all(region.measured_by == "ops" for region in fitted._memfit_backend.regions)


@pytest.mark.slow
def test_the_legacy_autograd_profiler_keeps_its_session(tmp_path):
    run, step = _compile_step()
    x = torch.randn(BATCH, WIDTH)
    _profiled(run, torch.autograd.profiler.profile(profile_memory=True), 2, x)
    profiler = torch.autograd.profiler.profile(profile_memory=True)
    _profiled(run, profiler, 1, x)
    _assert_recorded_and_exports(profiler, 1, tmp_path)


@pytest.mark.slow
def test_a_compiled_step_under_a_profiler_is_measured_by_its_regions_ops():
    """Its whole-step measurement comes from its regions' measured runs (ops counted), within
    the budget; after the profiler, steps are measured by the allocator again (the closed loop
    re-plans the second call, the first with gradients resident, as without a profiler)."""
    _, step = _compile_step()
    x = torch.randn(BATCH, WIDTH)
    with torch.profiler.profile():
        step(x)
    assert step.measured.meta["measured_by"] == "ops"
    assert step.measured.peak_bytes <= step.budget_bytes
    for _ in range(2):
        step(x)
        assert "measured_by" not in step.measured.meta
    assert step.measured.peak_bytes <= step.budget_bytes + tolerance_bytes(step.budget_bytes)


def test_measuring_through_the_allocator_refuses_inside_a_users_profiler():
    with torch.profiler.profile() as profiler:
        assert profiler_running()
        with pytest.raises(ProfilerRunning, match="profilers do not nest"):
            measure_allocator_peak(lambda: torch.ones(4) + 1)
        torch.ones(8).sum()
    assert not profiler_running()
    assert "aten::sum" in _events(profiler)
