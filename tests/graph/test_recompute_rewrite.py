"""Recomputed random ops replay the forward's random state; re-runs sit before their readers."""

import copy

import torch

import memfit
from memfit import examples


def test_dropout_is_replayed_bit_for_bit_and_rng_ops_bracket_the_rerun():
    example = examples.gpt2(layers=2, width=32, sequence=32, batch_size=2, dropout=0.5)
    inputs = example.inputs()
    keep = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="keep")
    step = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="checkpoint",
                          checkpoints=["transformer.h.*"])
    torch.manual_seed(11)
    expected = keep(*inputs)
    after_keep = torch.rand(3)  # the generator moves on exactly as after the unplanned step
    torch.manual_seed(11)
    got = step(*inputs)
    assert torch.equal(torch.rand(3), after_keep)
    assert torch.equal(got, expected)
    for a, b in zip(keep.model.parameters(), step.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

    nodes = list(step.compiled.program.graph.nodes)
    kind = {n.name: (n.meta.get("memfit") or {}).get("kind") for n in nodes}
    names = [n.name for n in nodes]
    reruns = [n for n in nodes if kind[n.name] == "recompute" and "dropout" in str(n.target)]
    assert reruns, "no dropout was recomputed"
    for rerun in reruns:
        at = names.index(rerun.name)
        assert kind[names[at - 1]] == "rng_replay_begin" and kind[names[at + 1]] == "rng_replay_end"
        original = rerun.name.removeprefix("memfit_recompute_")
        assert kind[names[names.index(original) - 1]] == "rng_save"
    # deterministic re-runs get no rng ops
    saves = sum(1 for n in nodes if kind[n.name] == "rng_save")
    assert saves == len(reruns)


def test_values_rebuilt_many_times_stay_bitwise_and_predicted():
    """memory-poor re-runs each forward value before every backward reader (dropout included)."""
    example = examples.gpt2(layers=2, width=32, sequence=32, batch_size=2, dropout=0.3)
    inputs = example.inputs()
    keep = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="keep")
    poor = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="memory-poor")
    torch.manual_seed(3)
    expected = keep(*inputs)
    torch.manual_seed(3)
    assert torch.equal(poor(*inputs), expected)
    for a, b in zip(keep.model.parameters(), poor.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert poor.measured.peak_bytes == poor.predicted.peak_bytes < keep.measured.peak_bytes
    reruns = [r.op for r in poor.plan.reruns]
    assert len(reruns) > len(set(reruns))  # some values are rebuilt more than once


def test_optimal_recompute_runs_bitwise_on_a_real_graph():
    example = examples.mlp(depth=3, width=32, batch_size=256)
    inputs = example.inputs()
    keep = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="keep")
    keep(*inputs)
    best = memfit.compile(copy.deepcopy(example.model), example.loss_fn, budget="0.8",
                          strategy="optimal-recompute")
    best(*inputs)
    for a, b in zip(keep.model.parameters(), best.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert best.plan.reruns
    assert best.measured.peak_bytes == best.predicted.peak_bytes <= best.compiled.budget_bytes
