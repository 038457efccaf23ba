"""Lightning with ``self.model = memfit.fit(...)``: it trains, and its checkpoints hold the plain
model's keys (no ``_orig_mod.``). Skipped where Lightning is not installed."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memfit

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def _lightning():
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("Lightning is not installed")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def test_a_fitted_model_in_a_lightning_module_checkpoints_plain_keys(tmp_path):
    lightning = _lightning()

    class Regression(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = memfit.fit(net(), budget=0.9)

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    generator = torch.Generator().manual_seed(1)
    rows = TensorDataset(torch.randn(64, 32, generator=generator),
                         torch.randn(64, 1, generator=generator))
    module = Regression()
    trainer = lightning.Trainer(max_steps=2, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(rows, batch_size=16))
    trainer.save_checkpoint(str(tmp_path / "last.ckpt"))
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert list(state) == [f"model.{key}" for key in net().state_dict()]
    assert module.model._memfit_backend.regions
