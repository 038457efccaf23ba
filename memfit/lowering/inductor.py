"""``compiler="inductor"``: inductor compiles the region, memfit is its partitioner.

``torch._inductor.compile_fx.compile_fx`` runs the region through inductor's own pipeline
(decompositions, AOTAutograd, the joint-graph passes) and then asks a partitioner to split the
joint graph; ``config.custom_partitioner_fn`` replaces its min-cut partitioner with memfit's
planner (``Backend.plan_region``). So memfit plans the decomposed joint graph, the one inductor
compiles, and inductor lowers and fuses the planned forward and backward modules as it would
its own. memfit's ops (swap-outs, swap-ins, waits, random-state saves and replays) become
inductor fallback kernels: calls into their Python implementations between the fused kernels.

Note:
    The swap ops find their copy engine through ``active_engine``; inductor's modules run
    inside AOTAutograd (the backward during ``loss.backward()``, outside the forward's call), so
    each compiled module is wrapped (``inner_compile``) to make the region's engine current
    while it runs, as ``aot_eager``'s runner does. AOTAutograd's cache is off for the compile:
    a cached region would skip the partitioner and ``inner_compile`` (no region planned,
    registered or measured, no engine made current), and a plan depends on the budget and on
    the bytes resident outside the region, not on the graph alone (the partitioner's ``uuid``
    is ``None`` for the same reason). Inductor's FX graph cache still caches the planned
    modules, whose code includes every memfit op and ordering pin (``_module_config``), so a
    second process plans (from memfit's plan cache) and traces, but compiles no kernel.

    Inductor's scheduler orders kernels by data dependencies only, and fuses kernels that share no
    data if their loops match (horizontal fusion). A re-run reads only saved values and parameters,
    so nothing keeps it where the plan put it: inductor may fuse a second re-run of a block with the
    first (the same ops over the same inputs), which hoists every later re-run chain to the start of
    the backward, all alive at once. ``pin_planned_order`` gives each re-run chain and each swap-in
    an ordering-only dependency (inductor's ``control_deps``) on the op that last consumed what the
    previous pinned op made, so pinned ops keep their planned order and a chain starts only once the
    one before it has been used; inductor still fuses within and around them. Readers of a
    swapped-in tensor are not ordered after its ``memfit::wait`` (a no-op on the CPU): that
    dependency, given the same way, raises the peak and moves the parameters away from
    ``torch.compile``'s (other kernels, other roundings), so ``memfit.backend`` warns for inductor
    on an accelerator instead; on the CPU the waits are left out (``drop_host_waits``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from memfit.runtime.streams import CopyEngine, active_engine
from memfit.tracing.analyze import inserted_kind

# the backend's run of one compiled module: (module, inductor's compiled callable, is_backward)
Wrap = Callable[[fx.GraphModule, Callable[[list], Any], bool], Any]


class _Planner(CustomPartitionerFn):
    """Inductor's partitioner hook calling memfit's (``partition``: a ``Backend``'s)."""

    def __init__(self, partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]]) -> None:
        self.partition = partition

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any | None:
        return None  # a plan is not a function of the graph: never reuse a cached partition

    def __getstate__(self) -> dict[str, Any]:
        """What inductor's FX-graph cache key holds of the config's partitioner: nothing. The
        key is for a module already partitioned, whose code has every op memfit inserted."""
        return {}


def compile_with_inductor(graph_module: fx.GraphModule, example_inputs: list,
                          partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
                          engine: CopyEngine, wrap: Wrap | None = None) -> Any:
    """The region compiled by inductor with ``partition`` as its partitioner and ``engine``
    current while its modules run; ``wrap(module, compiled, is_backward)``, where given, makes
    each compiled module's run instead (the backend's: measured runs, its region's bookkeeping),
    and must make ``engine`` current itself."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    with inductor_config.patch(custom_partitioner_fn=_Planner(partition), **_module_config()), \
            functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(graph_module, example_inputs,
                          inner_compile=_with_engine(engine, wrap))


def _module_config() -> dict[str, Any]:
    """Inductor's settings for each of memfit's planned modules, set where the region is compiled
    and again where each module is (AOTAutograd compiles the backward at the first
    ``loss.backward()``, after ``compile_fx`` returned and its settings were undone).

    ``fallback_random``: inductor would otherwise draw random numbers from seeds it takes at the
    start of each module, which a re-run's replay of the forward's generator state cannot reach;
    eager's random kernels draw from the generator memfit saves and restores.

    ``control_deps`` marked cacheable: inductor bypasses its FX graph cache for a module with any
    higher-order operator not so marked, which every module ``pin_planned_order`` pinned has. Its
    node holds nothing outside the module: the dependencies are arguments, the op it orders is a
    ``GraphModule`` attribute whose code the cache key includes (the key pickles each
    submodule's code), so a hit loads the kernels of the same pinned module, in the pinned order.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.control_dependencies import control_deps

    name = f"{control_deps.__module__}.{control_deps.__name__}"
    return {"fallback_random": True, "unsafe_marked_cacheable_functions": {
        **inductor_config.unsafe_marked_cacheable_functions, name: torch.__version__}}


def _with_engine(engine: CopyEngine, wrap: Wrap | None = None) -> Callable[..., Any]:
    """Inductor's ``compile_fx_inner``, its compiled module run with ``engine`` current (or as
    ``wrap`` runs it)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    def inner_compile(module: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
                      ) -> Any:
        if not kwargs.get("is_backward", False):
            host_copies_in_saved_layout(module)
        else:
            swap_ins_in_host_layout(module, example_inputs)
        if not engine.is_accelerator:
            drop_host_waits(module)
        pin_planned_order(module)
        with inductor_config.patch(_module_config()), planned_order_kept(module):
            compiled = compile_fx_inner(module, example_inputs, **kwargs)
        if wrap is not None:
            return wrap(module, compiled, bool(kwargs.get("is_backward", False)))

        def run(args: list) -> Any:
            with active_engine(engine):
                return compiled(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return inner_compile


def planned_order_kept(module: fx.GraphModule) -> contextlib.AbstractContextManager:
    """Inductor's own reordering for peak memory off while it compiles a ``module`` that has any
    op memfit inserted (a plan that is not ``keep``), and its reuse of freed buffers off where
    those are copies (a plan that swaps); a module without them compiles as ``torch.compile``
    compiles it.

    The plan's order is the one its peak was simulated in. Inductor's reordering
    (``config.reorder_for_peak_memory``) estimates memory without knowing memfit's ops: it
    moved every ``memfit::wait`` (which returns nothing and reads the swapped-in tensor) after
    the backward's last kernel, so each swapped-in tensor lived to the backward's end. It moves
    no kernel into or out of a fusion, so turning it off changes the order, not the kernels.

    The memory model frees a buffer after its last reader. Inductor's wrapper instead keeps a
    freed buffer for the next one it allocates of the same size (``config.allow_buffer_reuse``),
    alive until then. A plan's swap-ins and re-runs allocate buffers of their own, or later than
    the unplanned step does, so freed buffers waited longer, several at once across the peak (a
    swap plan's backward held a freed attention-score gradient and the gradients of a layer's
    inputs while the next layer's copies came in). Without that reuse each buffer is freed at
    its last reader, as the model prices it; an in-place reuse (a kernel that writes into an
    input it reads last, ``config.inplace_buffers``) stays, and no kernel changes. A module that
    only re-runs keeps the reuse: its re-runs' buffers are the sizes the backward frees, its
    peaks are priced with it (``memfit.model.inlining``), and without it a recomputing GPT-2
    plan ran slower.
    """
    kinds = {inserted_kind(node) for node in module.graph.nodes} - {None}
    if not kinds:
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config

    swaps = bool(kinds & {"swap_out", "swap_in", "wait"})
    return inductor_config.patch(reorder_for_peak_memory=False,
                                 **({"allow_buffer_reuse": False} if swaps else {}))


def drop_host_waits(module: fx.GraphModule) -> int:
    """Remove each ``memfit::wait`` from a ``module`` that runs on the CPU; returns how many.

    On the CPU a swap-in copies synchronously and a wait does nothing (there is no copy stream),
    but under inductor it still reads the copy: a kernel with no output that inductor's scheduler
    places where its fusions leave it, after the copy's readers where a fused kernel pulled them
    ahead of it (a bias gradient's sum fused with a later layer norm's backward), holding the
    copy until then. The model frees a copy after its last reader, and the wait is not one.
    """
    waits = [node for node in module.graph.nodes if inserted_kind(node) == "wait"]
    for node in waits:
        module.graph.erase_node(node)
    if waits:
        module.recompile()
    return len(waits)


def layout_copy_bytes(joint: fx.GraphModule) -> int:
    """The bytes of the channels-last copies inductor makes of a region's inputs (parameters,
    the batch) that its convolutions read, where its layout optimization is on for ``joint``
    (decided on the joint graph, as inductor decides it for each module).

    A graph input keeps its layout, so inductor converts each 4-D one a convolution reads
    (``require_channels_last``) in the forward, and saves the copy, not the input, where the
    backward's ``convolution_backward`` reads it: the copies live from the forward's start to
    the backward and are no node of the planned graph. The planner counts them beside the
    region (``outside_bytes``); intermediate values are laid out channels last where they are
    made, with no copy.
    """
    from torch._inductor.graph import GraphLowering

    if not GraphLowering.decide_layout_opt(joint, is_inference=False):
        return 0
    copied: dict[fx.Node, int] = {}
    for convolution in joint.graph.find_nodes(op="call_function",
                                              target=torch.ops.aten.convolution.default):
        for source in convolution.args[:2]:
            value = source.meta.get("val") if isinstance(source, fx.Node) else None
            if (source.op == "placeholder" and isinstance(value, torch.Tensor)
                    and value.dim() == 4 and isinstance(value.numel(), int) and _dense(value)
                    and not value.is_contiguous(memory_format=torch.channels_last)):
                copied[source] = value.numel() * value.element_size()
    return sum(copied.values())


def host_copies_in_saved_layout(module: fx.GraphModule) -> int:
    """Give each swap-out of a forward ``module`` the strides inductor requires of it as a saved
    value, so that the host copy is the value the backward reads and no device copy is made.

    Inductor requires each forward output to have the graph's strides, except where its layout
    optimization prefers channels last for a 4-D value downstream of a convolution (then those):
    a host copy in any other layout is copied again, on the device, and that copy is what the
    backward reads, so the swap frees nothing. ``memfit::swap_out`` converts the layout while it
    copies, to the ``stride`` argument this sets. Returns the number of swap-outs whose layout
    changed from the graph's.
    """
    from torch._inductor.graph import GraphLowering

    swap_outs = [node for node in module.graph.nodes if inserted_kind(node) == "swap_out"]
    channels_last: Any = ()
    if swap_outs and GraphLowering.decide_layout_opt(module, is_inference=False):
        channels_last = GraphLowering.find_nodes_prefer_channels_last(  # type: ignore[arg-type]
            SimpleNamespace(module=module))
    changed = 0
    for node in swap_outs:
        value = node.meta["val"]
        if node not in channels_last or value.dim() != 4 or not _dense(value):
            continue
        stride = torch._prims_common.make_channels_last_strides_for(value.shape)
        if [_expression(step) for step in stride] == [_expression(step) for step in
                                                      value.stride()]:
            continue
        replaced = [step for step in node.args[2] or () if isinstance(step, fx.Node)]
        with module.graph.inserting_before(node):
            node.args = (*node.args[:2], _channels_last_arguments(module.graph, node.args[0]))
        for step in replaced:
            if not step.users:
                module.graph.erase_node(step)
        with value.fake_mode:
            node.meta["val"] = torch.empty_strided(value.shape, stride, dtype=value.dtype,
                                                   device=value.device)
        changed += 1
    if changed:
        module.recompile()
    return changed


def swap_ins_in_host_layout(module: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Give each swap-in of a backward ``module`` the strides of the host copy it reads
    (``example_inputs``: the forward's outputs as they are), as ``memfit::swap_in`` returns them.
    The traced value has the graph's strides; where the host copy is laid out otherwise
    (``host_copies_in_saved_layout``: channels last), inductor copies the swapped-in value into
    the traced strides, on the device, where ``pin_planned_order`` wraps the swap-in: a second
    device copy of the value. Returns the number of swap-ins whose strides changed."""
    arriving = dict(zip(module.graph.find_nodes(op="placeholder"), example_inputs, strict=False))
    changed = 0
    for node in module.graph.nodes:
        if (inserted_kind(node) != "swap_in" or node.op != "call_function"  # not a placeholder
                or not node.args or not isinstance(node.args[0], fx.Node)):  # with its meta
            continue
        value, host = node.meta.get("val"), arriving.get(node.args[0])
        if not isinstance(value, torch.Tensor) or not isinstance(host, torch.Tensor) \
                or value.stride() == host.stride() or value.shape != host.shape:
            continue
        with value.fake_mode:
            node.meta["val"] = torch.empty_strided(value.shape, host.stride(), dtype=value.dtype,
                                                   device=value.device)
        changed += 1
    return changed


def _channels_last_arguments(graph: fx.Graph, source: fx.Node) -> list:
    """The channels-last strides of 4-D ``source`` as op arguments, as
    ``make_channels_last_strides_for`` computes them: a static one an int, a symbolic one nodes
    that multiply ``source``'s sizes where it runs (a graph holds no symbolic size as a constant:
    torch warns, and a compiler specializes it)."""
    strides: list = [0, 1, 0, 0]
    multiplier: int | fx.Node = 1
    for inner, dim in ((1, 3), (3, 2), (2, 0)):  # channels, then width, then height innermost
        size = source.meta["val"].shape[inner]
        if isinstance(size, torch.SymInt):
            size = _symbolic(graph, torch.ops.aten.sym_size.int, (source, inner), size)
        if isinstance(size, fx.Node) or isinstance(multiplier, fx.Node):
            value = _value(multiplier) * _value(size)
            multiplier = _symbolic(graph, operator.mul, (multiplier, size), value)
        else:
            multiplier = multiplier * size
        strides[dim] = multiplier
    return strides


def _symbolic(graph: fx.Graph, target: Any, args: tuple, value: Any) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = value
    return node


def _value(step: int | fx.Node) -> Any:
    return step.meta["val"] if isinstance(step, fx.Node) else step


def _expression(step: Any) -> Any:
    """A stride as a sympy expression: symbolic ones compared without a guard."""
    import sympy

    return step.node.expr if isinstance(step, torch.SymInt) else sympy.Integer(step)


def _dense(value: torch.Tensor) -> bool:
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(value))


PINNED_KINDS = ("recompute", "swap_in")  # memfit ops whose inputs exist long before the plan runs them


def pin_planned_order(module: fx.GraphModule) -> int:
    """Make inductor run each re-run chain and swap-in of ``module`` no earlier than planned.

    The first op of a re-run chain (a re-run that reads no other re-run) and each swap-in is
    *pinned*: it gets an ordering-only dependency on its *anchors*. Of the ops since the previous
    pinned op that read, directly or through others, what any pinned op made (before the first
    pinned op: every op before it), a swap-in's anchor is the last one, or the last that is not
    elementwise where there is one; a re-run chain's are the last one and each one no later one
    of them read that is, or follows from, the last reader of a tensor at least as large as the
    chain's first value (where there is none, the previous pinned op). Each pinned op thus runs
    no earlier than planned, after ops that themselves wait for earlier pinned ones. A re-run
    chain waits for those too, not the last op only: the last may be a per-channel reduction,
    and inductor would fuse the large elementwise op before it (a batch norm's input gradient)
    with the chain's own elementwise ops, after the chain's convolution, keeping the gradient's
    inputs alive across the re-run. Unread ops that free only small tensors are no anchors:
    each anchor becomes a buffer inductor would otherwise fuse away.
    Returns the number of ops pinned; a module without re-runs or swap-ins (``keep``) is left as
    it is, so it compiles to exactly ``torch.compile``'s kernels.
    The memory model applies the same rule to a plan's actions
    (``memfit.model.inlining.pinned_and_anchors``): inductor stores every pinned op and anchor,
    so a change here is a change there.

    Anchors read what *any* pinned op made, not only the previous one: vDNN's plans bring
    several tensors back in a row, and anchoring each swap-in on the one before it (unread yet)
    would chain them all to the start of the backward, every copy alive at once.

    Note:
        The anchor must be a tensor that inductor can realize (``control_deps`` lowers it to a
        buffer): not a view, not a ``getitem``. An elementwise anchor becomes a buffer where
        inductor would have fused it into its readers, so a swap-in is anchored on the last reader
        that is not elementwise, a buffer anyway. A re-run chain waits for the last reader and the
        unread ones that free a large tensor: a re-run's elementwise ops are what inductor fuses
        across chains.
    """
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    dependencies: dict[fx.Node, OrderedSet[fx.Node]] = {}
    # the last candidate anchors: any, and one inductor makes a buffer of anyway (a library
    # call, a reduction, memfit's ops), not an elementwise op it may fuse away
    latest: fx.Node | None = None
    realized: fx.Node | None = None
    # since the previous pinned op: the ordered ops no anchorable op read yet (a re-run
    # chain waits for those that free a large tensor)
    frontier: dict[fx.Node, None] = {}
    frees = _frees_bytes(module)  # op -> the largest tensor it, or an unread op it reads, frees
    ordered: set[fx.Node] = set()  # pinned ops and the ops that read them, directly or not
    previous: fx.Node | None = None  # the last pinned op where it can anchor, else its anchor
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if _starts_pinned_work(node):
            if inserted_kind(node) == "swap_in":
                anchors = [anchor] if (anchor := realized or latest or previous) else []
            else:
                least = _bytes_of(node)
                anchors = [n for n in frontier if n is latest or frees.get(n, 0) >= least]
                anchors = anchors or ([previous] if previous is not None else [])
            if anchors:
                dependencies[node] = OrderedSet(anchors)
            previous = node if _can_anchor(node) else (anchors[-1] if anchors else previous)
            ordered.add(node)
            latest, realized, frontier = None, None, {}
        elif ordered and not ordered.intersection(node.all_input_nodes):
            continue
        elif ordered:
            ordered.add(node)
        if _can_anchor(node):
            latest = node
            realized = realized if _is_elementwise(node) else node
            for source in node.all_input_nodes:
                if source in frontier:
                    del frontier[source]
                    frees[node] = max(frees.get(node, 0), frees.get(source, 0))
            frontier[node] = None
    if dependencies:
        preserve_node_ordering(module.graph, dependencies)
        module.recompile()
    return len(dependencies)


def _frees_bytes(module: fx.GraphModule) -> dict[fx.Node, int]:
    """Each op that is the last reader of a tensor, and the largest such tensor's bytes."""
    freed: dict[fx.Node, int] = {}
    position = {node: index for index, node in enumerate(module.graph.nodes)}
    for node in module.graph.nodes:
        if node.users and isinstance(node.meta.get("val"), torch.Tensor):
            last = max(node.users, key=position.__getitem__)
            freed[last] = max(freed.get(last, 0), _bytes_of(node))
    return freed


def _bytes_of(node: fx.Node) -> int:
    """The bytes of ``node``'s tensor value (0 for another value), a symbolic size at the size
    it was traced with: the memory model, which applies the same rule
    (``memfit.model.inlining.pinned_and_anchors``), reads sizes, not symbols."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    return optimization_hint(value.numel(), fallback=0) * value.element_size()


def _starts_pinned_work(node: fx.Node) -> bool:
    """A swap-in, or a re-run that reads no other re-run or swap-in (its chain's first op)."""
    return inserted_kind(node) in PINNED_KINDS and not any(
        inserted_kind(source) in (*PINNED_KINDS, "view_replay") for source in node.all_input_nodes)


def _can_anchor(node: fx.Node) -> bool:
    if node.target is operator.getitem or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _is_elementwise(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
