"""Checkpointing a graph with no articulation point at all still saves about sqrt(n) memory."""

import math

from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.model import separators
from memfit.model.simulate import simulate
from memfit.model.synthetic import Node, from_forward
from memfit.planning.strategies import get_strategy

UNIT = Hardware("unit", {"float32": 1.0}, 1.0, 1.0, 1.0, op_overhead_s=0.0, copy_latency_s=0.0)
DEPTH = 36
SIZE = 1 << 20


def two_bare_towers():
    """Two chains that both read the input and both feed the loss: no single op separates."""
    nodes = [Node(f"t{t}_{d}", (f"t{t}_{d - 1}",) if d else (), SIZE, time_s=1e-3)
             for t in range(2) for d in range(DEPTH)]
    return from_forward(nodes, input_bytes=SIZE, weight_bytes=0, name="bare towers")


def test_no_articulation_point_still_gets_a_sqrt_n_saving():
    graph = two_bare_towers()
    assert separators.articulation_points(graph) == ()
    keep = simulate(graph, Plan("keep"), UNIT)
    made = get_strategy("checkpoint")(graph, UNIT, checkpoints="memory")
    timeline = simulate(graph, made, UNIT)
    keep_units = (keep.peak_bytes - graph.resident_bytes) / SIZE
    units = (timeline.peak_bytes - graph.resident_bytes) / SIZE
    assert keep_units >= 2 * DEPTH  # every layer output of both towers at once
    # sqrt(n) per tower, both towers at once: within 2x of 2 * 2 sqrt(depth)
    assert units <= 2 * 2 * 2 * math.sqrt(DEPTH)
    forward_s = sum(op.time_s for op in graph.forward_ops)
    assert timeline.recompute_s <= forward_s
    assert all(len(s) == 2 for s in separators.sqrt_checkpoints(graph))  # one op per tower


def test_weight_casts_of_a_bf16_step_are_no_shortcut_past_the_layers():
    """A bf16 step (GPT-2 planned for an H100 under autocast) casts each weight where a layer
    reads it: ops computed from parameters alone. Joined to the input they bypassed every layer
    (no articulation point: checkpoint's minimum was 78% of the unplanned peak); dropped from the
    separation graph, each layer is separated again and checkpoint saves as in float32."""
    import torch

    from memfit import examples
    from memfit.data.hardware import get_hardware
    from memfit.fitting.traced import trace_plan
    from memfit.model.schedule import peak_bytes

    layers = 4
    example = examples.gpt2(layers=layers, width=64, heads=4, vocab=64, sequence=256,
                            batch_size=16)
    inputs = tuple(t.to("meta") for t in example.inputs())
    hardware = get_hardware("h100-pcie")
    graph = trace_plan(example.model, example.loss_fn, inputs, None, "keep", hardware, {},
                       autocast=torch.bfloat16).graph
    assert any(op.kind == "aten._to_copy" and op.inputs and all(
        graph.tensors[t].role == "parameter" for t in op.inputs) for op in graph.forward_ops)
    assert len(separators.articulation_points(graph)) >= layers
    made = get_strategy("checkpoint")(graph, hardware, checkpoints="memory")
    assert peak_bytes(graph, made) < 0.5 * peak_bytes(graph, Plan("keep"))
