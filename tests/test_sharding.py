"""Plans for a cluster from one machine: ``memfit.plan(..., world_size=, sharding=)`` and the CLI,
on a 4-layer transformers Llama whose step is traced once (meta inputs, nothing runs)."""

from __future__ import annotations

import json

import pytest
import torch

import memfit
from memfit import examples
from memfit.cli import main
from memfit.data.hardware import get_hardware
from memfit.fitting.cluster import fsdp_units, resolve_sharding
from memfit.fitting.traced import trace_plan
from memfit.model.schedule import live_buffers, lower, memory_profile

WORLD = 4
HARDWARE = get_hardware("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    example = examples.llama(layers=4, width=64, heads=4, kv_heads=2, vocab=128, sequence=64)
    inputs = tuple(t.to("meta") for t in example.inputs(4))
    return example, inputs


def traced(example, inputs, sharding="fsdp", world_size=WORLD, optimizer=None,
           strategy="keep"):
    spread = resolve_sharding(example.model, sharding, world_size)
    return trace_plan(example.model, example.loss_fn, inputs, None, strategy, HARDWARE, {},
                      sharding=spread, optimizer=optimizer)


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_default_units_are_the_decoder_layers(llama):
    example, _ = llama
    layers = tuple(f"model.layers.{i}" for i in range(4))
    assert fsdp_units(example.model) == layers
    block = type(example.model.model.layers[0])
    assert fsdp_units(example.model, block) == layers
    assert fsdp_units(example.model, lambda path, _: path.endswith("mlp")) == tuple(
        f"{layer}.mlp" for layer in layers)
    with pytest.raises(ValueError, match="no module of the model matches"):
        fsdp_units(example.model, torch.nn.Conv2d)


@pytest.mark.slow
def test_one_rank_holds_a_world_size_share_of_parameters_and_adam_state(llama):
    example, inputs = llama
    optimizer = torch.optim.AdamW(example.model.parameters())
    whole = traced(example, inputs, "none", 1, optimizer)
    sharded = traced(example, inputs, optimizer=optimizer)

    def graph_parameters(planned):
        return sum(t.size_bytes for t in planned.graph.tensors.values() if t.role == "parameter")

    total = parameter_bytes(example.model)
    rotary = 32  # inv_freq, 8 float32: a compiled region's static inputs include buffers
    assert graph_parameters(whole) == total + rotary
    assert graph_parameters(sharded) == (total + rotary) // WORLD  # every size divides by 4
    adam_bytes = 2 * total + 4 * sum(1 for _ in example.model.parameters())  # + step counts
    assert whole.budget.outside_bytes - sharded.budget.outside_bytes == \
        adam_bytes - adam_bytes // WORLD
    gradients = [t for t in sharded.graph.tensors.values() if t.is_output and t.role == "gradient"]
    assert sum(t.size_bytes for t in gradients) == total // WORLD


def test_gathered_bytes_at_the_peak_are_the_hand_count(llama):
    """At the unplanned rank's peak (the loss's backward, in the root) only the root's
    parameters are unsharded: the last layer's were freed after its forward and its backward
    has not begun. While layer 1 runs forward, layer 2's are prefetched: root + two layers.
    Counted from the model's parameters."""
    example, inputs = llama
    planned = traced(example, inputs)
    schedule = lower(planned.graph, planned.plan)

    def gathered_at(index: int) -> dict[str, int]:
        return {name: size for name, size in live_buffers(schedule, index)
                if name.startswith("all_gather.")}

    layer = parameter_bytes(example.model.model.layers[0])
    root = parameter_bytes(example.model) - 4 * layer + 32  # + rotary inv_freq (8 float32)
    peak = memory_profile(schedule).peak_index
    assert planned.graph.op(schedule.actions[peak].op).scope == ""
    assert gathered_at(peak) == {"all_gather.root.forward": root}
    first = next(i for i, a in enumerate(schedule.actions)
                 if planned.graph.op(a.op).scope.startswith("model.layers.1."))
    assert sorted(gathered_at(first)) == ["all_gather.model.layers.1.forward",
                                          "all_gather.model.layers.2.forward",
                                          "all_gather.root.forward"]
    assert sum(gathered_at(first).values()) == root + 2 * layer


@pytest.mark.slow
def test_one_rank_plans_exactly_as_one_device(llama):
    example, inputs = llama
    plain = memfit.plan(example.model, example.loss_fn, *inputs, budget=0.6, hardware=HARDWARE)
    for sharding in ("fsdp", "ddp"):
        one = memfit.plan(example.model, example.loss_fn, *inputs, budget=0.6,
                          hardware=HARDWARE, world_size=1, sharding=sharding)
        assert json.dumps(one.to_json(), sort_keys=True) == \
            json.dumps(plain.to_json(), sort_keys=True)


@pytest.mark.slow
def test_sharded_plans_fit_their_per_rank_budget_and_repeat(llama):
    example, inputs = llama
    unplanned = traced(example, inputs)
    budget = int(0.7 * unplanned.baseline_peak_bytes)
    first = memfit.plan(example.model, example.loss_fn, *inputs, budget=budget,
                        hardware=HARDWARE, world_size=WORLD, sharding="fsdp")
    again = memfit.plan(example.model, example.loss_fn, *inputs, budget=budget,
                        hardware=HARDWARE, world_size=WORLD, sharding="fsdp")
    assert first.decisions == again.decisions and first.decisions  # same plan on every rank
    assert first.explanation is not None
    peak_bytes = first.explanation.peak_bytes  # whole device: outside bytes included
    assert first.explanation.outside_bytes == unplanned.budget.outside_bytes
    assert peak_bytes <= budget < unplanned.baseline_peak_bytes


@pytest.mark.slow
def test_ddp_rank_holds_whole_parameters_and_the_buckets(llama):
    example, inputs = llama
    whole, ddp = traced(example, inputs, "none", 1), traced(example, inputs, "ddp")
    assert ddp.graph.resident_bytes - whole.graph.resident_bytes == parameter_bytes(example.model)
    reduces = [op for op in ddp.graph.ops if op.kind == "comm.all_reduce"]
    assert len(reduces) == 1  # the model's 0.3 MB of gradients fill one 25 MiB bucket


def test_max_batch_size_answers_per_rank_and_is_not_verified(llama):
    example, _ = llama
    with pytest.raises(ValueError, match="cannot be verified"):
        memfit.max_batch_size(example.model, example.loss_fn, example.make_inputs, "64MiB",
                              HARDWARE, "keep", verify=True, world_size=WORLD, sharding="fsdp",
                              max_batch=4)


@pytest.mark.slow
def test_cli_plans_one_rank(capsys):
    pytest.importorskip("transformers")
    common = ["plan", "--model", "llama", "--hardware", "h100-sxm", "--strategy", "keep"]
    assert main([*common, "--world-size", "4", "--fsdp"]) == 0
    sharded = capsys.readouterr().out
    assert main(common) == 0
    whole = capsys.readouterr().out
    assert sharded != whole
    with pytest.raises(SystemExit) as error:
        main([*common, "--world-size", "4", "--fsdp", "--ddp"])
    assert error.value.code == 2
    assert main([*common, "--world-size", "4", "--ddp"]) == 0


def test_a_model_on_the_meta_device_is_refused_not_planned_without_its_backward():
    transformers = pytest.importorskip("transformers")
    from memfit.data.errors import CaptureError

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        tokens = torch.zeros(2, 16, dtype=torch.long)

    def loss_fn(model, tokens):
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    with pytest.raises(CaptureError, match="to_empty"):
        memfit.plan(model, loss_fn, tokens, hardware=HARDWARE)
    planned = memfit.plan(model.to_empty(device="cpu"), loss_fn, tokens, hardware=HARDWARE,
                          world_size=2, sharding="fsdp")
    assert planned.explanation is not None


@pytest.mark.slow
def test_cli_searches_one_rank_s_batch(capsys):
    pytest.importorskip("transformers")
    assert main(["max-batch-size", "--model", "llama", "--budget", "64MiB", "--hardware",
                 "h100-sxm", "--world-size", "8", "--fsdp", "--max-batch", "4",
                 "--strategy", "keep"]) == 0
    assert "max_batch=4 fits" in capsys.readouterr().out
