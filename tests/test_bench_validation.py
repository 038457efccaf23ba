"""The validation bench: scaled profiles, ratios against published figures, goal verdicts."""

import pytest
import torch

from bench import validation
from memfit.data.hardware import get_hardware


def test_scaled_profile_changes_op_rates_or_the_link_and_nothing_else():
    hardware = get_hardware("h100-pcie")
    faster = validation.scaled(hardware, op_speed=2.0)
    assert faster.flops_per_s["bfloat16"] == 2 * hardware.flops_per_s["bfloat16"]
    assert faster.memory_bytes_per_s == 2 * hardware.memory_bytes_per_s
    assert faster.h2d_bytes_per_s == hardware.h2d_bytes_per_s
    assert faster.op_overhead_s == hardware.op_overhead_s
    slower_link = validation.scaled(hardware, link=0.5)
    assert slower_link.d2h_bytes_per_s == hardware.d2h_bytes_per_s / 2
    assert slower_link.h2d_pageable_bytes_per_s == hardware.h2d_pageable_bytes_per_s / 2
    assert slower_link.flops_per_s == hardware.flops_per_s
    # a large op takes twice as long at half the rate, less its fixed overhead
    fast_s = faster.op_time_s(1e15, 0, "bfloat16", "aten.mm") - faster.op_overhead_s
    base_s = hardware.op_time_s(1e15, 0, "bfloat16", "aten.mm") - hardware.op_overhead_s
    assert fast_s == pytest.approx(base_s / 2, rel=1e-3)


def case(published, samples_per_item=1):
    return validation.Case("m", lambda: None, 8, "bf16", torch.bfloat16, "h100-sxm", published,
                           samples_per_item)


def test_published_ratio_is_predicted_over_measured_throughput():
    prediction = validation.Prediction(case(validation.Published("s", samples_per_s=400)),
                                       step_time_s=0.01, peak_bytes=1, flops=1.0)
    assert prediction.samples_per_s == 800
    figure, ratio, source = validation.published_cells(prediction)
    assert (figure, ratio, source) == ("400/s", "2.00", "s")


def test_published_mfu_is_compared_with_the_predicted_utilisation():
    hardware = get_hardware("h100-sxm")
    flops = 0.25 * hardware.flops_rate("bfloat16")  # a quarter of a second at the peak
    prediction = validation.Prediction(case(validation.Published("s", mfu=0.5), 1024),
                                       step_time_s=1.0, peak_bytes=1, flops=flops)
    assert prediction.mfu(hardware, "bfloat16") == pytest.approx(0.25)
    assert validation.published_cells(prediction)[:2] == ("50% MFU", "0.50")
    assert validation.published_cells(validation.Prediction(case(None), 1.0, 1, 1.0))[0] == \
        "none found"


@pytest.mark.filterwarnings("ignore")
def test_sensitivity_rows_reanalyze_each_scaled_profile_and_judge_the_goals():
    pytest.importorskip("transformers")
    from memfit import examples

    example = examples.gpt2(layers=2, width=256, heads=4, vocab=128, sequence=256)
    hardware = get_hardware("h100-pcie")
    captured = validation.target_capture(example, 8, hardware, torch.bfloat16)
    rows = validation.sensitivity_rows(captured, hardware, log=lambda _: None)
    assert [row.variant for row in rows] == ["as profiled", "op speed x0.5", "op speed x2",
                                            "host link x0.5", "host link x2"]
    as_profiled, slower, faster, _, _ = rows
    # op times are estimated again on each profile: half the rates, a slower unplanned step
    assert slower.keep_step_s > as_profiled.keep_step_s > faster.keep_step_s
    assert all(len(row.overheads) == len(validation.GOALS) for row in rows)


def test_goal_verdicts():
    verdicts = validation.goal_lines(validation.SensitivityRow("x", 1.0, (0.02, None), ("a", "")))
    assert verdicts[0].endswith("+2.0%, **met**")
    assert verdicts[1].endswith("does not fit, **not met**")


def test_spread_lines_give_the_range_over_the_variants():
    rows = [validation.SensitivityRow("a", 1.0, (0.02, 0.2), ("", "")),
            validation.SensitivityRow("b", 1.0, (0.08, None), ("", ""))]
    first, second = validation.spread_lines(rows)
    assert first == "- at 50%: auto's overhead spans +2.0% to +8.0% over the 2 profiles (0 without a fitting plan)"
    assert second.endswith("+20.0% to +20.0% over the 2 profiles (1 without a fitting plan)")
