"""The example builders say what to install when an optional model library is missing."""

import importlib.util

import pytest

from memfit import examples


@pytest.mark.parametrize("builder, package", [(examples.gpt2, "transformers"),
                                              (examples.unet3d, "monai")])
def test_missing_model_library_says_what_to_install(monkeypatch, builder, package):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == package else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'memfit\[models\]'"):
        builder()
