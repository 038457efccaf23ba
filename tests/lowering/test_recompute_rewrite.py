"""Recomputed random ops replay the forward's random state; re-runs sit before their readers."""

import copy

import pytest
import torch

import memfit
from memfit import examples
from tests.measured_peaks import assert_measured_as_predicted, assert_within_budget


def program_nodes(step):
    """The planned region's program in order: its forward module's nodes, then its backward
    module's computation (its inputs are the forward's saved values, counted once)."""
    forward, backward = step.compiled.forward.graph, step.compiled.backward.graph
    return [*(n for n in forward.nodes if n.op != "output"),
            *(n for n in backward.nodes if n.op != "placeholder")]


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

    nodes = program_nodes(step)
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


@pytest.mark.slow
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
    assert_measured_as_predicted(poor)
    assert poor.measured.peak_bytes < keep.measured.peak_bytes
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
    assert_measured_as_predicted(best)
    assert_within_budget(best, best.budget_bytes)


def checkpoints_fed_from_host(graph, plan):
    """``plan`` plus a swap of every value its re-runs read, back just before the first of them
    (a link so fast every copy is free)."""
    from memfit.data.hardware import PROFILES
    from memfit.data.plan import Plan
    from memfit.model.recompute import planned_reruns
    from memfit.planning.strategies.swapping._free_swaps import free_swaps

    instant = PROFILES["cpu"].with_(async_copies=True, d2h_bytes_per_s=1e18, h2d_bytes_per_s=1e18,
                                    copy_latency_s=0.0)
    swaps = free_swaps(graph, instant, exclude=plan.recomputed, reruns=planned_reruns(graph, plan))
    return Plan("fed", {**plan.decisions, **swaps}, graph_hash=graph.structure_hash)


@pytest.mark.slow
@pytest.mark.parametrize("build, params, lowers_the_peak", [
    # block inputs fed to re-runs of GPT-2 blocks, dropout replayed; its peak is the last block
    # rebuilt, with every weight gradient made, where no checkpoint is left to swap
    (lambda: examples.gpt2(layers=4, width=32, vocab=16, sequence=128, batch_size=4, dropout=0.3),
     {"checkpoints": ["transformer.h.*"]}, False),
    # sqrt(n) checkpoints of a deep MLP: the peak was at the start of the backward pass
    (lambda: examples.mlp(depth=12, width=32, batch_size=512), {}, True),
], ids=["gpt2-blocks", "mlp-sqrt-n"])
def test_reruns_read_checkpoints_swapped_back_from_the_host_bitwise(build, params, lowers_the_peak):
    """Swap + recompute: checkpoints leave the device in the forward pass and come back for the
    re-runs that rebuild from them; gradients bit for bit, peak as predicted."""
    example = build()
    inputs = example.inputs()
    keep = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="keep")
    checkpointed = memfit.compile(copy.deepcopy(example.model), example.loss_fn,
                                  strategy="checkpoint", **params)
    torch.manual_seed(5)
    expected = keep(*inputs)
    torch.manual_seed(5)
    checkpointed(*inputs)
    compiled = checkpointed.compiled
    fed_plan = checkpoints_fed_from_host(compiled.graph, compiled.plan)
    fed = memfit.compile(copy.deepcopy(example.model), example.loss_fn, plan=fed_plan)
    torch.manual_seed(5)
    assert torch.equal(fed(*inputs), expected)
    for a, b in zip(keep.model.parameters(), fed.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

    graph = compiled.graph
    feeding = {t: s for t, d in fed_plan.decisions.items() if hasattr(d, "swap_ins")
               for s in d.swap_ins if any(graph.index[c] <= graph.index[s.after] for c in s.consumers)}
    assert feeding, "no swap-in feeds a re-run"
    nodes = program_nodes(fed)
    kind = {n: (n.meta.get("memfit") or {}).get("kind") for n in nodes}
    fed_reruns = [n for n in nodes if kind[n] == "recompute" and any(  # inputs: maybe saved
        kind.get(a) == "swap_in" or (kind.get(a) == "view_replay" and any(
            kind.get(b) == "swap_in" for b in a.all_input_nodes)) for a in n.all_input_nodes)]
    assert fed_reruns, "no re-run reads a swapped-in copy"
    for rerun in fed_reruns:  # the compute stream waits for each copy before its first reader
        swap_in = next(a for a in [*rerun.all_input_nodes, *(b for a in rerun.all_input_nodes
                                                              for b in a.all_input_nodes)]
                       if kind.get(a) == "swap_in")
        waits = [n for n in swap_in.users if kind.get(n) == "wait"]
        assert len(waits) == 1 and nodes.index(waits[0]) < nodes.index(rerun)

    measured, predicted = fed.measured.peak_bytes, fed.compiled.predicted_peak_bytes
    assert_measured_as_predicted(fed)
    if lowers_the_peak:
        assert predicted < checkpointed.compiled.predicted_peak_bytes  # both with what is outside
        assert measured < checkpointed.measured.peak_bytes
    else:
        assert predicted <= checkpointed.compiled.predicted_peak_bytes
