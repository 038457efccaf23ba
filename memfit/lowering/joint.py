"""The joint graph AOTAutograd hands a partitioner, as memfit's ``Captured``, and back as two.

Under ``torch.compile``, Dynamo captures the user's region with guards and AOTAutograd traces its
forward and backward into one *joint* graph (fake tensors only) and asks a partitioner to split it
into the forward module (which returns the user's outputs and the values saved for backward)
and the backward module. memfit is that partitioner:

1. ``as_captured``: the joint graph as the ``Captured`` that ``analyze`` reads (primals that
   AOTAutograd calls static-lifetime are parameters or buffers, the rest inputs; tangents seed
   the backward);
2. ``analyze`` → plan → ``rewrite`` (the same passes as ever) give the rewritten joint program;
3. ``split``: that program cut at the forward/backward boundary. Every node before the first
   backward node goes to the forward module, every node after it to the backward module (swap-ins,
   waits and re-runs included, exactly where the plan put them), and the values the backward reads
   from the forward are what the forward saves: kept activations, host copies, checkpoints and
   random states.

Note:
    ``split`` delegates the bookkeeping of saved values (their order, symbolic sizes, version
    counter classes) to AOTAutograd's own ``_extract_fwd_bwd_modules``, and pins each node to its
    side with the partitioner tags that function honours (``must_be_in_forward`` /
    ``must_be_in_backward``), so nothing is moved or recomputed behind the plan's back.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
from torch._functorch.partitioners import _extract_fwd_bwd_modules
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.utils._ordered_set import OrderedSet

from memfit.data.errors import CaptureError
from memfit.tracing.analyze import inserted_kind, storage_key, tensors_in
from memfit.tracing.capture import SCOPE_KEY, TYPE_KEY, Binding, Captured, refuse_sparse_values

_FORWARD, _BACKWARD = "must_be_in_forward", "must_be_in_backward"


def record_scopes(joint: fx.GraphModule, prefix: str = "") -> None:
    """Give each node the module path and class that made it (``memfit_scope`` / ``memfit_type``
    in ``meta["custom"]``, as ``capture`` records them), from Dynamo's module stack.

    Forward nodes carry ``nn_module_stack``; AOTAutograd copies it to the backward nodes derived
    from them as ``fwd_nn_module_stack``. Paths are the user's (``transformer.h.0.attn``): Dynamo's
    ``L['self']`` and ``prefix`` (the attribute a wrapper holds the model in) are dropped. The
    scopes are what module-path parameters (``checkpoints=["transformer.h.*"]``, TFLMS scopes)
    and the vDNN strategies' layer types match.
    """
    for node in joint.graph.nodes:
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
        custom = node.meta.setdefault("custom", {})
        if not stack or SCOPE_KEY in custom:
            continue
        path, module_type = list(stack.values())[-1]
        custom[SCOPE_KEY] = module_path(path, prefix)
        custom[TYPE_KEY] = getattr(module_type, "__name__", str(module_type))


def tag_phases(joint: fx.GraphModule) -> int:
    """Give each node of ``joint`` without a phase tag (``partitioner_tag``) the phase torch's own
    partitioner finds for it: backward where it reads a tangent or a backward node, forward
    otherwise; returns how many were tagged.

    AOTAutograd tags the nodes it traces, but its passes after the trace add nodes untagged: a
    Python float argument that changed between calls becomes a 0-dim tensor input, and its
    ``mul`` by the output's gradient is a new node (``tensorify_python_scalars``). Untagged, such a
    node would be priced as a backward op wherever it stands and cut into the forward module
    ahead of the first tagged backward node, reading a tangent the forward does not have.
    """
    backward: set[fx.Node] = set()
    tagged = 0
    for node in joint.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        if node.op != "call_function":
            continue
        if node.meta.get("partitioner_tag") is None:
            reads_backward = any(source in backward for source in node.all_input_nodes)
            node.meta["partitioner_tag"] = "is_backward" if reads_backward else "is_forward"
            tagged += 1
        if node.meta["partitioner_tag"] == "is_backward":
            backward.add(node)
    return tagged


def module_path(dynamo_path: str, prefix: str = "") -> str:
    """``L['self'].model.transformer.h[0]`` -> ``transformer.h.0`` (with ``prefix="model."``)."""
    path = re.sub(r"\[\s*'?([^\]']*)'?\s*\]", r".\1", dynamo_path)  # h[0] -> h.0
    path = re.sub(r"^L\.self\.?", "", path)
    if prefix and (path + ".").startswith(prefix):
        return path[len(prefix):]
    return path


def as_captured(joint: fx.GraphModule, num_fwd_outputs: int,
                static_lifetime_input_indices: list[int] | None) -> Captured:
    """The joint graph with a binding per placeholder and output.

    Raises:
        CaptureError: for an input that is not a tensor with a size (a symbolic int: its
            tensors' symbolic sizes are priced at a bound, ``memfit.tracing.shapes``), and for a
            sparse tensor (``refuse_sparse_values``).
    """
    refuse_sparse_values(joint.graph)
    _mutations_in_forward(joint.graph)
    static = set(static_lifetime_input_indices or ())
    inputs = []
    for position, node in enumerate(joint.graph.find_nodes(op="placeholder")):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            if isinstance(value, torch.SymInt):
                inputs.append(Binding("size", index=position))
                continue
            raise CaptureError(
                f"the compiled region has an input that is not a tensor ({node.name}: "
                f"{value!r}); compile it with dynamic=False")
        if node.name.startswith("tangents"):
            inputs.append(Binding("tangent"))
        elif position in static:
            inputs.append(Binding("parameter", node.name))
        else:
            inputs.append(Binding("input", index=position))
    output = joint.graph.find_nodes(op="output")[0]
    count = len(output.args[0])
    outputs = tuple(Binding("loss", index=i) if i < num_fwd_outputs else Binding("gradient")
                    for i in range(count))
    return Captured(joint, tuple(inputs), outputs)


def _mutations_in_forward(graph: fx.Graph) -> None:
    """Move each input mutation the forward pass makes (BatchNorm's running statistics) to
    right after what it reads, as forward nodes.

    AOTAutograd traces these ``copy_`` nodes at the end of the joint graph, after the backward;
    eager makes them in the forward, so a forward without a backward (or code reading the buffer
    before ``backward()``) sees the update. Moved, they are planned, rewritten and split as the
    forward nodes they are, and nothing is kept alive for them until the end of the step.
    """
    order = {node: position for position, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.aten.copy_.default):
            continue
        sources = node.all_input_nodes
        if not sources or sources[0].op != "placeholder" or any(
                source.name.startswith("tangents")
                or (source.op != "placeholder" and source.meta.get("partitioner_tag") != "is_forward")
                for source in sources):
            continue
        last = max(sources, key=order.__getitem__)
        if last.op == "placeholder":
            continue
        last.append(node)
        node.meta["partitioner_tag"] = "is_forward"
        order = {n: position for position, n in enumerate(graph.nodes)}


def elide_clones(joint: fx.GraphModule) -> int:
    """Read each redundant ``aten.clone`` of the joint graph's source instead; returns how many.

    Decompositions add copies that eager does not make: ``dropout`` with ``p=0`` (or in eval)
    decomposes to ``input.clone()`` where eager returns the input itself, so a transformer with
    zero dropout would keep each attention probability and hidden state twice, above eager's
    peak. The joint graph is functional, so a clone whose readers only
    read it is its source: it is elided unless it changes strides, feeds an output (outputs must
    not alias what they did not alias when traced), feeds an op that mutates, or copies a
    storage that some op mutates (an input updated in place, as BatchNorm's running statistics).
    """
    mutated = {_storage(node.args[0]) for node in joint.graph.nodes if _mutates(node)}
    elided = set()
    for node in list(joint.graph.nodes):
        if node.target is not torch.ops.aten.clone.default or not _same_layout(node):
            continue
        source = node.args[0]
        if (_storage(source) in mutated
                or any(user.op == "output" or _mutates(user) for user in node.users)):
            continue
        elided.add(_storage(node))
        node.replace_all_uses_with(source)
        joint.graph.erase_node(node)
    if elided:
        realias_views(joint)
        joint.recompile()
    return len(elided)


def drop_unread_running_statistics(joint: fx.GraphModule) -> int:
    """Pass ``None`` for the running statistics a training-mode batch norm backward never reads;
    returns how many backward nodes changed.

    AOTAutograd's functional batch norm writes the updated running mean and variance into fresh
    tensors, copies them into the buffers, and hands those tensors to
    ``native_batch_norm_backward``, which with ``train=True`` normalizes by the saved mean and
    inverse standard deviation and never reads them. Saved for the backward, they are two
    per-channel tensors per layer eager does not hold (eager saves the buffers themselves).
    Without readers after the forward's ``copy_``
    they die there, as in eager.
    """
    changed = 0
    for node in joint.graph.find_nodes(
            op="call_function", target=torch.ops.aten.native_batch_norm_backward.default):
        if len(node.args) < 8 or node.args[7] is not True or node.args[3:5] == (None, None):
            continue  # eval mode reads the running statistics
        node.args = (*node.args[:3], None, None, *node.args[5:])
        changed += 1
    if changed:
        joint.recompile()
    return changed


def realias_views(joint: fx.GraphModule) -> int:
    """Re-derive the fake value of every view that does not lie in its base's storage, so that
    it does, as it will when it runs; returns how many values changed.

    ``analyze`` and ``rewrite`` tell storages apart by the fake values' storages, so each view
    (an op whose schema returns an alias of its input: ``view``, ``t``, ``split``...) must share
    its base's, and each ``getitem`` must hold its tuple's element. A pass that erases a copy and
    has its readers read the source (memfit's ``elide_clones``; inductor's ``remove_noop_ops``
    among its joint-graph passes, for a ``clone`` or a no-op ``convert_element_type``) leaves the
    copy's views on the erased copy's storage: taken for a fresh allocation, such a view is
    counted twice, and refused by ``rewrite`` as a reader that is not a view when its source is
    swapped or recomputed. Values are re-derived in program order, so a view of a re-derived
    view is re-derived after it.
    """
    from torch._guards import detect_fake_mode

    stale = [node for node in joint.graph.nodes if _stale_view(node)]
    if not stale:
        return 0
    mode = detect_fake_mode([node.meta["val"] for node in joint.graph.nodes if "val" in node.meta])
    if mode is None:
        return 0
    changed = 0
    with mode:
        for node in joint.graph.nodes:
            if not _stale_view(node):
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            node.meta["val"] = node.target(*args, **kwargs)
            changed += 1
    return changed


def _stale_view(node: fx.Node) -> bool:
    """``node`` is a view (or a ``getitem`` of one's tuple) whose fake value lies in a storage
    other than the one its base's value lies in."""
    if node.op != "call_function" or not isinstance(node.args[0] if node.args else None, fx.Node):
        return False
    base = node.args[0].meta.get("val")
    if node.target is operator.getitem:
        if not isinstance(base, (list, tuple)) or not isinstance(node.args[1], int):
            return False
        base = base[node.args[1]]
    elif not getattr(node.target, "is_view", False):
        return False
    if not isinstance(base, torch.Tensor):
        return False
    return any(storage_key(tensor) != storage_key(base) for tensor in tensors_in(node.meta.get("val")))


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _storage(node) -> object:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return storage_key(value) if isinstance(value, torch.Tensor) else None


def _same_layout(node: fx.Node) -> bool:
    """The clone is its source's values in its source's layout (no dtype, device or strides
    change), so reading the source instead is reading the same tensor."""
    source, value = node.args[0], node.meta.get("val")
    before = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(before, torch.Tensor):
        return False
    return (value.shape == before.shape and value.stride() == before.stride()
            and value.dtype == before.dtype and value.device == before.device
            and value.storage_offset() == 0 and before.storage_offset() == 0
            and value.untyped_storage().nbytes() == before.untyped_storage().nbytes())


def split(program: fx.GraphModule, num_fwd_outputs: int,
          static_lifetime_input_indices: list[int] | None = None
          ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward modules of a (rewritten) joint program, cut where its first
    backward node runs; the forward saves exactly what the backward reads from it.

    Raises:
        CaptureError: if a node before the cut reads one after it (the program is not a joint
            forward-then-backward graph).
    """
    graph = program.graph
    _fake_values(graph)
    first_backward = _first_backward(graph)
    side = _FORWARD
    forward_nodes: set[fx.Node] = set()
    for node in graph.nodes:
        if node is first_backward:
            side = _BACKWARD
        if node.op in ("placeholder", "output"):
            continue
        node.meta["partitioner_tag"] = side
        if side == _FORWARD:
            forward_nodes.add(node)
    _defer_reruns(graph, forward_nodes)
    placeholders = graph.find_nodes(op="placeholder")
    primals = [node for node in placeholders if not node.name.startswith("tangents")]
    sources = [*primals, *(node for node in graph.nodes if node in forward_nodes)]
    saved = [node for node in sources if _read_after_cut(node, forward_nodes)]
    saved_values = [node for node in saved if not is_sym_node(node)]
    saved_symbols = [node for node in saved if is_sym_node(node)]
    static = OrderedSet(placeholders[i] for i in (static_lifetime_input_indices or ()))
    return _extract_fwd_bwd_modules(program, saved_values, saved_symbols,
                                    num_fwd_outputs=num_fwd_outputs,
                                    static_lifetime_input_nodes=static)


_RERUN_KINDS = ("recompute", "view_replay")
_REPLAY_KINDS = ("rng_replay_begin", "rng_replay_end")


def _defer_reruns(graph: fx.Graph, forward_nodes: set[fx.Node]) -> None:
    """Move to the backward side the re-runs placed just before the cut: those of the values the
    first backward ops read (the rewrite re-runs an op right before its first backward reader, which
    is then before the first original backward node). Left in the forward, the forward returns the
    rebuilt value and it stays alive from the forward's end to the backward's start, across every
    region run in between (under FSDP2, where each stage or block is a region of its own, that is a
    whole re-run stage held through the others). A random op's re-run moves with the replay of its
    random state around it; what a node left in the forward reads stays there."""
    moved: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node not in forward_nodes or inserted_kind(node) not in _RERUN_KINDS or not node.users:
            continue
        if all(user.op != "output" and (user not in forward_nodes or user in moved
                                        or inserted_kind(user) in _REPLAY_KINDS) for user in node.users):
            moved.add(node)
    rerun_ops = {node.meta["memfit"]["tensor"] for node in moved if inserted_kind(node) == "recompute"}
    moved |= {node for node in forward_nodes
              if inserted_kind(node) in _REPLAY_KINDS and node.meta["memfit"]["tensor"] in rerun_ops}
    while _pull_back(graph, forward_nodes, moved):
        pass
    for node in moved:
        forward_nodes.discard(node)
        node.meta["partitioner_tag"] = _BACKWARD


def _pull_back(graph: fx.Graph, forward_nodes: set[fx.Node], moved: set[fx.Node]) -> bool:
    """Keep in the forward what a node staying there reads, an item of a tuple staying there
    (a tuple cannot be saved), and a random state's replay whose re-run stays; whether any."""
    staying = {node.meta["memfit"]["tensor"] for node in forward_nodes
               if node not in moved and inserted_kind(node) == "recompute"}
    back: set[fx.Node] = set()
    for node in graph.nodes:
        if node in moved:
            if (inserted_kind(node) in _REPLAY_KINDS and node.meta["memfit"]["tensor"] in staying) or any(
                    source in forward_nodes and source not in moved
                    and isinstance(source.meta.get("val"), (tuple, list))
                    for source in node.all_input_nodes):
                back.add(node)
        elif node in forward_nodes:
            back.update(source for source in node.all_input_nodes if source in moved)
    moved -= back
    return bool(back)


def _first_backward(graph: fx.Graph) -> fx.Node | None:
    """The first original node AOTAutograd traced in the backward pass (memfit's inserted nodes
    copy their source's tag, so only nodes without a ``memfit`` mark count)."""
    for node in graph.nodes:
        if (node.op == "call_function" and "memfit" not in node.meta
                and node.meta.get("partitioner_tag") == "is_backward"):
            return node
    return None


def _read_after_cut(node: fx.Node, forward_nodes: set[fx.Node]) -> bool:
    return any(user.op != "output" and user not in forward_nodes for user in node.users)


def _fake_values(graph: fx.Graph) -> None:
    """Give each node memfit inserted a fake ``val``, as AOTAutograd expects of every value it
    saves, by running the op's fake implementation in the joint graph's fake mode."""
    from torch._guards import detect_fake_mode

    values = [node.meta["val"] for node in graph.nodes if "val" in node.meta]
    mode = detect_fake_mode(values)
    if mode is None:
        return
    with mode:
        for node in graph.nodes:
            if node.op != "call_function" or "val" in node.meta:
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            node.meta["val"] = node.target(*args, **kwargs)
