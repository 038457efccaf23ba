"""Inductor's kernels as the time model sees them: a pointwise chain fused into one kernel that
costs less than its ops run one by one, never across an op that reads the chain nor across a
random op (eager's kernel under ``fallback_random``), and the eager pricing left as it is for
aot_eager."""

from dataclasses import replace

import pytest

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.hardware import PROFILES
from memfit.model.kernels import (
    compiled_times,
    eager_times,
    fused_kernels,
    kernel_count,
    kernel_time_s,
    priced_for,
    repriced,
)

MIB = 2**20
HARDWARE = PROFILES["h100-sxm"]


def _op(name: str, kind: str, inputs: tuple[str, ...], size_bytes: int = MIB) -> tuple[Op, Tensor]:
    """An op and the tensor it allocates, priced as ``analyze`` prices it eagerly."""
    moved = size_bytes * (len(inputs) + 1)
    flops = 2e9 if kind == "aten.mm" else 0.0
    time_s = HARDWARE.op_time_s(flops, moved, kind=kind)
    op = Op(name, kind, "forward", inputs=inputs, outputs=(name,),
            depends_on=tuple(i for i in inputs if i not in ("x", "w")), time_s=time_s,
            flops=flops, bytes_accessed=moved)
    return op, Tensor(name, size_bytes, "activation")


def _graph(*specs: tuple[str, str, tuple[str, ...]], outputs: tuple[str, ...] = ()) -> CostGraph:
    made = [_op(*spec) for spec in specs]
    tensors = [Tensor("x", MIB, "input"), Tensor("w", MIB, "parameter")]
    tensors += [Tensor(t.name, t.size_bytes, t.role, is_output=t.name in outputs)
                for _, t in made]
    return CostGraph.build([op for op, _ in made], tensors)


def test_a_pointwise_chain_is_one_kernel_faster_than_its_ops():
    graph = _graph(("mm", "aten.mm", ("x", "w")), ("add", "aten.add", ("mm", "w")),
                   ("mul", "aten.mul", ("add",)), ("relu", "aten.relu", ("mul",)),
                   ("out", "aten.mm", ("relu", "w")), outputs=("out",))
    assert fused_kernels(graph) == [[0], [1, 2, 3], [4]]
    assert kernel_count(graph, "inductor") == 3 and kernel_count(graph, "aot_eager") == 5
    times = compiled_times(graph, HARDWARE)
    chain = ("add", "mul", "relu")
    assert sum(times[name] for name in chain) < sum(graph.op(name).time_s for name in chain)
    fused = priced_for(graph, HARDWARE, "inductor")
    assert fused.step_time_s < graph.step_time_s
    assert fused.op("mm").time_s == pytest.approx(
        graph.op("mm").time_s - HARDWARE.op_overhead_s + HARDWARE.kernel_overhead_s)


def test_a_chain_read_outside_closes_before_a_later_reader():
    """A residual add reads the first add and a matmul that itself reads the first add: fusing
    it into the first add's kernel would make that kernel wait on itself."""
    graph = _graph(("add0", "aten.add", ("x", "w")), ("mm", "aten.mm", ("add0", "w")),
                   ("add1", "aten.add", ("add0", "mm")), outputs=("add1",))
    assert fused_kernels(graph) == [[0], [1], [2]]


def test_two_open_chains_that_one_op_reads_merge():
    graph = _graph(("a", "aten.neg", ("x",)), ("b", "aten.exp", ("w",)),
                   ("c", "aten.add", ("a", "b")), outputs=("c",))
    assert fused_kernels(graph) == [[0, 1, 2]]


def test_a_random_op_stays_out_of_the_chains_around_it_as_an_eager_kernel():
    """memfit compiles with inductor's ``fallback_random``: dropout between two pointwise ops
    runs eager's kernel, priced as a library call, and splits the chain in two."""
    graph = _graph(("add", "aten.add", ("x", "w")), ("drop", "aten.native_dropout", ("add",)),
                   ("mul", "aten.mul", ("drop",)), outputs=("mul",))
    assert fused_kernels(graph) == [[0], [1], [2]]
    fused = priced_for(graph, HARDWARE, "inductor")
    assert fused.op("drop").time_s == pytest.approx(
        graph.op("drop").time_s - HARDWARE.op_overhead_s + HARDWARE.kernel_overhead_s)


def test_aot_eager_keeps_the_eager_times_and_an_unknown_compiler_is_refused():
    graph = _graph(("a", "aten.neg", ("x",)), ("b", "aten.exp", ("a",)), outputs=("b",))
    assert priced_for(graph, HARDWARE, "aot_eager") is graph
    with pytest.raises(ValueError, match="unknown compiler"):
        priced_for(graph, HARDWARE, "tvm")


def test_a_softmax_kernel_runs_at_the_compiled_softmax_rate_where_that_is_slower():
    """Inductor's kernel for a softmax (a row's ``amax``, ``exp``, their sum, fused with a
    scale) makes several passes over each row: priced per element of its ``exp`` at the
    profile's ``compiled_softmax`` rate; a kernel without both kinds is not."""
    elements = MIB // 4
    specs = (("scaled", "aten.mul", ("x",)), ("top", "aten.amax", ("scaled",)),
             ("shifted", "aten.sub", ("scaled", "top")), ("exp", "aten.exp", ("shifted",)),
             ("total", "aten.sum", ("exp",)), ("probabilities", "aten.div", ("exp", "total")))
    made = [_op(*spec) for spec in specs]
    ops = [replace(op, elements=elements) for op, _ in made]
    tensors = [Tensor("x", MIB, "input"), Tensor("w", MIB, "parameter")]
    tensors += [Tensor(t.name, t.size_bytes, t.role, is_output=t.name == "probabilities")
                for _, t in made]
    graph = CostGraph.build(ops, tensors)
    assert fused_kernels(graph) == [list(range(len(specs)))]
    slow = HARDWARE.with_(element_rates={"compiled_softmax": 1e6})
    assert kernel_time_s(graph, fused_kernels(graph)[0], slow) == pytest.approx(
        elements / 1e6 + slow.kernel_overhead_s)
    fast = HARDWARE.with_(element_rates={"compiled_softmax": 1e15})  # its bytes are slower
    assert kernel_time_s(graph, fused_kernels(graph)[0], fast) == kernel_time_s(
        graph, fused_kernels(graph)[0], HARDWARE)
    without_amax = CostGraph.build(
        [replace(op, kind="aten.mean") if op.kind == "aten.amax" else op for op in ops], tensors)
    assert kernel_time_s(without_amax, fused_kernels(without_amax)[0], slow) < 1e-3


def test_an_eager_op_after_one_that_streamed_the_cache_pays_the_cold_overhead():
    """Its dispatch runs from memory: the full ``cold_overhead_s`` after an op that moved the
    whole cache, a fraction after a smaller one, none after a ``getitem`` alone."""
    cpu = PROFILES["cpu"].with_(cold_overhead_s=1e-5, cache_bytes=2 * MIB, view_overhead_s=1e-6)
    graph = _graph(("big", "aten.add", ("x", "w")), ("small", "aten.neg", ("x",)),
                   ("after", "aten.relu", ("small",)), outputs=("big", "after"))
    big, small, after = graph.ops
    graph = CostGraph.build([replace(big, bytes_accessed=4 * MIB),
                             replace(small, bytes_accessed=MIB // 2), after],
                            graph.tensors.values())
    times = eager_times(graph, cpu)
    own = {op.name: cpu.op_time_s(op.flops, op.bytes_accessed, op.dtype, op.kind, op.elements)
           for op in graph.ops}
    assert times["big"] == own["big"]
    assert times["small"] == pytest.approx(own["small"] + 1e-5)
    assert times["after"] == pytest.approx(own["after"] + 1e-5 / 4)
    assert repriced(graph, cpu, "aot_eager").op("after").time_s == pytest.approx(times["after"])
