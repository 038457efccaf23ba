"""The planning-scaling bench: one row per depth, the growth exponent, each goal's verdict."""

import math

import pytest

from bench import planning_scaling


def row(layers, planning_s):
    return planning_scaling.ScalingRow(layers, 100 * layers, 1.0, planning_s, "keep", "digest")


def test_exponent_is_the_log_log_slope_from_the_shallowest_to_the_deepest_row():
    rows = [row(6, 0.5), row(12, 1.0), row(48, 8.0)]
    assert planning_scaling.growth_exponent(rows) == pytest.approx(math.log(16) / math.log(8))


def test_section_judges_the_goals_at_24_and_48_layers():
    section = planning_scaling.scaling_section([row(6, 0.4), row(24, 5.5), row(48, 9.0)])
    assert "Goal at 24 layers (< 5 s): not met." in section
    assert "Goal at 48 layers (< 10 s): met." in section
    assert "layers^" in section


@pytest.mark.filterwarnings("ignore")
def test_rows_on_a_one_layer_gpt2():
    pytest.importorskip("transformers")
    logged = []
    (only,) = planning_scaling.scaling_rows([1], log=logged.append)
    assert only.layers == 1 and only.ops > 0 and only.planning_s >= 0
    assert len(only.digest) == 12 or only.digest == "no plan fits"
    assert len(logged) == 1
