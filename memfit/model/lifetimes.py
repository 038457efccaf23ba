"""Lifetimes a region's joint graph does not show: storages that arrive during its backward and
outputs the user's loop lets go of.

A compiled region's joint graph starts with every input resident and ends with every output
alive. Two kinds of bytes differ from that in a real step, and both move its peak:

- Bytes that exist only from the backward on: the gradients of parameters of regions later in
  the forward (a graph break: their backward runs first, so their ``.grad`` exists while this
  region's backward runs), and the tangents autograd hands the backward (made when
  ``backward()`` starts; for an output the loss does not use, none at all: memfit makes zeros
  where the gradient is first read).
- Outputs the loop does not hold into the backward (a language model's logits when the loop
  keeps only ``.loss``): freed when the forward returns, not at the step's end.

The planner plans with the first kind added and the second assumed held (nothing it cannot know
is assumed away); once a backward has run, the loop's choices are known and the prediction
reports them (``with_loop_lifetimes``).

A third kind lives longer than the graph shows: a backward called with ``retain_graph=True``
frees none of the forward's saves as it reads them (autograd's graph holds them for the next
backward), so each one the backward reads stays alive to its end (``with_retained_saves``).
A fourth lives shorter: the last step's gradients, which a loop calling ``zero_grad()`` between
the forward and the backward frees before the backward makes new ones
(``with_forward_storage``).

Example:
    >>> graph = with_storage_from(graph, "later gradients", 4096, "mm_backward")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from memfit.data.costgraph import CostGraph, Op, Tensor


def with_storage_from(graph: CostGraph, name: str, size_bytes: int, op_name: str) -> CostGraph:
    """``graph`` plus a storage of ``size_bytes`` that ``op_name`` allocates and that stays alive
    to the step's end (a gradient made outside the graph: nothing in it reads the storage).

    Raises:
        ValueError: if ``name`` is already a tensor of ``graph``.
    """
    if name in graph.tensors:
        raise ValueError(f"{name!r} is already a tensor of {graph.name}: pick another name")
    ops = [replace(op, outputs=(*op.outputs, name)) if op.name == op_name else op
           for op in graph.ops]
    extra = Tensor(name, size_bytes, "gradient", is_output=True)
    return CostGraph.build(ops, [*_unbuilt(graph), extra], name=graph.name,
                           compiler=graph.compiler)


def with_forward_storage(graph: CostGraph, name: str, size_bytes: int) -> CostGraph:
    """``graph`` plus a storage of ``size_bytes`` alive from its first op through its forward's
    last (what the loop frees before the backward starts); unchanged without a backward or
    without bytes."""
    forward = graph.forward_ops
    if not size_bytes or not forward or all(op.phase != "backward" for op in graph.ops):
        return graph
    graph = with_storage_from(graph, name, size_bytes, forward[0].name)
    return with_loop_lifetimes(graph, {}, {name: forward[-1].name})


RETAINED_SAVES = "memfit.retained_saves"  # marks a graph whose backward keeps the saves it reads


def with_retained_saves(graph: CostGraph) -> CostGraph:
    """``graph`` run by a backward that keeps its forward's saves (``retain_graph=True``): every
    buffer a plan's forward makes and its backward reads (a kept save, a copy swapped in during
    the forward) is alive to the step's end, while one the backward makes itself (a copy swapped
    in, a value re-run) is freed after its last reader (``memfit.model.schedule.lower`` reads the
    mark, a storage of no bytes). Unchanged without a backward, or already marked."""
    first = next((op for op in graph.ops if op.phase == "backward"), None)
    if first is None or RETAINED_SAVES in graph.tensors:
        return graph
    return with_storage_from(graph, RETAINED_SAVES, 0, first.name)


def with_loop_lifetimes(graph: CostGraph, arriving: Mapping[str, str],
                        released: Mapping[str, str], absent: frozenset[str] = frozenset(),
                        held: frozenset[str] = frozenset()) -> CostGraph:
    """``graph`` with the lifetimes a run of the user's loop showed.

    Args:
        arriving: input tensor -> the op that allocates it (a tangent made when the backward
            starts, or zeros made before the op that first reads it). The op must run before
            every reader of the tensor.
        released: output tensor -> the last op it stays alive through (the forward's last op,
            for an output the loop dropped before calling ``backward()``); it is no longer an
            output, so it dies after that op or its last reader, whichever is later.
        absent: input tensors that never exist (a tangent passed as ``None`` that nothing reads).
        held: arriving tensors alive to the step's end (a tangent that outlived the backward:
            something beside it holds it; the others die after their last reader, as torch's
            boxed gradients do).
    """
    allocates: dict[str, list[str]] = {}
    for tensor, op_name in arriving.items():
        allocates.setdefault(op_name, []).append(tensor)
    holds: dict[str, list[str]] = {}
    for tensor, op_name in released.items():
        if graph.tensors[tensor].producer != op_name:
            holds.setdefault(op_name, []).append(tensor)
    ops = [_extended(op, allocates.get(op.name, ()), holds.get(op.name, ())) for op in graph.ops]
    tensors = [replace(tensor, size_bytes=0) if tensor.name in absent
               else replace(tensor, is_output=False) if tensor.name in released
               else replace(tensor, is_output=True) if tensor.name in held else tensor
               for tensor in _unbuilt(graph)]
    return CostGraph.build(ops, tensors, name=graph.name, compiler=graph.compiler)


def _extended(op: Op, allocates, holds) -> Op:
    if not allocates and not holds:
        return op
    inputs = (*op.inputs, *(tensor for tensor in holds if tensor not in op.inputs))
    return replace(op, outputs=(*op.outputs, *allocates), inputs=inputs)


def _unbuilt(graph: CostGraph) -> list[Tensor]:
    """The graph's tensors with producers and consumers cleared, for ``CostGraph.build``."""
    return [replace(tensor, producer=None, consumers=()) for tensor in graph.tensors.values()]
