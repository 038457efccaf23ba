"""max_batch_size traces the step once with a symbolic batch and prices every batch on that trace:
the same largest batch and the same predicted peak as a trace per batch, across graph breaks too;
where the trace cannot serve a batch, that batch is traced on its own and the result says so."""

from __future__ import annotations

import logging

import pytest
import torch

import memfit
from memfit import examples

LOGGER = logging.getLogger("tests.max_batch_size_symbolic")


def _both(model, loss_fn, make_inputs, **search):
    """The search with one symbolic trace, and with a trace per batch."""
    symbolic = memfit.max_batch_size(model, loss_fn, make_inputs, verify=False, **search)
    per_batch = memfit.max_batch_size(model, loss_fn, make_inputs, verify=False,
                                      symbolic=False, **search)
    return symbolic, per_batch


def _assert_same_answer(symbolic, per_batch, same_peaks: bool = True):
    """The same batch, peak and plan; every batch both tried fits in both or in neither, and
    (``same_peaks``) at the same peak. A symbolic graph may hold an op or two that a concrete
    trace elides (a slice Dynamo cannot prove whole keeps its ``slice_backward``): a little
    more predicted time, which can tip ``auto`` to another plan of a batch that fits."""
    assert symbolic.batch_size == per_batch.batch_size
    assert symbolic.largest_batch_size == per_batch.largest_batch_size
    assert symbolic.predicted_peak_bytes == per_batch.predicted_peak_bytes
    assert symbolic.plan == per_batch.plan  # the answer's plan comes from its own trace
    planned = {trial.batch_size: trial for trial in per_batch.tried}
    for trial in symbolic.tried:
        if trial.batch_size in planned:
            assert trial.fits == planned[trial.batch_size].fits, trial
            assert not same_peaks or trial.peak_bytes == planned[trial.batch_size].peak_bytes


@pytest.mark.slow
def test_an_mlp_prices_every_batch_on_one_trace():
    example = examples.mlp(depth=4, width=64)
    symbolic, per_batch = _both(example.model, example.loss_fn, example.make_inputs,
                                budget=200_000, hardware="cpu", objective="throughput")
    _assert_same_answer(symbolic, per_batch)
    # batch 1 (Dynamo specializes sizes 1), the symbolic trace, and the answer's own trace
    assert symbolic.traces == 3
    assert per_batch.traces == len(per_batch.tried) > symbolic.traces
    assert not symbolic.note and "each batch traced on its own" in per_batch.note


@pytest.mark.slow
def test_a_small_gpt2_finds_the_same_batch_and_peak_for_an_h100():
    example = examples.gpt2(layers=2, width=64, sequence=32, dropout=0.0)
    symbolic, per_batch = _both(example.model, example.loss_fn, example.make_inputs,
                                budget="24MB", hardware="h100-sxm", objective="largest",
                                autocast=torch.bfloat16)
    _assert_same_answer(symbolic, per_batch, same_peaks=False)  # auto: swaps chosen by time
    assert symbolic.traces == 3 < per_batch.traces


def _gpt2_with_labels():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)  # its loss logs: a graph break


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.slow
def test_gpt2_with_labels_is_priced_across_its_graph_break():
    model = _gpt2_with_labels()
    symbolic, per_batch = _both(model, _lm_loss,
                                lambda batch: (torch.zeros(batch, 32, dtype=torch.long),),
                                budget="12MB", hardware="h100-sxm", strategy="keep",
                                objective="largest", autocast=torch.bfloat16)
    _assert_same_answer(symbolic, per_batch)
    assert len(symbolic.plan.regions) >= 2
    assert symbolic.traces == 3 < per_batch.traces


class _Halves(torch.nn.Module):
    """Two linear stacks with a logger call between them; ``flatten``: the value crossing the
    graph break is flattened (its size the batch times the width)."""

    def __init__(self, flatten: bool, width: int = 32) -> None:
        super().__init__()
        self.flatten, self.width = flatten, width
        self.first = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(2)])
        self.second = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = h.reshape(-1) if self.flatten else h
        LOGGER.debug("between the halves")
        return torch.tanh(self.second(h.view(-1, self.width))).pow(2).mean()


class _Guarded(torch.nn.Module):
    """A branch on the batch: Dynamo's trace holds only on one side of it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.small = torch.nn.Linear(width, width)
        self.large = torch.nn.Sequential(torch.nn.Linear(width, 4 * width),
                                         torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.large if x.shape[0] > 5 else self.small
        return torch.tanh(layer(x)).pow(2).mean()


class _Looped(torch.nn.Module):
    """A Python loop over the batch: Dynamo specializes its size."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.layer(x[i]).pow(2).mean() for i in range(x.shape[0]))


def _loss(model, x):
    return model(x)


@pytest.mark.slow
@pytest.mark.parametrize("model, budget_bytes, says", [
    (_Halves(flatten=True), 39_000, "crossing a graph break"),
    (_Looped(), 19_000, "Dynamo could not trace a symbolic batch"),
])
def test_a_step_without_a_symbolic_batch_is_traced_per_batch_and_says_why(model, budget_bytes,
                                                                          says):
    symbolic, per_batch = _both(model, _loss, lambda batch: (torch.zeros(batch, 32),),
                                budget=budget_bytes, hardware="cpu", strategy="keep",
                                objective="largest", max_batch=16)
    assert 2 < symbolic.batch_size < 16
    _assert_same_answer(symbolic, per_batch)
    assert says in symbolic.note and "each batch traced on its own" in symbolic.note
    assert symbolic.traces == per_batch.traces + 1  # the symbolic trace that could not serve


@pytest.mark.slow
def test_a_guard_on_the_batch_traces_the_batches_it_excludes():
    symbolic, per_batch = _both(_Guarded(), _loss, lambda batch: (torch.zeros(batch, 32),),
                                budget=82_000, hardware="cpu", strategy="keep",
                                objective="largest", max_batch=16)
    _assert_same_answer(symbolic, per_batch)
    assert 5 < symbolic.batch_size < 16  # past the branch: the trace's side of it
    assert not symbolic.note and symbolic.traces < per_batch.traces


def test_symbolic_must_be_a_bool():
    example = examples.mlp(depth=2, width=8)
    with pytest.raises(ValueError, match="symbolic must be True"):
        memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs,
                              budget=10**6, verify=False, symbolic="yes")
