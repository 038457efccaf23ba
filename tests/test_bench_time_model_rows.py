"""The time-model bench runs the models ``$MEMFIT_TIME_MODELS`` names."""

import pytest

from bench import time_model


def test_the_models_variable_selects_by_part_of_the_name(monkeypatch):
    monkeypatch.setenv(time_model.MODELS_VARIABLE, "cnn, gpt")
    names = [timed.name for timed in time_model.selected_models()]
    assert len(names) == 2 and names[0].startswith("GPT-2") and names[1].startswith("CNN")
    monkeypatch.setenv(time_model.MODELS_VARIABLE, "")
    assert time_model.selected_models() == time_model.TIME_MODELS
    monkeypatch.setenv(time_model.MODELS_VARIABLE, "resnet")
    with pytest.raises(ValueError, match="names none"):
        time_model.selected_models()
