"""Checkpointing a graph with no articulation point at all still saves about sqrt(n) memory."""

import math

from memfit.core import graphs
from memfit.core.hardware import Hardware
from memfit.core.plan import Plan
from memfit.core.simulate import simulate
from memfit.core.synthetic import Node, from_forward
from memfit.strategies import get_strategy

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
    assert graphs.articulation_points(graph) == ()
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
    assert all(len(s) == 2 for s in graphs.sqrt_checkpoints(graph))  # one op per tower
