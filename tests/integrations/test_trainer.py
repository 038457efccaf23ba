"""``transformers.Trainer(model=memfit.fit(model, ...))`` with default ``TrainingArguments``: the
dataset's columns reach the model (its ``forward`` signature is the model's), the optimizer the
Trainer makes is found at the model's first call, three steps train bitwise like eager within
the budget (measured), and the saved checkpoint has the plain model's keys."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.runtime.measure import measure_allocator_peak

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

pytestmark = pytest.mark.usefixtures("compiled_fresh")

VOCAB, SEQUENCE = 128, 64


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                     n_positions=SEQUENCE, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # otherwise a warning on every call breaks tracing
    return model


def dataset() -> list[dict[str, torch.Tensor]]:
    """Rows as a tokenizer makes them, with a column the model does not take (``text``)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(12):
        tokens = torch.randint(0, VOCAB, (SEQUENCE,), generator=generator)
        rows.append({"input_ids": tokens, "labels": tokens.clone(), "text": "unused"})
    return rows


def train(model: torch.nn.Module, output_dir, **arguments) -> tuple[int, object]:
    """Three steps of a Trainer with default arguments; the measured peak and the Trainer."""
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=3,
                                          per_device_train_batch_size=4, report_to="none",
                                          **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
    measured = measure_allocator_peak(trainer.train, track=(list(model.parameters()),
                                                            list(model.buffers())))
    return measured.peak_bytes, trainer


@pytest.mark.slow
def test_trainer_with_default_arguments_trains_bitwise_within_the_budget(tmp_path):
    reference = tiny_gpt2()
    eager_peak, _ = train(reference, tmp_path / "eager")
    budget = int(0.8 * eager_peak)
    fitted = memfit.fit(tiny_gpt2(), budget=budget)
    peak, trainer = train(fitted, tmp_path / "fitted")
    print(f"Trainer peaks: eager {eager_peak:,d} B, memfit {peak:,d} B, budget {budget:,d} B")
    assert trainer.state.global_step == 3
    planner = fitted._memfit_backend
    # the optimizer the Trainer made (under accelerate's wrapper) is found at the first call
    assert planner.regions and len(planner.optimizers) == 1 and planner.replans == 0
    for (name, parameter), expected in zip(fitted.named_parameters(), reference.parameters(),
                                           strict=True):
        assert torch.equal(parameter, expected), name
    assert peak <= budget, (peak, budget, eager_peak)
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    saved = dict(loaded.named_parameters())
    assert not any(name.startswith("_orig_mod") for name in loaded.state_dict())
    for name, parameter in fitted.named_parameters():
        assert torch.equal(saved[name], parameter), name


@pytest.mark.slow
def test_trainer_with_torch_compile_runs_the_fitted_models_plan(tmp_path):
    """``torch_compile=True`` wraps the fitted model in ``torch.compile`` (inductor): its graph
    breaks at the model's call (``memfit.fitting.callers_compile``), so memfit's plan runs."""
    reference = tiny_gpt2()
    eager_peak, _ = train(reference, tmp_path / "eager")
    budget = int(0.8 * eager_peak)
    fitted = memfit.fit(tiny_gpt2(), budget=budget)
    peak, trainer = train(fitted, tmp_path / "fitted", torch_compile=True)
    print(f"Trainer peaks: eager {eager_peak:,d} B, memfit {peak:,d} B, budget {budget:,d} B")
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert fitted._memfit_backend.regions
    assert all(region.budget_bytes == budget for region in fitted._memfit_backend.regions)
    assert all(map(torch.equal, fitted.parameters(), reference.parameters()))
    assert peak <= budget, (peak, budget, eager_peak)


def test_a_backend_as_torch_compile_backend_fails_at_once_pointing_to_fit(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                          torch_compile_backend=memfit.backend(budget=0.5))
    with pytest.raises(TypeError, match=r"model=memfit.fit\(model"):
        transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
