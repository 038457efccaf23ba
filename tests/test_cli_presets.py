"""The command line's example models say their size: ``--model``'s help names each one's default
layers and widths, read from the builders' signatures."""

from __future__ import annotations

import inspect

from memfit import examples
from memfit.cli import model_help


def test_each_model_preset_says_its_default_size():
    text = model_help()
    for name, builder in examples.EXAMPLES.items():
        defaults = {key: parameter.default for key, parameter in
                    inspect.signature(builder).parameters.items() if key != "seed"}
        listed = ", ".join(f"{key}={value}" for key, value in defaults.items())
        assert f"{name} ({listed})" in text
    assert "small by default" in text
