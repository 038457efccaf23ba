"""Inductor's inlined pointwise values and fused kernels in the memory model: a value only
generated kernels of its own pass read is never stored (its readers read what it reads, which
lives until them); a value a library call, the other pass, a copy to the host or the step's
output reads is stored, and so are a pinned re-run's or swap-in's and its anchors; a run of
generated-kernel ops with a re-run in it is one kernel, holding what any of its ops allocates and
reads for the whole run; aot_eager stores every value, each op its own kernel."""

from dataclasses import replace

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.plan import Plan, Recompute, Swap, SwapIn
from memfit.model.schedule import lower, memory_profile

RESIDENT_BYTES = 3  # x and w


def _graph(ops: list[tuple[str, str, str, tuple[str, ...], int]], outputs: tuple[str, ...] = (),
           compiler: str = "inductor") -> CostGraph:
    """Ops as ``(name, kind, phase, inputs, bytes of the value it makes)`` over an input ``x``
    (1 B) and a parameter ``w`` (2 B)."""
    made = [Op(name, kind, phase, inputs=inputs, outputs=(name,), time_s=1e-6)
            for name, kind, phase, inputs, _ in ops]
    tensors = [Tensor("x", 1, "input"), Tensor("w", 2, "parameter")]
    tensors += [Tensor(name, size, "activation" if phase == "forward" else "gradient",
                       is_output=name in outputs) for name, _, phase, _, size in ops]
    return CostGraph.build(made, tensors, compiler=compiler)


def _peak(graph: CostGraph, plan: Plan | None = None) -> int:
    return memory_profile(lower(graph, plan or Plan("keep"))).peak_bytes


# a = x @ w; b = a + 1 (large); c = b * 2; d = c @ w; loss = sum(d)
CHAIN = [("a", "aten.mm", "forward", ("x", "w"), 100), ("b", "aten.add", "forward", ("a",), 800),
         ("c", "aten.mul", "forward", ("b",), 200), ("d", "aten.mm", "forward", ("c", "w"), 100),
         ("loss", "aten.sum", "forward", ("d",), 4)]


def test_a_pointwise_value_read_only_by_a_generated_kernel_is_never_stored():
    inductor, eager = _graph(CHAIN, ("loss",)), _graph(CHAIN, ("loss",), compiler="aot_eager")

    assert lower(inductor, Plan("keep")).inlined == {"b": ("a",)}  # c reads a instead
    assert lower(eager, Plan("keep")).inlined == {}
    assert _peak(eager) == RESIDENT_BYTES + 800 + 200  # b and c at c
    assert _peak(inductor) == RESIDENT_BYTES + 100 + 200  # a lives until c; c is stored: mm reads it


def test_a_value_read_by_several_kernels_is_stored_where_it_computes_an_exponential():
    ops = [*CHAIN[:2], ("c", "aten.mul", "forward", ("b",), 200),
           ("e", "aten.neg", "forward", ("b",), 200), ("f", "aten.add", "forward", ("c", "e"), 100),
           ("loss", "aten.sum", "forward", ("f",), 4)]
    assert "b" in lower(_graph(ops, ("loss",)), Plan("keep")).inlined
    exponential = [ops[0], ("b", "aten.exp", "forward", ("a",), 800), *ops[2:]]
    assert "b" not in lower(_graph(exponential, ("loss",)), Plan("keep")).inlined


# the same chain, then a backward that reads c (saved) and b's sibling
TRAINED = [*CHAIN[:3], ("d", "aten.mm", "forward", ("c", "w"), 100),
           ("loss", "aten.sum", "forward", ("d",), 4),
           ("g", "aten.mul", "backward", ("loss", "c"), 300),
           ("h", "aten.mul", "backward", ("g",), 50),
           ("dw", "aten.mm", "backward", ("h", "x"), 2)]


def test_a_saved_an_output_or_a_library_calls_input_is_stored():
    inlined = lower(_graph(TRAINED, ("loss", "dw")), Plan("keep")).inlined

    assert "b" in inlined and "g" in inlined  # g: read by h, a generated kernel of its pass
    assert "c" not in inlined  # saved for the backward, and read by mm
    assert "h" not in inlined and "loss" not in inlined  # a library call's input; an output


def test_a_pinned_rerun_or_swap_in_and_the_op_before_it_are_stored():
    graph = _graph(TRAINED, ("loss", "dw"))
    recomputing = Plan("recompute", {"c": Recompute()}, graph_hash=graph.structure_hash)
    swapping = Plan("swap", {"c": Swap((SwapIn("loss", ("g",)),))},
                    graph_hash=graph.structure_hash)

    recomputed, swapped = lower(graph, recomputing).inlined, lower(graph, swapping).inlined

    assert "b" not in recomputed  # the re-run of c reads it again, in the backward
    assert "b" in swapped  # made and read before the copy back
    assert "c#re0" not in recomputed  # pin_planned_order's control_deps make inductor store it
    assert recomputed["g"] == ("loss", "c#re0")  # read by h only, after the pinned re-run
    assert swapped["g"] == ("loss", "c#in0")
    assert _peak(graph, swapping) < _peak(replace(graph, compiler="aot_eager"), swapping)


# a = x @ w; b = relu(a), re-run in the backward from a; c = b @ w; loss = sum(c);
# gb = loss * b (b's re-run is its last reader); dw = gb @ x
RERUN = [("a", "aten.mm", "forward", ("x", "w"), 100), ("b", "aten.relu", "forward", ("a",), 300),
         ("c", "aten.mm", "forward", ("b", "w"), 10), ("loss", "aten.sum", "forward", ("c",), 4),
         ("gb", "aten.mul", "backward", ("loss", "b"), 300),
         ("dw", "aten.mm", "backward", ("gb", "x"), 2)]


def test_a_rerun_chain_is_one_kernel_with_the_generated_ops_around_it():
    inductor, eager = _graph(RERUN, ("loss", "dw")), _graph(RERUN, ("loss", "dw"), "aot_eager")
    plan = Plan("recompute", {"b": Recompute()}, graph_hash=inductor.structure_hash)

    schedule = lower(inductor, plan)
    rerun = next(i for i, action in enumerate(schedule.actions) if action.kind == "recompute")
    assert schedule.kernel_starts[rerun + 1] == rerun  # gb fuses with the re-run of b
    assert lower(inductor, Plan("keep")).kernel_starts == tuple(range(6))  # no re-run: one each
    assert lower(eager, plan).kernel_starts == ()
    assert _peak(eager, plan) == RESIDENT_BYTES + 4 + 300 + 300  # at gb: a died at the re-run
    assert _peak(inductor, plan) == RESIDENT_BYTES + 4 + 100 + 300 + 300  # a lives to gb's end


def test_a_graph_priced_for_a_compiler_says_which_and_keeps_it_through_json():
    from memfit.data.hardware import PROFILES
    from memfit.model.kernels import priced_for

    eager = _graph(CHAIN, ("loss",), compiler="aot_eager")
    inductor = priced_for(eager, PROFILES["cpu"], "inductor")

    assert inductor.compiler == "inductor" and eager.compiler == "aot_eager"
    assert priced_for(inductor, PROFILES["cpu"], "aot_eager").compiler == "aot_eager"
    assert CostGraph.from_json(inductor.to_json()).compiler == "inductor"
    assert inductor.with_times({}).compiler == "inductor"


def _with_edges(graph: CostGraph, *, except_reader: str = "") -> CostGraph:
    """``graph`` with each op's fx data edges to the ops it reads (``analyze`` records them),
    but ``except_reader``'s: it reads through a view."""
    ops = tuple(replace(op, depends_on=tuple(t for t in op.inputs if graph.tensors[t].producer))
                if op.name != except_reader else op for op in graph.ops)
    return replace(graph, ops=ops)


# a = x @ w; b = relu(a), same bytes, a read last by it; c = b @ w; loss = sum(c)
IN_PLACE = [("a", "aten.mm", "forward", ("x", "w"), 100), ("b", "aten.relu", "forward", ("a",), 100),
            ("c", "aten.mm", "forward", ("b", "w"), 10), ("loss", "aten.sum", "forward", ("c",), 4)]


def test_a_pointwise_kernel_writes_into_a_same_sized_buffer_it_reads_last():
    graph = _with_edges(_graph(IN_PLACE, ("loss",)))

    assert lower(graph, Plan("keep")).in_place == {"b": "a"}
    assert _peak(graph) == RESIDENT_BYTES + 100 + 10  # at c: b in a's storage, and c
    eager = replace(graph, compiler="aot_eager")
    assert lower(eager, Plan("keep")).in_place == {}
    assert _peak(eager) == RESIDENT_BYTES + 100 + 100  # at b: a and b


def test_no_write_in_place_through_a_view_at_other_indices_sizes_or_a_buffer_read_later():
    through_view = _with_edges(_graph(IN_PLACE, ("loss",)), except_reader="b")
    assert lower(through_view, Plan("keep")).in_place == {}
    resized = [IN_PLACE[0], ("b", "aten.relu", "forward", ("a",), 50), *IN_PLACE[2:]]
    assert lower(_with_edges(_graph(resized, ("loss",))), Plan("keep")).in_place == {}
    flipped = [IN_PLACE[0], ("b", "aten.flip", "forward", ("a",), 100), *IN_PLACE[2:]]
    assert lower(_with_edges(_graph(flipped, ("loss",))), Plan("keep")).in_place == {}
    # the backward reads a again: b is not its last reader, and the backward's module takes it
    # as an input (not donated under memfit's accounting), so its reader there writes elsewhere
    saved = [*IN_PLACE, ("ga", "aten.mul", "backward", ("loss", "a"), 100),
             ("dw", "aten.mm", "backward", ("ga", "x"), 2)]
    assert lower(_with_edges(_graph(saved, ("loss", "dw"))), Plan("keep")).in_place == {}


def test_a_buffer_written_over_in_place_lives_until_the_last_reader_of_its_new_value():
    # b = relu(a) in place; d = b + 1 in place into b; e = d @ w reads d last
    chain = [IN_PLACE[0], IN_PLACE[1], ("d", "aten.add", "forward", ("b",), 100),
             ("c", "aten.mm", "forward", ("d", "w"), 10), ("loss", "aten.sum", "forward", ("c",), 4)]
    graph = _with_edges(_graph(chain, ("loss",)))
    schedule = lower(graph, Plan("keep"))

    assert schedule.inlined == {"b": ("a",)} and schedule.in_place == {"d": "a"}
    profile = memory_profile(schedule)
    at_mm = next(i for i, action in enumerate(schedule.actions) if action.op == "c")
    assert profile.high_bytes[at_mm] == RESIDENT_BYTES + 100 + 10  # a's storage holds d
