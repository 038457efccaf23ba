"""Analyze a captured graph into the planner's torch-free CostGraph.

Sizes are counted per *storage*: a view, ``detach`` or ``t(weight)`` aliases its base and adds no
bytes, and a multi-output op's tuple holds all its outputs until its last ``getitem``. An op reads
every storage held by the values it takes, which is exactly when the executor can free them.
With ``kernel_temporaries``, an op whose kernel allocates buffers for itself (``temporaries.py``)
also allocates a storage of those bytes that nothing reads: alive while the op runs, freed after.
FLOPs come from PyTorch's own FLOP counter registry (completed by ``flops.py``); time from the roofline of a ``Hardware``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.hardware import Hardware
from memfit.model.kernels import repriced
from memfit.tracing.capture import SCOPE_KEY, TYPE_KEY, Binding, Captured
from memfit.tracing.flops import node_flops
from memfit.tracing.temporaries import (
    inductor_channels_last,
    kernel_output_storage_bytes,
    kernel_temporary_bytes_of,
)

_PHASES = {"is_forward": "forward", "is_backward": "backward"}
_ROLES = {"parameter": "parameter", "buffer": "buffer", "input": "input", "tangent": "input"}


def tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors inside a node's value (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)


def storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def inserted_kind(node: torch.fx.Node) -> str | None:
    """What memfit's rewrite inserted ``node`` as ("recompute", "swap_in", "view_replay", ...),
    or ``None`` for a node of the captured program."""
    return node.meta.get("memfit", {}).get("kind")


def op_kind(node: torch.fx.Node) -> str:
    """``"aten.mm"`` for ``aten.mm.default``; ``"getitem"`` for tuple indexing."""
    if node.target is operator.getitem:
        return "getitem"
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name.replace("::", ".")
    return getattr(node.target, "__name__", str(node.target))


def analyze(captured: Captured, hardware: Hardware, name: str = "step",
            kernel_temporaries: bool = False,
            owners: dict[StorageWeakRef, str] | None = None,
            compiler: str = "aot_eager") -> CostGraph:
    """The CostGraph of a captured step, with op times from ``hardware``'s roofline, as
    ``compiler``'s kernels run it (``memfit.model.kernels.repriced``: each aten op its own
    kernel for ``"aot_eager"``, memory-bound chains fused for ``"inductor"``).

    Args:
        kernel_temporaries: count the buffers kernels allocate and free inside one op (what the
            allocator sees, as ``torch.cuda.max_memory_allocated`` and ``measure_allocator_peak``
            do), and an output at its kernel's real storage where that is larger than the fake
            value's (a reduced loss on the CPU). ``False`` counts op outputs only, at their fake
            storages, as the CPU dispatch tracker that measures the executor does.
        owners: filled, when given, with each storage's tensor name (to find a graph output's).
    """
    graph = captured.graph_module.graph
    owner: dict[StorageWeakRef, str] = {} if owners is None else owners  # storage -> its tensor
    tensors: dict[str, Tensor] = {}
    ops: list[Op] = []
    placeholders = graph.find_nodes(op="placeholder")
    for node, binding in zip(placeholders, captured.inputs, strict=True):
        _add_input(node, binding, owner, tensors)
    temporaries = kernel_temporary_bytes_of(graph.nodes, inductor_channels_last(
        captured.graph_module) if compiler == "inductor" else ()) if kernel_temporaries else {}
    for node in graph.nodes:
        if node.op == "call_function":
            temporary_bytes = temporaries.get(node, 0) if kernel_temporaries else None
            ops.append(_op(node, owner, tensors, temporary_bytes))
        elif node.op == "get_attr":  # a constant the graph holds: resident like an input
            _add_input(node, Binding("constant"), owner, tensors)
    output = graph.find_nodes(op="output")[0]
    for value in output.all_input_nodes:
        for tensor in tensors_in(value.meta.get("val")):
            name_ = owner.get(storage_key(tensor))
            if name_ is not None and tensors[name_].role in ("activation", "gradient"):
                tensors[name_] = _as_output(tensors[name_])
    return repriced(CostGraph.build(ops, tensors.values(), name=name), hardware, compiler)


def _add_input(node, binding: Binding, owner, tensors) -> None:
    for tensor in tensors_in(node.meta.get("val")):
        key = storage_key(tensor)
        if key not in owner:
            owner[key] = node.name
            size = _storage_bytes(tensor)
            tensors[node.name] = Tensor(node.name, size, _ROLES.get(binding.kind, "input"))


def _storage_bytes(tensor: torch.Tensor) -> int | torch.SymInt:
    """The bytes of ``tensor``'s storage, an ``int`` wherever its size has no free symbol (Dynamo
    hands a region whose input strides it made dynamic a storage size that is a ``SymInt`` of a
    constant)."""
    size = tensor.untyped_storage().nbytes()
    if isinstance(size, torch.SymInt) and not size.node.expr.free_symbols:
        return int(size.node.expr)
    return size


def _as_output(tensor: Tensor) -> Tensor:
    return Tensor(tensor.name, tensor.size_bytes, tensor.role, tensor.producer, (), True)


def _op(node: torch.fx.Node, owner, tensors, temporary_bytes: int | None) -> Op:
    """One Op: the storages it reads and allocates, its phase, scope, FLOPs and bytes (its time
    is the graph's to price: ``analyze``).

    ``temporary_bytes``: the kernel's scratch, a storage of its own; ``None`` counts what the
    dispatcher sees only (no scratch, outputs at their fake values' storage sizes).
    """
    reads: dict[str, None] = {}
    for source in node.all_input_nodes:
        for tensor in tensors_in(source.meta.get("val")):
            name = owner.get(storage_key(tensor))
            if name is not None:
                reads[name] = None
    value = node.meta.get("val")
    phase = _PHASES.get(node.meta.get("partitioner_tag"), "backward")
    role = "activation" if phase == "forward" else "gradient"
    allocated: list[str] = []
    for tensor in tensors_in(value):
        key = storage_key(tensor)
        if key not in owner:
            owner[key] = node.name if not allocated else f"{node.name}.{len(allocated)}"
            size = _storage_bytes(tensor)
            if not allocated and temporary_bytes is not None:  # the kernel's real storage
                size = max(size, kernel_output_storage_bytes(node) or 0)
            allocated.append(owner[key])
            tensors[owner[key]] = Tensor(owner[key], size, role)
    if temporary_bytes:  # a storage nothing reads: freed right after the op
        allocated.append(f"{node.name}.temporary")
        tensors[allocated[-1]] = Tensor(allocated[-1], temporary_bytes, role)
    custom = node.meta.get("custom") or {}
    flops = node_flops(node) if allocated else 0.0
    moved = _bytes_accessed(node) if allocated else 0
    first = next(tensors_in(value), None)
    dtype = str(first.dtype).removeprefix("torch.") if first is not None else "float32"
    kind = op_kind(node)
    elements = first.numel() if first is not None else 0
    return Op(
        name=node.name,
        kind=kind,
        phase=phase,
        scope=custom.get(SCOPE_KEY, ""),
        module_type=custom.get(TYPE_KEY, ""),
        inputs=tuple(reads),
        outputs=tuple(allocated),
        depends_on=tuple(n.name for n in node.all_input_nodes if n.op == "call_function"),
        flops=flops,
        bytes_accessed=moved,
        dtype=dtype,
        elements=elements,
        library_call=_complex_fallback(node),
    )


_COMPLEX_VIEWS = ("aten.view_as_complex", "aten.view.dtype", "prims.convert_element_type")


def _complex_fallback(node: torch.fx.Node) -> bool:
    """Whether inductor lowers ``node`` to eager's kernel because a complex tensor is among its
    inputs or outputs (``torch._inductor.lowering.fallback_node_due_to_unsupported_type``: it
    generates no code for complex values, views into them aside)."""
    if str(node.target).removesuffix(".default") in _COMPLEX_VIEWS:
        return False
    return any(tensor.is_complex() for source in (*node.all_input_nodes, node)
               for tensor in tensors_in(source.meta.get("val")))


def _bytes_accessed(node: torch.fx.Node) -> int:
    """Bytes read plus written: the memory-bound side of the roofline."""
    total = 0
    for source in (*node.all_input_nodes, node):
        for tensor in tensors_in(source.meta.get("val")):
            total += tensor.numel() * tensor.element_size()
    return total
