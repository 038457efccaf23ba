"""Executor: same results as torch.fx.Interpreter, values freed at last use, swap ops by hand.

The measured peaks (DeviceMemoryTracker) are compared with hand-computed figures and with the
planner's program-order model (``memfit.model.schedule.memory_profile``) on view-free graphs.
"""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.model.schedule import lower, memory_profile
from memfit.ops.host import host_storage_count
from memfit.ops.swap import SWAP_IN, SWAP_OUT, WAIT
from memfit.runtime.executor import Executor, last_uses
from memfit.runtime.measure import measure_peak

N = 1024  # elements per chain tensor
UNIT = 4 * N  # bytes of one float32 chain tensor
CPU = torch.device("cpu")


def mlp_step(w1, w2, w3, x):
    hidden = torch.tanh(x @ w1)
    hidden = torch.nn.functional.gelu(hidden @ w2)
    loss = (hidden @ w3).pow(2).mean()
    return (loss, *torch.autograd.grad(loss, (w1, w2, w3)))


def _mlp_inputs():
    generator = torch.Generator().manual_seed(0)
    shapes = [(16, 32), (32, 32), (32, 4), (8, 16)]
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def chain(x):
    """A chain whose peak (at ``c``) lies between ``a``'s producer and its late consumer ``f``."""
    a = x * 2
    b = a.sin()
    big = torch.cat([b, b, b])
    c = big.cos()
    e = c.mean()
    return a * e


def _trace(fn, *inputs):
    with torch.enable_grad():
        return make_fx(fn)(*[t.clone().requires_grad_(t.is_floating_point()) for t in inputs])


def _node(graph_module, target):
    return next(n for n in graph_module.graph.nodes if n.target == target)


def _nodes(graph_module, target):
    return [n for n in graph_module.graph.nodes if n.target == target]


def test_joint_mlp_graph_matches_interpreter_bitwise():
    inputs = _mlp_inputs()
    graph_module = _trace(mlp_step, *inputs)
    with torch.no_grad():
        expected = torch.fx.Interpreter(graph_module).run(*inputs)
    result = Executor(graph_module).run(*inputs)
    eager = mlp_step(*[t.clone().requires_grad_() for t in inputs])
    assert len(result) == 4
    for got, want, eager_value in zip(result, expected, eager, strict=True):
        assert torch.equal(got, want) and torch.equal(got, eager_value)


def test_last_uses_frees_unused_values_where_they_are_made():
    graph_module = torch.fx.symbolic_trace(lambda x: (x.sin(), x.cos())[0])
    free_after = last_uses(graph_module.graph)
    by_name = {n.name: n for n in graph_module.graph.nodes}
    assert by_name["cos"] in free_after[by_name["cos"]]  # nobody reads it
    assert by_name["x"] in free_after[by_name["cos"]]  # its last reader
    assert not any(n.op == "output" for values in free_after.values() for n in values)


def test_chain_peak_is_the_hand_computed_one():
    x = torch.randn(N)
    graph_module = _trace(chain, x)
    measured = measure_peak(Executor(graph_module).run, x)
    # At cos: x, a, c (3 units) and its input big (3 units) + c's 3 units: 1 + 1 + 3 + 3.
    assert measured.start_bytes == UNIT
    assert measured.peak_bytes == 8 * UNIT
    assert torch.equal(measured.result, chain(x))


def test_unused_values_are_freed_at_once_unlike_interpreter():
    def with_dead_ends(x):
        for _ in range(4):
            x = x.sin()
            x.cos()  # an unused value: plain Interpreter keeps it until the run ends
        return x

    x = torch.randn(N)
    graph_module = torch.fx.symbolic_trace(with_dead_ends)
    with torch.no_grad():
        plain = measure_peak(torch.fx.Interpreter(graph_module).run, x)
    ours = measure_peak(Executor(graph_module).run, x)
    assert torch.equal(ours.result, plain.result)
    assert ours.peak_bytes == 3 * UNIT  # x, the live sin, and one cos at a time
    assert plain.peak_bytes == 6 * UNIT  # x, sin, sin->cos, and the three earlier cos results
    assert ours.peak_bytes < plain.peak_bytes


def _swap_by_hand(graph_module, produced, control, consumer):
    """Insert swap_out after ``produced``, swap_in after ``control``, wait before ``consumer``."""
    graph = graph_module.graph
    with graph.inserting_after(produced):
        host = graph.call_function(SWAP_OUT, (produced, 0))
    with graph.inserting_after(control):
        back = graph.call_function(SWAP_IN, (host, 0, 1, CPU))
    with graph.inserting_before(consumer):
        graph.call_function(WAIT, (back, 1))
    consumer.replace_input_with(produced, back)
    graph.lint()
    graph_module.recompile()


def test_hand_inserted_swap_keeps_results_and_drops_the_peak_by_one_tensor():
    x = torch.randn(N)
    graph_module = _trace(chain, x)
    kept = measure_peak(Executor(graph_module).run, x)
    first_mul, last_mul = _nodes(graph_module, torch.ops.aten.mul.Tensor)
    mean = _node(graph_module, torch.ops.aten.mean.default)
    _swap_by_hand(graph_module, first_mul, mean, last_mul)
    hosts_before = host_storage_count()
    swapped = measure_peak(Executor(graph_module).run, x)
    assert torch.equal(swapped.result, kept.result)
    assert kept.peak_bytes - swapped.peak_bytes == UNIT
    assert host_storage_count() == hosts_before  # the host copy died with the run
    graph_module.graph.eliminate_dead_code()
    assert len(_nodes(graph_module, WAIT)) == 1


def _cost_graph(graph_module, inputs):
    """The planner's view of a view-free aten graph: one storage per node, sizes from a run."""
    interpreter = torch.fx.Interpreter(graph_module, garbage_collect_values=False)
    with torch.no_grad():
        interpreter.run(*inputs)
    size = {n.name: v.untyped_storage().nbytes() for n, v in interpreter.env.items()
            if isinstance(v, torch.Tensor)}
    output_node = next(n for n in graph_module.graph.nodes if n.op == "output")
    outputs = {n.name for n in output_node.all_input_nodes}
    ops, tensors = [], []
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            tensors.append(Tensor(node.name, size[node.name], "input" if node.op == "placeholder"
                                  else "activation", is_output=node.name in outputs))
        if node.op == "call_function":
            reads = tuple(dict.fromkeys(n.name for n in node.all_input_nodes))
            depends_on = tuple(n.name for n in node.all_input_nodes if n.op == "call_function")
            ops.append(Op(node.name, str(node.target), "forward", inputs=reads,
                          outputs=(node.name,), depends_on=tuple(dict.fromkeys(depends_on))))
    return CostGraph.build(ops, tensors)


def test_measured_peaks_match_the_program_order_model():
    x = torch.randn(N)
    graph_module = _trace(chain, x)
    cost_graph = _cost_graph(graph_module, [x])
    first_mul, last_mul = (n.name for n in _nodes(graph_module, torch.ops.aten.mul.Tensor))
    mean = _node(graph_module, torch.ops.aten.mean.default).name
    swap = Plan("by-hand", {first_mul: Swap((SwapIn(mean, (last_mul,)),))})
    predicted_keep = memory_profile(lower(cost_graph, Plan("keep"))).peak_bytes
    predicted_swap = memory_profile(lower(cost_graph, swap)).peak_bytes
    assert measure_peak(Executor(graph_module).run, x).peak_bytes == predicted_keep
    nodes = {n.name: n for n in graph_module.graph.nodes}
    _swap_by_hand(graph_module, nodes[first_mul], nodes[mean], nodes[last_mul])
    assert measure_peak(Executor(graph_module).run, x).peak_bytes == predicted_swap
    assert predicted_keep - predicted_swap == UNIT


def test_multi_output_tuple_lives_until_its_last_getitem():
    def sort_step(x):
        values, indices = torch.sort(x)
        return values.sin().cos() + indices

    x = torch.randn(N)
    graph_module = make_fx(sort_step)(x)
    getitems = [n for n in graph_module.graph.nodes if n.target is operator.getitem]
    add = _node(graph_module, torch.ops.aten.add.Tensor)
    add.prepend(getitems[1])  # read the indices only at the end: the tuple holds values till then
    graph_module.recompile()
    measured = measure_peak(Executor(graph_module).run, x)
    assert torch.equal(measured.result, sort_step(x))
    # At cos: x, sorted values (kept by the tuple), int64 indices (2 units), sin, cos.
    assert measured.peak_bytes == 6 * UNIT


def test_run_flat_empties_the_list_and_returns_the_output_value():
    inputs = _mlp_inputs()
    graph_module = _trace(mlp_step, *inputs)
    flat = list(inputs)
    result = Executor(graph_module).run_flat(flat)
    assert flat == [] and isinstance(result, (list, tuple)) and len(result) == 4


def test_rewritten_graph_propagates_under_fake_tensors():
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    x = torch.randn(N)
    graph_module = _trace(chain, x)
    first_mul, last_mul = _nodes(graph_module, torch.ops.aten.mul.Tensor)
    _swap_by_hand(graph_module, first_mul, _node(graph_module, torch.ops.aten.mean.default), last_mul)
    FakeTensorProp(graph_module).propagate(x)
    host, back = _node(graph_module, SWAP_OUT), _node(graph_module, SWAP_IN)
    assert host.meta["val"].device == CPU and back.meta["val"].shape == (N,)


def test_a_failing_node_is_named_and_nothing_is_kept():
    graph_module = torch.fx.symbolic_trace(lambda x: torch.mm(x, x))
    executor = Executor(graph_module)
    with pytest.raises(RuntimeError) as raised:
        executor.run(torch.ones(3))
    assert any("while executing" in note and "mm" in note for note in raised.value.__notes__)
    assert executor.env == {}
