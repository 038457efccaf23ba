"""The time-model bench's pieces that need no timing: the profile line, the MFU goal's verdict
on the inductor row, and both compilers' rows for a validation case."""

import pytest
import torch

from bench import time_model, validation
from memfit.data.hardware import PROFILES, get_hardware


def test_the_profile_line_names_every_measured_figure():
    hardware = PROFILES["cpu"].with_(element_rates={"transcendental": 2e8},
                                     compute_efficiency={"convolution": 0.5})
    line = time_model.profile_line(hardware)
    for words in ("float32 peak 50.0 GFLOP/s", "(convolution at 0.50 of it)", "memory 10.0 GB/s", "eager op overhead 20.0 us",
                  "compiled kernel overhead", "transcendental 200 M elements/s"):
        assert words in line


def _case(model="GPT-2 medium", profile="h100-sxm"):
    return validation.Case(model, lambda: None, 16, "bf16", torch.bfloat16, profile,
                           validation.Published("s", mfu=0.5), 1024)


def test_the_mfu_goal_is_judged_on_the_inductor_row():
    hardware = get_hardware("h100-sxm")
    peak = hardware.flops_rate("bfloat16")
    rows = [validation.Prediction(_case(), 1.0, 1, 0.2 * peak, "aot_eager"),
            validation.Prediction(_case(), 1.0, 1, 0.45 * peak, "inductor")]
    line = validation.mfu_goal_line(rows)
    assert "45.0%" in line and "**met**" in line
    rows[1] = validation.Prediction(_case(), 1.0, 1, 0.7 * peak, "inductor")
    assert "**not met**" in validation.mfu_goal_line(rows)
    assert "not in the selected cases" in validation.mfu_goal_line(rows[:1])


@pytest.mark.filterwarnings("ignore")
def test_a_case_is_predicted_for_both_compilers_and_fusion_is_faster():
    pytest.importorskip("transformers")
    from memfit import examples

    case = validation.Case("GPT-2 tiny", lambda: examples.gpt2(layers=1, width=64, heads=2,
                                                               vocab=64, sequence=64),
                           2, "bf16", torch.bfloat16, "h100-sxm")
    eager, inductor = validation.predict(case, {})
    assert (eager.compiler, inductor.compiler) == ("aot_eager", "inductor")
    assert eager.flops == inductor.flops > 0
    assert inductor.step_time_s < eager.step_time_s


def test_the_median_profile_takes_each_figure_over_the_runs_that_measured_it():
    base = PROFILES["cpu"]
    runs = [base.with_(flops_per_s={"float32": 1e9, "bfloat16": 4e8}, memory_bytes_per_s=1e9),
            base.with_(flops_per_s={"float32": 3e9}, memory_bytes_per_s=3e9),
            base.with_(flops_per_s={"float32": 2e9, "bfloat16": 2e8}, memory_bytes_per_s=2e9)]
    median = time_model.median_profile(runs)
    assert dict(median.flops_per_s) == {"bfloat16": 3e8, "float32": 2e9}
    assert median.memory_bytes_per_s == 2e9
