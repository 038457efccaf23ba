"""pin_planned_order: the ordering-only dependencies that keep inductor from hoisting re-runs;
drop_host_waits and planned_order_kept: what else a planned module is compiled without.

Checked on a hand-built program (no inductor compile): which ops get a ``control_deps`` wrapper,
on which anchor, and that the pinned program still computes what it did.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

import memfit.ops.swap  # noqa: F401  (registers torch.ops.memfit.*)
from memfit.lowering.inductor import drop_host_waits, pin_planned_order, planned_order_kept

aten = torch.ops.aten


def program(kinds: dict[str, str], with_product: bool = False) -> fx.GraphModule:
    """``mm`` of the inputs, a re-run chain (``relu`` -> ``neg``) used with ``mm`` (and, with
    ``with_product``, then in an ``mm`` and a ``mul``), an op that does not read the chain, and
    a second re-run of ``relu``; ``kinds`` marks ops as memfit's."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    example = {x: torch.randn(4, 4), w: torch.randn(4, 4)}
    made: dict[str, fx.Node] = {}

    def call(name: str, target, *args) -> fx.Node:
        node = graph.call_function(target, args, name=name)
        values = [example[a] if isinstance(a, fx.Node) else a for a in args]
        example[node] = target(*values)
        node.meta["val"] = example[node]
        if name in kinds:
            node.meta["memfit"] = {"kind": kinds[name], "tensor": name, "buffer": name}
        made[name] = node
        return node

    product = call("mm", aten.mm.default, x, w)
    chain = call("rerun_relu", aten.relu.default, x)
    chain = call("rerun_neg", aten.neg.default, chain)
    used = call("use", aten.mul.Tensor, chain, product)
    if with_product:  # a reader of the chain that is not elementwise, then one that is
        used = call("use_mm", aten.mm.default, used, w)
        used = call("use_after", aten.mul.Tensor, used, 2.0)
    apart = call("apart", aten.add.Tensor, product, 1.0)
    again = call("rerun_relu_again", aten.relu.default, x)
    total = call("total", aten.add.Tensor, used, again)
    graph.output((total, apart))
    return fx.GraphModule(torch.nn.Module(), graph)


RERUNS = {"rerun_relu": "recompute", "rerun_neg": "recompute", "rerun_relu_again": "recompute"}


def pinned(module: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    from torch._inductor.fx_passes.control_dependencies import control_deps

    return {node.name: tuple(dep.name for dep in node.args[0])
            for node in module.graph.nodes if node.target is control_deps}


def test_each_rerun_chain_waits_for_the_last_reader_of_the_one_before():
    module = program(RERUNS)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    expected = module(x, w)

    assert pin_planned_order(module) == 2
    # the first chain after the op before it; the second after the op that used the first
    # chain ("use"), not after "apart", which reads no re-run and so may move anywhere
    assert pinned(module) == {"rerun_relu": ("mm",), "rerun_relu_again": ("use",)}
    for got, want in zip(module(x, w), expected, strict=True):
        assert torch.equal(got, want)


def test_a_swap_in_prefers_an_anchor_inductor_computes_as_a_buffer_anyway():
    kinds = {"rerun_relu": "recompute", "rerun_neg": "recompute", "rerun_relu_again": "swap_in"}
    module = program(kinds, with_product=True)
    inputs = (torch.randn(4, 4), torch.randn(4, 4))
    expected = module(*inputs)

    pin_planned_order(module)
    # "use_after" is later, but elementwise: inductor would fuse it, and anchoring on it would
    # make it a buffer of its own; a re-run chain waits for it all the same
    assert pinned(module) == {"rerun_relu": ("mm",), "rerun_relu_again": ("use_mm",)}
    reruns = program(RERUNS, with_product=True)
    pin_planned_order(reruns)
    assert pinned(reruns) == {"rerun_relu": ("mm",), "rerun_relu_again": ("use_after",)}
    for got, want in zip(module(*inputs), expected, strict=True):
        assert torch.equal(got, want)


def test_a_program_without_reruns_or_swap_ins_is_left_alone():
    module = program({})
    before = module.code

    assert pin_planned_order(module) == 0
    assert module.code == before


def builder(size: int) -> tuple[fx.Graph, dict, Callable[..., fx.Node]]:
    """A graph with inputs ``x`` and ``w`` (``size`` x ``size``), their example values, and a
    ``call(name, target, *args, kind=None)`` that adds an op with its value (``kind``: memfit's)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    values = {x: torch.randn(size, size), w: torch.randn(size, size)}

    def call(name: str, target, *args, kind: str | None = None) -> fx.Node:
        node = graph.call_function(target, args, name=name)
        values[node] = target(*[values.get(a, a) for a in args])
        node.meta["val"] = values[node]
        if kind:
            node.meta["memfit"] = {"kind": kind, "tensor": name, "buffer": name}
        return node

    return graph, values, call


def test_a_swap_in_after_prefetches_in_a_row_waits_for_a_reader_of_any_of_them():
    """vDNN brings several tensors back in a row, then a later one after the first is read:
    anchored on the swap-in before it (no op between reads it), the later one, and each after
    it, could run at the backward's start, where inductor put them (GPT-2: 183.7 MiB measured
    in the backward, 69.8 MiB planned); it waits for the op that read the first instead."""
    graph, values, call = builder(4)
    x, w = values  # the two inputs (the first keys)

    first = call("first_in", aten.clone.default, x, kind="swap_in")
    second = call("second_in", aten.clone.default, w, kind="swap_in")
    used = call("use_first", aten.mm.default, first, w)
    apart = call("apart", aten.mm.default, x, x)  # reads no swapped-in value
    third = call("third_in", aten.clone.default, x, kind="swap_in")
    total = call("total", aten.mm.default, used, second)
    graph.output((call("out", aten.add.Tensor, total, third), apart))
    module = fx.GraphModule(torch.nn.Module(), graph)
    expected = module(values[x], values[w])

    assert pin_planned_order(module) == 2  # the first has no op before it
    assert pinned(module) == {"second_in": ("first_in",), "third_in": ("use_first",)}
    for got, want in zip(module(values[x], values[w]), expected, strict=True):
        assert torch.equal(got, want)


def test_a_rerun_chain_also_waits_for_an_unread_op_that_frees_a_large_tensor():
    """The op before a chain may be a small reduction while a large elementwise op before it is
    read only after the chain: anchored on the last op only, inductor fused that op into the
    chain's kernels after the chain's first one, and what it frees stayed alive across the
    re-run (a 3-block CNN: 6.77 MB measured against 5.72 MB predicted). The chain also waits for
    each unread op that frees a tensor as large as the chain's first value; an unread op that
    frees only a small one (``scaled``) stays free to fuse where inductor likes."""
    graph, values, call = builder(64)
    x, w = values  # the two inputs (the first keys)

    first = call("rerun_first", aten.relu.default, x, kind="recompute")
    total = call("total", aten.sum.default, first)
    gradient = call("gradient", aten.mul.Tensor, first, x)  # the last reader of a 16 KiB value
    scaled = call("scaled", aten.mul.Tensor, total, 3.0)
    halved = call("halved", aten.mul.Tensor, total, 0.5)  # the last reader of a scalar
    second = call("rerun_second", aten.relu.default, w, kind="recompute")
    graph.output((call("out", aten.add.Tensor, second, gradient), scaled, halved))
    module = fx.GraphModule(torch.nn.Module(), graph)
    expected = module(values[x], values[w])

    assert pin_planned_order(module) == 1  # the first chain has no op before it
    assert pinned(module) == {"rerun_second": ("gradient", "halved")}
    for got, want in zip(module(values[x], values[w]), expected, strict=True):
        assert torch.equal(got, want)


def test_a_swap_in_takes_the_strides_of_the_host_copy_it_reads():
    # the traced swap-in has the graph's (contiguous) strides; the forward's host copy arrives
    # channels last: inductor would copy the swapped-in value into the traced strides
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.lowering.inductor import swap_ins_in_host_layout

    graph = fx.Graph()
    host = graph.placeholder("host")
    swap_in = graph.call_function(aten.clone.default, (host,), name="swap_in")
    swap_in.meta["memfit"] = {"kind": "swap_in", "tensor": "y", "buffer": "y#in0"}
    graph.output((swap_in,))
    module = fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode() as mode:
        host.meta["val"] = traced = torch.empty(2, 8, 4, 4)
        swap_in.meta["val"] = torch.empty(2, 8, 4, 4)
    arriving = torch.empty(2, 8, 4, 4).to(memory_format=torch.channels_last)

    assert swap_ins_in_host_layout(module, [arriving]) == 1
    assert swap_in.meta["val"].stride() == arriving.stride() != traced.stride()
    assert swap_in.meta["val"].fake_mode is mode
    assert swap_ins_in_host_layout(module, [arriving]) == 0  # already so


def test_a_swap_in_the_forward_made_is_a_placeholder_of_the_backward_and_is_left_as_it_is():
    # a swap-in planned right after the forward's last op (a prefetch) runs in the forward
    # module; the backward takes its value as a placeholder that keeps its meta: this raised
    # IndexError on the placeholder's empty args (Llama, output_hidden_states=True, inductor)
    from memfit.lowering.inductor import swap_ins_in_host_layout

    graph = fx.Graph()
    arrived = graph.placeholder("memfit_swap_in")
    arrived.meta["memfit"] = {"kind": "swap_in", "tensor": "y", "buffer": "y#in0"}
    graph.output((graph.call_function(aten.neg.default, (arrived,)),))
    module = fx.GraphModule(torch.nn.Module(), graph)
    assert swap_ins_in_host_layout(module, [torch.empty(())]) == 0


def test_waits_are_dropped_where_a_swap_in_copies_synchronously():
    """On the CPU a ``memfit::wait`` does nothing but read the copy; inductor placed the waits
    of a BERT layer's swapped-in attention values after a kernel that fused a bias gradient's
    sum with the next layer norm's backward, which pulled the copies' readers ahead of them, and
    so held each copy past its last reader (0.63 MiB over the plan's peak). Without the waits
    the copies are freed after their readers, as the plan prices them."""
    graph, values, call = builder(4)
    x, w = values  # the two inputs (the first keys)

    copy = call("copy_in", aten.clone.default, x, kind="swap_in")
    wait = graph.call_function(torch.ops.memfit.wait.default, (copy, 0), name="wait")
    wait.meta["memfit"] = {"kind": "wait", "tensor": "copy_in", "buffer": "copy_in"}
    graph.output((call("use", aten.mm.default, copy, w),))
    module = fx.GraphModule(torch.nn.Module(), graph)

    assert drop_host_waits(module) == 1
    assert [node.name for node in module.graph.nodes if node.op == "call_function"] == [
        "copy_in", "use"]
    assert torch.equal(module(values[x], values[w])[0], values[x] @ values[w])
    assert drop_host_waits(module) == 0


def test_a_planned_module_compiles_without_inductor_reusing_freed_buffers():
    """Inductor's wrapper keeps a freed buffer alive until it allocates the next one of the same
    size; a plan's swap-ins allocate their own, so freed buffers waited across its peak (a swap
    plan's backward: a 1 MiB score gradient and six 256 KiB ones). A module that swaps is
    compiled without that reuse, each buffer freed after its last reader as the model prices it;
    one that only re-runs keeps it, and a module memfit inserted nothing into compiles as
    ``torch.compile`` compiles it."""
    from torch._inductor import config as inductor_config

    default = inductor_config.allow_buffer_reuse
    with planned_order_kept(program({"rerun_relu": "swap_in"})):
        assert not inductor_config.allow_buffer_reuse
        assert not inductor_config.reorder_for_peak_memory
        assert inductor_config.inplace_buffers  # a kernel writing into an input it reads last
    with planned_order_kept(program(RERUNS)):  # re-runs only: their peaks are priced with it
        assert inductor_config.allow_buffer_reuse == default
        assert not inductor_config.reorder_for_peak_memory
    with planned_order_kept(program({})):
        assert inductor_config.allow_buffer_reuse == default
