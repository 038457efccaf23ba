"""The fused-chains strategy (auto's candidate under inductor) on a captured BatchNorm CNN: every
memory-bound forward value re-runs inside the backward's kernels, the outputs of library calls
(convolutions) are kept but those whose re-run lowers the peak, as ``torch.compile``'s partitioner
plans under its activation memory budget. Its peak is what memfit's model of inductor's program
gives (inlined values, fused re-runs, in-place writes); on aot_eager's program it is not offered."""

import shutil
from dataclasses import replace

import pytest
import torch

import memfit
from memfit import examples
from memfit.data.costgraph import CostGraph
from memfit.data.hardware import get_hardware
from memfit.data.op_classes import MEMORY, op_class
from memfit.data.plan import Recompute
from memfit.model.schedule import lower, memory_profile
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.recomputing import fused_chains

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                       reason="inductor needs a C++ compiler on the CPU (install g++)"),
]

HARDWARE = get_hardware("cpu")


@pytest.fixture(scope="module")
def joint() -> CostGraph:
    """The joint graph inductor runs for a small BatchNorm CNN, as memfit priced it."""
    torch._dynamo.reset()
    example = examples.cnn(channels=8, blocks=3, image=16, batch_size=4)
    fitted = memfit.fit(example.model, compiler="inductor", hardware=HARDWARE)
    example.loss_fn(fitted, *example.inputs()).backward()
    (region,) = fitted._memfit_backend.regions
    torch._dynamo.reset()
    return region.graph


def _graph(graph: CostGraph, compiler: str) -> CostGraph:
    return replace(graph, compiler=compiler)


def _peak(graph, plan) -> int:
    return memory_profile(lower(graph, plan)).peak_bytes


def test_every_chain_reruns_and_only_library_calls_that_lower_the_peak(joint):
    graph = _graph(joint, "inductor")
    keep = get_strategy("keep")(graph, HARDWARE)
    chains_only = fused_chains._plan(graph, fused_chains._chain_values(graph), ())
    assert _peak(graph, chains_only) < _peak(graph, keep)

    plan = get_strategy("fused-chains")(graph, HARDWARE, _peak(graph, chains_only) - 1)
    assert plan.params["library_calls_recomputed"] >= 1
    assert _peak(graph, plan) < _peak(graph, chains_only)
    calls = fused_chains._library_values(graph, fused_chains._chain_values(graph))
    for tensor, decision in plan.decisions.items():
        producer = graph.op(graph.tensors[tensor].producer)
        assert isinstance(decision, Recompute) and producer.phase == "forward"
        assert op_class(producer.kind) == MEMORY or tensor in calls
    with pytest.raises(memfit.BudgetError) as refused:  # nothing fits a byte
        fused_chains.plan(graph, HARDWARE, 1)
    assert refused.value.minimum_bytes <= _peak(graph, plan)
    assert fused_chains.plan(graph, HARDWARE).params["library_calls_recomputed"] == 0


def test_auto_offers_it_under_inductor_only_and_takes_it_where_it_is_the_fastest_fit(joint):
    inductor = _graph(joint, "inductor")
    budget = _peak(inductor, fused_chains.plan(inductor, HARDWARE))
    planned = get_strategy("auto")(inductor, HARDWARE, budget)
    candidates = planned.params["candidates"]
    assert candidates[fused_chains.NAME] is not None  # it fits its own peak
    fastest = min((time, name) for name, time in candidates.items() if time is not None)[1]
    assert planned.params["solver"] == fastest
    eager = _graph(joint, "aot_eager")
    with pytest.raises(ValueError, match="inductor"):
        fused_chains.plan(eager, HARDWARE)
    assert get_strategy("auto")(eager, HARDWARE, budget).params["candidates"].get(
        fused_chains.NAME) is None


def test_the_batch_norm_gradient_takes_the_storage_of_the_rerun_relu_it_reads_last(joint):
    """Inductor's backward kernel for a batch norm reads the re-run ReLU's value last (its mask)
    and writes the input gradient into that storage: the model counts one buffer, not two."""
    graph = _graph(joint, "inductor")
    plan = fused_chains._plan(graph, fused_chains._chain_values(graph), ())
    schedule = lower(graph, plan)
    reruns = {source for source in schedule.in_place.values() if "#re" in source}
    assert {source.split("#")[0] for source in reruns} & {"relu", "relu_1", "relu_2"}
    made_in_backward = {buffer for action in schedule.actions if action.kind == "compute"
                        and graph.op(action.op).phase == "backward" for buffer in action.allocates}
    assert all(written in made_in_backward for written, source in schedule.in_place.items()
               if source in reruns)
    assert all(schedule.buffer_bytes[written] == schedule.buffer_bytes[source]
               for written, source in schedule.in_place.items())
    inplace_off = replace(schedule, in_place={})
    assert memory_profile(schedule).peak_bytes < memory_profile(inplace_off).peak_bytes
