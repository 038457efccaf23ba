"""One rank of FSDP2 / DDP as a CostGraph transform, checked by hand on a layered toy step."""

from __future__ import annotations

import pytest

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.hardware import GB, get_hardware
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.model.schedule import live_buffers, lower
from memfit.model.sharding import (
    ALL_GATHER,
    ALL_REDUCE,
    DDP_BUCKETS,
    REDUCE_SCATTER,
    Sharding,
    shard_graph,
    unit_of,
)
from memfit.model.simulate import simulate

LAYERS = 4
WORLD = 4
LAYER_BYTES = 4_000  # each layer's weight (divisible by WORLD)
ROOT_BYTES = 800  # the embedding (root unit)
ACTIVATION_BYTES = 100
UNITS = tuple(f"layers.{i}" for i in range(LAYERS))
HARDWARE = get_hardware("h100-sxm")


def layered() -> CostGraph:
    """``h0 = embed(x, e)``, ``h{i+1} = layer_i(h_i, w_i)``, ``loss = sum(h4)``; backward makes
    ``dh`` and ``dw`` per layer (last layer first), then ``de``. Scopes name the layers."""
    ops = [Op("embed", "aten.embedding", "forward", "", inputs=("x", "e"), outputs=("h0",),
              time_s=1e-4)]
    tensors = [Tensor("x", 8, "input"), Tensor("e", ROOT_BYTES, "parameter"),
               Tensor("h0", ACTIVATION_BYTES, "activation")]
    for i in range(LAYERS):
        ops.append(Op(f"f{i}", "aten.mm", "forward", f"layers.{i}.mlp",
                      inputs=(f"h{i}", f"w{i}"), outputs=(f"h{i + 1}",), time_s=1e-4))
        tensors += [Tensor(f"w{i}", LAYER_BYTES, "parameter"),
                    Tensor(f"h{i + 1}", ACTIVATION_BYTES, "activation")]
    ops.append(Op("loss", "aten.sum", "forward", "", inputs=(f"h{LAYERS}",), outputs=("loss",),
                  time_s=1e-5))
    tensors.append(Tensor("loss", 4, "activation", is_output=True))
    gradient = "loss"
    for i in reversed(range(LAYERS)):
        ops.append(Op(f"b{i}", "aten.mm", "backward", f"layers.{i}.mlp",
                      inputs=(gradient, f"h{i}", f"w{i}"), outputs=(f"dh{i}", f"dw{i}"),
                      time_s=2e-4))
        tensors += [Tensor(f"dh{i}", ACTIVATION_BYTES, "gradient"),
                    Tensor(f"dw{i}", LAYER_BYTES, "gradient", is_output=True)]
        gradient = f"dh{i}"
    ops.append(Op("embed_backward", "aten.embedding_backward", "backward", "",
                  inputs=(gradient, "x"), outputs=("de",), time_s=1e-4))
    tensors.append(Tensor("de", ROOT_BYTES, "gradient", is_output=True))
    return CostGraph.build(ops, tensors, name="layered")


def fsdp(world_size: int = WORLD) -> Sharding:
    return Sharding("fsdp", world_size, UNITS)


def parameter_bytes(graph: CostGraph) -> int:
    return sum(t.size_bytes for t in graph.tensors.values() if t.role == "parameter")


def live_gathered(graph: CostGraph, op: str) -> set[str]:
    """The all-gathered buffers alive while ``op`` runs (unplanned)."""
    schedule = lower(graph, Plan("keep"))
    index = next(i for i, a in enumerate(schedule.actions) if a.kind == "compute" and a.op == op)
    return {name for name, _ in live_buffers(schedule, index) if name.startswith("all_gather.")}


def test_unit_of_takes_the_longest_matching_path():
    units = ("layers.1", "layers.10")
    assert unit_of("layers.10.mlp", units) == "layers.10"
    assert unit_of("layers.1", units) == "layers.1"
    assert unit_of("head", units) == ""


def test_parameters_gradients_and_optimizer_state_are_one_rank_s_share():
    graph, sharded = layered(), shard_graph(layered(), fsdp(), HARDWARE)
    assert parameter_bytes(sharded) == parameter_bytes(graph) // WORLD
    kept = [t for t in sharded.tensors.values() if t.is_output and t.role == "gradient"]
    assert {t.producer for t in kept} == {f"reduce_scatter.{u}" for u in ("root", *UNITS)}
    unsharded_gradients = LAYERS * LAYER_BYTES + ROOT_BYTES
    assert sum(t.size_bytes for t in kept) == unsharded_gradients // WORLD
    adam_state_bytes = 2 * parameter_bytes(graph)
    assert fsdp().outside_bytes(adam_state_bytes + 64, adam_state_bytes) == \
        adam_state_bytes // WORLD + 64  # 64 bytes of buffers stay whole
    assert Sharding("ddp", WORLD).outside_bytes(1000, 800) == 1000


def test_two_blocks_of_unsharded_parameters_are_in_flight_and_the_root_stays():
    sharded = shard_graph(layered(), fsdp(), HARDWARE)
    forward = live_gathered(sharded, "f1")  # layer 1 runs, layer 2 prefetched
    assert forward == {"all_gather.root.forward", "all_gather.layers.1.forward",
                       "all_gather.layers.2.forward"}
    backward = live_gathered(sharded, "b2")  # layer 2's backward, layer 1 prefetched
    assert backward == {"all_gather.root.forward", "all_gather.layers.2.backward",
                        "all_gather.layers.1.backward"}
    assert live_gathered(sharded, "f3") == {"all_gather.root.forward",
                                            "all_gather.layers.3.forward"}


def test_the_peak_is_the_hand_count():
    """Resident shards, the root and two layers gathered, the activations still to be read,
    the gradients reduce-scattered so far and those still unsharded: counted by hand at the
    peak of the unplanned rank, layer 1's backward (layer 0's backward has nothing left to
    prefetch; layer 3's holds two more activations but no reduced gradients)."""
    sharded = shard_graph(layered(), fsdp(), HARDWARE)
    timeline = simulate(sharded, Plan("keep"), HARDWARE)
    assert timeline.peak_label == "b1"
    resident = 8 + (ROOT_BYTES + LAYERS * LAYER_BYTES) // WORLD
    gathered = ROOT_BYTES + 2 * LAYER_BYTES  # root, layer 1 (backward) and layer 0 prefetched
    activations = 3 * ACTIVATION_BYTES + 4  # h0, h1, dh2 and the loss
    reduced = 2 * LAYER_BYTES // WORLD  # layers 3 and 2, reduce-scattered
    made = ACTIVATION_BYTES + LAYER_BYTES  # b1's dh1 and dw1 (unsharded until reduce-scattered)
    assert timeline.peak_bytes == resident + gathered + activations + reduced + made


def test_collective_times_on_the_timeline_are_the_ring_formula():
    sharded = shard_graph(layered(), fsdp(), HARDWARE)
    timeline = simulate(sharded, Plan("keep"), HARDWARE)
    comm = {i.label: i.end_s - i.start_s for i in timeline.intervals if i.stream == "comm"}
    ring = (WORLD - 1) / WORLD * LAYER_BYTES / (360 * GB)
    assert comm["all_gather.layers.0.forward"] == pytest.approx(20e-6 + ring, rel=1e-12)
    assert comm["reduce_scatter.layers.0"] == pytest.approx(20e-6 + ring, rel=1e-12)
    assert HARDWARE.collective_time_s("all_reduce", LAYER_BYTES, WORLD) == \
        pytest.approx(20e-6 + 2 * ring, rel=1e-12)
    across_nodes = HARDWARE.collective_time_s("all_gather", 16 * GB, 16)
    assert across_nodes == pytest.approx(20e-6 + 15 / 16 * 16 * GB / (45 * GB), rel=1e-12)
    assert {op.kind for op in sharded.ops if op.name in comm} == {ALL_GATHER, REDUCE_SCATTER}


def test_compute_waits_for_its_all_gather():
    slow = HARDWARE.with_(collective_bytes_per_s=1e6)  # 3 ms per layer: compute must wait
    timeline = simulate(shard_graph(layered(), fsdp(), slow), Plan("keep"), slow)
    starts = {i.label: i for i in timeline.intervals}
    assert starts["f0"].start_s >= starts["all_gather.layers.0.forward"].end_s
    assert any(i.kind == "wait" for i in timeline.intervals)


def test_a_swap_does_not_queue_behind_a_collective():
    """A swap-out issued while a long all-gather occupies the communication stream starts
    right after its producer, on its own stream."""
    slow = HARDWARE.with_(collective_bytes_per_s=1e6)
    sharded = shard_graph(layered(), fsdp(), slow)
    plan = Plan("swap", {"h1": Swap((SwapIn("b2", ("b1",)),))})
    timeline = simulate(sharded, plan, slow)
    by_label = {i.label: i for i in timeline.intervals}
    swap_out = by_label["swap_out(h1)"]
    assert swap_out.start_s == by_label["f0"].end_s and swap_out.stream == "d2h"
    busy = [i.label for i in timeline.intervals
            if i.stream == "comm" and i.start_s < swap_out.start_s < i.end_s]
    assert busy == ["all_gather.layers.1.forward"]  # running meanwhile, on its own stream


def test_one_rank_or_no_sharding_leaves_the_graph_alone():
    graph = layered()
    assert shard_graph(graph, fsdp(world_size=1), HARDWARE) is graph
    assert shard_graph(graph, Sharding("none", 8), HARDWARE) is graph


def test_the_transform_is_deterministic():
    first = shard_graph(layered(), fsdp(), HARDWARE)
    second = shard_graph(layered(), fsdp(), HARDWARE)
    assert first.structure_hash == second.structure_hash
    assert [op.name for op in first.ops] == [op.name for op in second.ops]


def test_ddp_all_reduces_buckets_and_keeps_them_resident():
    graph = layered()
    sharded = shard_graph(graph, Sharding("ddp", WORLD, bucket_bytes=2 * LAYER_BYTES), HARDWARE)
    reduces = [op for op in sharded.ops if op.kind == ALL_REDUCE]
    assert [op.inputs for op in reduces] == [("dw3", "dw2"), ("dw1", "dw0"), ("de",)]
    assert sharded.tensors[DDP_BUCKETS].size_bytes == LAYERS * LAYER_BYTES + ROOT_BYTES
    assert sharded.resident_bytes == graph.resident_bytes + LAYERS * LAYER_BYTES + ROOT_BYTES
    assert parameter_bytes(sharded) == parameter_bytes(graph)


def test_a_profile_without_a_peer_link_refuses_more_than_one_rank():
    with pytest.raises(ValueError, match="states no bandwidth between 4 ranks"):
        shard_graph(layered(), fsdp(), get_hardware("cpu"))
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        Sharding("fsdp", 0)
    with pytest.raises(ValueError, match="sharding must be one of"):
        Sharding("zero3", 2)  # type: ignore[arg-type]
