"""memfit.fit(compiler="inductor") at half of eager's measured peak on transformers: BERT with a
padded attention mask, and GPT-2.

The budget is half the peak an eager AdamW loop measures; every iteration of the fitted loop, the
first included, is measured within it by the allocator's own events (AdamW's state counted from
the first step: the optimizer is handed to ``memfit.fit``), and losses and weights are
``torch.compile``'s inductor's within ``torch.testing.assert_close``'s float32 defaults (see
``tests/test_backend_inductor.py``: its min-cut partitioner re-runs other ops, and inductor fuses
the two programs differently). Dropout is off, so both runs draw no random numbers.

Note:
    Inductor's joint-graph passes erase BERT's zero-probability dropout copies
    (``remove_noop_ops``) and leave the views of each copy (the query, key and value
    projections' ``view``) on the erased copy's fake storage. Before ``realias_views``, a plan
    that swapped the layer norm's output under them raised ``PlanError: cannot swap or
    recompute 'view': view_6 reads it without being a view of view``.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from tests.test_backend_inductor import (  # noqa: F401
    _fresh_dynamo,
    assert_trained_as,
    pytestmark,
    train,
)

STEPS = 3


def bert():
    from memfit.examples import bert

    return bert(layers=4, width=128, heads=4, vocab=256, sequence=128, batch_size=8)


def gpt2():
    from memfit.examples import gpt2

    return gpt2(layers=4, width=64, heads=4, vocab=128, sequence=256, batch_size=8, dropout=0.0)


@pytest.mark.parametrize("build", [bert, gpt2], ids=["bert", "gpt2"])
def test_inductor_at_half_the_eager_peak_computes_torch_compiles_step(build):
    example = build()
    data = [example.make_inputs(example.batch_size) for _ in range(STEPS)]
    _, eager_peaks, _, _ = train(build().model, example.loss_fn, data)
    budget = int(0.5 * max(eager_peaks))
    reference = build().model
    reference_losses, _, _, _ = train(torch.compile(reference), example.loss_fn, data)
    torch._dynamo.reset()

    model = build().model
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, compiler="inductor", optimizer=optimizer)
    losses, peaks, _, code = train(fitted, example.loss_fn, data, optimizer)
    print(f"budget {budget}, eager peaks {eager_peaks}, memfit inductor peaks {peaks}")

    regions = fitted._memfit_backend.regions
    assert any(region.plan.swapped or region.plan.recomputed for region in regions)
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    assert "cpp_fused_" in code  # inductor's fused kernels are still there
    assert_trained_as(model, losses, reference, reference_losses)


def test_fused_chains_trains_bert_at_torch_compiles_budget_peak_with_a_smaller_last_batch():
    """``strategy="fused-chains"`` (every memory-bound chain re-run inside the backward's
    kernels, library calls where that lowers the peak) trains padded BERT at the peak
    ``torch.compile`` measures with ``activation_memory_budget=0.5``; the last batch is smaller,
    as a loader's last one is: every iteration within it, torch.compile's losses and weights."""
    example = bert()
    data = [example.make_inputs(example.batch_size) for _ in range(STEPS - 1)]
    data.append(example.make_inputs(example.batch_size // 2))
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        _, compile_peaks, _, _ = train(torch.compile(bert().model), example.loss_fn, data)
    torch._dynamo.reset()
    budget = max(compile_peaks)
    reference = bert().model
    reference_losses, _, _, _ = train(torch.compile(reference), example.loss_fn, data)
    torch._dynamo.reset()

    model = bert().model
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, strategy="fused-chains", compiler="inductor",
                        optimizer=optimizer)
    losses, peaks, _, _ = train(fitted, example.loss_fn, data, optimizer)
    print(f"budget {budget}, torch.compile at 0.5 {compile_peaks}, fused chains {peaks}")

    regions = fitted._memfit_backend.regions
    assert regions and all(region.plan.strategy == "fused-chains" and region.plan.recomputed
                           for region in regions)
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    assert_trained_as(model, losses, reference, reference_losses)
