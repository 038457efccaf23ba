"""The step report and memfit.report, torch-free on a synthetic graph: recomputation is reported
beside swaps, counts are of the saved tensors, and each time says whether it was measured."""

from __future__ import annotations

from types import SimpleNamespace

from memfit.compiler.report import regions_report
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline
from memfit.data.units import format_bytes
from memfit.model import synthetic
from memfit.model.explain import tally
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy
from memfit.render.text import step_report

HARDWARE = get_hardware("h100-pcie")


def checkpointed_region(index: int = 0) -> SimpleNamespace:
    """What ``step_report`` and ``regions_report`` read of a ``memfit.compiler.backend.Region``: a
    16-op chain planned by ``checkpoint`` (re-runs, no swaps)."""
    graph = synthetic.chain(16)
    plan = get_strategy("checkpoint")(graph, HARDWARE, None)
    baseline = simulate(graph, Plan("keep"), HARDWARE)
    predicted = simulate(graph, plan, HARDWARE)
    return SimpleNamespace(
        index=index, replaced=False, plan=plan, graph=graph, plan_graph=graph, baseline=baseline,
        predicted=predicted, budget_bytes=None, outside_bytes=0, saves_cap_bytes=None,
        baseline_peak_bytes=baseline.peak_bytes, predicted_peak_bytes=predicted.peak_bytes,
        measured_peak_bytes=predicted.peak_bytes, measured_by="tracker",
        eager_forward_bytes=0, eager_backward_bytes=0, shape_bound=None)


def test_the_step_report_shows_recomputation_and_says_what_was_measured():
    """Before, a checkpointed step's report said "swapped: 0 (0 swap-ins)" and nothing of its
    re-runs, and the closed loop's measured step times were headed "step time"."""
    region = checkpointed_region()
    counted = tally(region.graph, region.plan, region.predicted)
    assert counted.rerun_count > 0 and counted.recomputed > 0
    rounds = [SimpleNamespace(planning_budget_bytes=10 << 20, predicted_peak_bytes=9 << 20,
                              measured_peak_bytes=9 << 20, step_time_s=0.25)]
    text = step_report(region, Timeline("measured", 9 << 20, 0.25), rounds)
    assert (f"saved tensors: {counted.saved} = 0 swapped (0 B) + {counted.recomputed} "
            f"recomputed + {counted.kept} kept") in text
    assert (f"re-runs: {counted.rerun_count} forward op runs ({counted.rerun_ops} distinct "
            f"ops) rebuild {format_bytes(counted.rerun_bytes)}, "
            f"{counted.recompute_s * 1e3:.2f} ms of compute predicted") in text
    assert "| checkpoint (measured) " in text and "step time (measured)" in text
    assert "simulated" not in text.split("| checkpoint (measured) ")[1]


def test_memfit_report_counts_of_the_saved_tensors_and_reruns_with_bytes():
    region = checkpointed_region()
    counted = tally(region.graph, region.plan, region.predicted)
    planner = SimpleNamespace(regions=[region], joint_rounds=0, replans=0, eager_replans=0,
                              retained_replans=0, eager_codes=[], budget_note=None,
                              planning_s=1.25, bound_replans=0, joint_first_regions=0,
                              joint_first_note="")
    text = regions_report(planner)
    assert "1 plan made, 1.2 s tracing and planning" in text
    assert "swapped / saved" in text and "re-runs (bytes, time predicted)" in text
    row = text.splitlines()[2]
    assert f"| 0 / {counted.saved} " in row and f"| {counted.recomputed} / {counted.saved} " in row
    assert (f"| {counted.rerun_count} ({format_bytes(counted.rerun_bytes)}, "
            f"{counted.recompute_s * 1e3:.2f} ms) ") in row
