"""memfit.fit at the peak per-block checkpointing measures, in a plain AdamW loop with the loss
from ``labels=`` (transformers' own loss, behind its graph break): a language model whose logits
and their loss dominate the iteration, where no plan fits with the logits held to the
iteration's end but plans fit the loop as it runs (``.loss`` kept, the logits let go).

Claims: the budget is accepted (no ``BudgetError``); losses and weights bit for bit eager's; from
the second iteration on, which compiles the regions' joint plans while it runs, every measured
iteration peak is within the budget (the first plans the regions one at a time and the loss
region runs over, with a ``BudgetWarning``: planning them jointly before the first run is not
done yet).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import memfit
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compiled_fresh")]
transformers = pytest.importorskip("transformers")

VOCAB, SEQUENCE, BATCH = 50257, 128, 2  # GPT-2's own vocabulary: the logits dominate


def gpt2_with_labels():
    """A 4-layer GPT-2 without dropout (``loss_type`` unset: its loss runs behind a graph
    break), and the loop's loss: ``model(input_ids=ids, labels=ids).loss``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB,
                                     n_positions=SEQUENCE, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return model, ids


def train(model, ids, fitted=None, iterations: int = 3):
    """Losses and measured iteration peaks of an AdamW loop (``fitted(model, optimizer)``
    compiles the model)."""
    optimizer = torch.optim.AdamW(model.parameters())
    run = fitted(model, optimizer) if fitted else model
    losses, peaks = [], []
    for _ in range(iterations):
        def iteration():
            loss = run(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().clone()

        measured = measure_allocator_peak(iteration, track=(list(model.parameters()),
                                                            optimizer.state, ids))
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks


def test_fit_at_checkpointing_peak_with_labels_loss():
    model, ids = gpt2_with_labels()
    eager = copy.deepcopy(model)
    eager_losses, _ = train(eager, ids)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    _, checkpointing_peaks = train(checkpointed, ids)
    budget = max(checkpointing_peaks)

    fitted = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memfit.BudgetWarning)  # the first iteration's, said
        losses, peaks = train(fitted, ids, lambda model, optimizer: memfit.fit(
            model, budget=budget, optimizer=optimizer))
    print(f"budget {budget:,} B (checkpointing's peak), measured {peaks}")
    for loss, expected in zip(losses, eager_losses, strict=True):
        assert torch.equal(loss, expected)
    for parameter, expected in zip(fitted.parameters(), eager.parameters(), strict=True):
        assert torch.equal(parameter, expected)
    assert max(peaks[1:]) <= budget, (peaks, budget)
