"""A compiled region's lifetimes outside its joint graph, read from the graph and the user's loop.

``memfit.model.lifetimes`` says what these lifetimes are; this module finds them for a region of
``memfit.fit``: the gradients other regions make during its backward (planned for), and, once a
backward has run, which outputs the loop held through it and which tangents autograd passed (the
region's prediction is simulated again with them; its plan, checked with every output held and
every tangent resident, stays).

Example:
    >>> given = tangents_given(region, backward_args)  # before the region's backward runs
    >>> observe_loop(region, given)  # after it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.data.costgraph import CostGraph
from memfit.model.lifetimes import with_forward_storage, with_loop_lifetimes, with_storage_from
from memfit.model.simulate import simulate
from memfit.ops.host import is_host_storage
from memfit.tracing.analyze import storage_key, tensors_in
from memfit.tracing.capture import Binding

if TYPE_CHECKING:
    from memfit.compiler.region import Region

LATER_GRADIENTS = "memfit.later_gradients"  # the storage standing for other regions' gradients
DROPPED_GRADIENTS = "memfit.dropped_gradients"  # the model's gradients the loop frees in between
EAGER_AT_BACKWARD = "memfit.eager_at_backward"  # eager code's bytes seen at the backward's start


def trainable_parameter_bytes(joint: fx.GraphModule, num_fwd_outputs: int,
                              bindings: Sequence[Binding]) -> int:
    """Bytes of the region's parameters its backward returns a gradient for: the joint graph
    returns one gradient (or ``None``) per primal, in the primals' order, after the forward's
    outputs."""
    placeholders = [node for node in joint.graph.find_nodes(op="placeholder")
                    if not node.name.startswith("tangents")]
    gradients = joint.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
    if len(gradients) != len(placeholders):
        return sum(_bytes(node) for node, binding in
                   zip(joint.graph.find_nodes(op="placeholder"), bindings, strict=True)
                   if binding.kind == "parameter")  # unknown layout: every parameter, as trainable
    kinds = [binding.kind for binding in bindings if binding.kind != "tangent"]
    return sum(_bytes(node) for node, gradient, kind in zip(placeholders, gradients, kinds,
                                                            strict=True)
               if kind == "parameter" and gradient is not None)


def _bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def with_later_gradients(graph: CostGraph, size_bytes: int) -> CostGraph:
    """``graph`` with ``size_bytes`` of other regions' gradients alive from its first backward op
    on (unchanged without a backward or without such gradients)."""
    return with_backward_storage(graph, LATER_GRADIENTS, size_bytes)


def with_dropped_gradients(graph: CostGraph, size_bytes: int) -> CostGraph:
    """``graph`` with ``size_bytes`` of the model's gradients alive over its forward only: the
    loop frees them before the backward makes new ones (``memfit.compiler.dropped_gradients``)."""
    return with_forward_storage(graph, DROPPED_GRADIENTS, size_bytes)


def with_backward_storage(graph: CostGraph, name: str, size_bytes: int) -> CostGraph:
    """``graph`` with a storage ``name`` of ``size_bytes`` alive from its first backward op to
    the end (unchanged without a backward or without bytes)."""
    first = next((op for op in graph.ops if op.phase == "backward"), None)
    if not size_bytes or first is None:
        return graph
    return with_storage_from(graph, name, size_bytes, first.name)


def eager_beyond_plan_bytes(region: Region) -> int:
    """Eager code's bytes seen at ``region``'s backwards' start (the loss, its buffers, the
    labels) beyond those its ``outside_bytes`` count over the whole region."""
    return max(0, region.eager_backward_bytes - region.planned_eager_bytes)


def output_tensor_names(joint: fx.GraphModule, num_fwd_outputs: int,
                        owners: dict[StorageWeakRef, str]) -> tuple[str | None, ...]:
    """The graph tensor holding each user-visible output's storage (``None``: not a tensor)."""
    names: list[str | None] = []
    for node in joint.graph.find_nodes(op="output")[0].args[0][:num_fwd_outputs]:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        tensor = next(tensors_in(value), None)
        names.append(None if tensor is None else owners.get(storage_key(tensor)))
    return tuple(names)


def scalar_output_bytes(joint: fx.GraphModule, num_fwd_outputs: int,
                        block_bytes: int = 1) -> int:
    """Bytes of the user-visible outputs of one element (the loss), each rounded up to the
    allocator's ``block_bytes``: a plan counts the previous call's beside this one's, since a
    loop holds its loss into the next iteration (``loss = model(...)`` rebinds it only once
    the call returns; ``last = loss``). Larger outputs a loop keeps are seen at the run
    (``memfit.runtime.outside``) and planned for then."""
    total = 0
    for node in joint.graph.find_nodes(op="output")[0].args[0][:num_fwd_outputs]:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        tensor = next(tensors_in(value), None)
        if tensor is not None and tensor.numel() == 1:
            size = tensor.untyped_storage().nbytes()
            total += -(-size // block_bytes) * block_bytes
    return total


def output_tangents(joint: fx.GraphModule, num_fwd_outputs: int) -> tuple[str | None, ...]:
    """Each user-visible output's tangent where it is more than a loss's scalar seed (matched
    in order by layout: AOTAutograd passes one per differentiable output), else ``None``.

    Where such a tangent is passed, the output's gradient was made outside the region, by code
    no plan covers, which may keep buffers of the output's size until the backward ends (CPU
    ``mse_loss`` does): ``observe_loop`` then counts the output held to the end, standing in for
    them, until that code's bytes at the backward's start have been read, which are counted
    instead."""
    tangents = [node for node in joint.graph.find_nodes(op="placeholder")
                if node.name.startswith("tangents")]
    found: list[str | None] = []
    for node in joint.graph.find_nodes(op="output")[0].args[0][:num_fwd_outputs]:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        tensor = next(tensors_in(value), None)
        if tensor is None or not tangents or not _same_layout(tangents[0].meta.get("val"),
                                                               tensor):
            found.append(None)
            continue
        tangent = tangents.pop(0)
        found.append(tangent.name if tensor.numel() > 1 else None)
    return tuple(found)


def _same_layout(tangent: object, tensor: torch.Tensor) -> bool:
    return (isinstance(tangent, torch.Tensor) and tangent.shape == tensor.shape
            and tangent.dtype == tensor.dtype)


def remember_outputs(region: Region, outputs: Sequence) -> dict:
    """Note the storages of a forward run's user-visible outputs, weakly (``observe_loop``),
    and those of the values it saved for its backward (counted as the region's saves while
    they wait, so not as eager code's bytes: ``memfit.compiler.region_peak``), those its
    ``saved_bytes`` counts apart (``Region.latest_saves``).

    Returns:
        Each saved value's storage, weakly, with its bytes (0 for a host buffer: a swap's copy).
    """
    visible = len(region.output_names)
    region.output_storages = tuple(
        StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None
        for value in outputs[:visible])
    saved: dict = {}
    for value in outputs[visible:]:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            saved.setdefault(StorageWeakRef(storage),
                             0 if is_host_storage(storage) else storage.nbytes())
    counted = [outputs[visible + place] for place in region.counted_saves
               if visible + place < len(outputs)]
    region.latest_saves = {StorageWeakRef(value.untyped_storage()): value.untyped_storage().nbytes()
                           for value in counted if isinstance(value, torch.Tensor)
                           and not is_host_storage(value.untyped_storage())}
    region.saved_sizes = {**{reference: size for reference, size in region.saved_sizes.items()
                             if not reference.expired()},
                          **{reference: size for reference, size in saved.items() if size}}
    # one reference per storage: a parameter saved by every forward (a weight's transpose view)
    # never expires, and a tuple of every forward's references grew by it each iteration
    region.saved_storages = tuple(region.saved_sizes)
    return saved


def tangents_given(region: Region, args: Sequence) -> tuple[tuple[str, object], ...]:
    """Before ``region``'s backward runs with ``args``: each of its tangents' storage, weakly
    (``None`` for a tangent passed as ``None``: an output the loss does not depend on), so that
    ``observe_loop`` sees which ones outlived the backward."""
    return tuple((name, StorageWeakRef(value.untyped_storage())
                  if isinstance(value, torch.Tensor) else None)
                 for name, value in zip(region.backward_input_names, args, strict=False)
                 if name.startswith("tangents") and name in region.graph.tensors)


def observe_loop(region: Region, given: tuple[tuple[str, object], ...]) -> None:
    """After ``region``'s backward ran with tangents ``given`` (``tangents_given``): which of its
    forward's outputs the loop still holds (a storage still alive once the backward freed the
    saves it read) and which tangents outlived the backward; where that differs from the last
    backward, simulate its plan again with those lifetimes.

    An output whose gradient came from outside the region (``output_tangents``) and that the
    loop let go is counted held to the end, standing in for the buffers of the code that made
    its gradient, until what eager code holds at the backward's start has been read
    (``Region.eager_read``: the loss, its buffers, the labels): from then on those bytes are in
    the prediction instead, from the backward's start (``eager_beyond_plan_bytes``).

    Note:
        A tangent whose storage is gone once the backward has returned was freed after its last
        reader: torch's autograd passes the compiled backward its gradients in a list
        (``boxed_grads_call``) that the backward's boxed code empties, freeing each input after its
        last use (an LSTM's logits' gradient is freed right after the head's gradient ``mm``, long
        before the LSTM layers' backward where the step peaks). One still alive is held beyond the
        backward (a ``retain_grad``, a hook, or a torch that passes the gradients in a tuple its
        caller holds): counted to the end. The plan itself was checked with every output held and
        every tangent resident (``Region.bound``): what is seen here moves the prediction, never the
        plan's check.
    """
    if not region.output_storages or region.hardware is None:
        return
    passed = {name for name, storage in given if storage is not None}
    kept = tuple((name, storage is not None and not storage.expired())  # type: ignore[attr-defined]
                 for name, storage in given)
    alive = [reference is not None and not reference.expired()
             for reference in region.output_storages]
    from_eager = [tangent in passed for tangent in region.output_tangents]
    stand_in = not region.eager_read  # eager code's bytes unread: the outputs stand in for them
    held = tuple(output_alive or (stand_in and made_outside)
                 for output_alive, made_outside in zip(alive, from_eager, strict=False))
    replaced = not stand_in and any(made_outside and not output_alive for output_alive, made_outside
                                    in zip(alive, from_eager, strict=False))
    eager_bytes = eager_beyond_plan_bytes(region) if replaced else 0
    passed_state = tuple((name, name in passed) for name, _ in given)
    if (held, passed_state, kept, eager_bytes) == region.observed:
        return
    region.observed = (held, passed_state, kept, eager_bytes)
    graph = loop_graph(region.graph, dict(zip(region.output_names, held, strict=False)),
                       dict(passed_state), frozenset(name for name, alive in kept if alive))
    graph = with_backward_storage(graph, EAGER_AT_BACKWARD, eager_bytes)
    plan = replace(region.plan, graph_hash=graph.structure_hash)
    region.predicted = simulate(graph, plan, region.hardware)


def loop_graph(graph: CostGraph, output_alive: dict[str | None, bool],
               tangent_given: dict[str, bool],
               tangent_kept: frozenset[str] = frozenset()) -> CostGraph:
    """``graph`` with the loop's lifetimes: outputs it dropped freed when the forward ends (or
    after their last reader, for those its backward reads),
    tangents it passed made when the backward starts and freed after their last reader (held
    until it returns: those in ``tangent_kept``), the others made as zeros before their first
    reader (``memfit.compiler.region_run.zeros_at_first_use``) or never."""
    forward = [op.name for op in graph.ops if op.phase == "forward"]
    first_backward = next((i for i, op in enumerate(graph.ops) if op.phase == "backward"), None)
    if not forward or first_backward is None or first_backward == 0:
        return graph
    released = {name: forward[-1] for name, alive in output_alive.items()
                if name is not None and not alive and graph.tensors[name].is_output
                and graph.tensors[name].role in ("activation", "gradient")}
    arriving, absent = {}, set()
    for name, given in tangent_given.items():
        readers = graph.tensors[name].consumers
        if given:
            arriving[name] = graph.ops[first_backward - 1].name
        elif readers:
            arriving[name] = graph.ops[graph.index[readers[0]] - 1].name
        else:
            absent.add(name)
    held = frozenset(name for name in tangent_kept if tangent_given.get(name))
    return with_loop_lifetimes(graph, arriving, released, frozenset(absent), held)


def dropped_outputs_graph(graph: CostGraph, output_names: Sequence[str | None],
                          tangents: Sequence[str | None], tangents_as_none: bool = True,
                          ) -> tuple[CostGraph, frozenset[str]]:
    """``graph`` as a loop that keeps only its loss runs it, and the outputs it frees: each
    user-visible output with more than a loss's scalar seed for a tangent (``output_tangents``:
    a language model's logits, its key/value cache) freed when the forward ends, or after its
    last backward reader, and its tangent never passed (``None``: zeros made before its first
    reader, ``memfit.compiler.region_run.zeros_at_first_use``). The loss and every other output
    stay held to the step's end. A tangent whose first reader is the backward's first op stays
    resident (made before it, it would be a forward value a plan could swap or re-run), as does
    every tangent where the backward cannot take ``None`` (``tangents_as_none`` false:
    inductor's, whose zeros autograd makes when the backward starts).
    ``(graph, frozenset())`` where no output is freed."""
    first_backward = next((i for i, op in enumerate(graph.ops) if op.phase == "backward"), None)
    if first_backward is None:
        return graph, frozenset()
    phase = {op.name: op.phase for op in graph.ops}
    released: dict[str | None, bool] = {}
    tangent_given: dict[str, bool] = {}
    for output, tangent in zip(output_names, tangents, strict=False):
        found = graph.tensors.get(output) if output is not None else None
        if (tangent is None or found is None or not found.is_output or found.producer is None
                or phase[found.producer] != "forward" or tangent not in graph.tensors):
            continue
        released[output] = False
        readers = graph.tensors[tangent].consumers
        if tangents_as_none and (not readers or graph.index[readers[0]] > first_backward):
            tangent_given[tangent] = False
    if not released:
        return graph, frozenset()
    return (loop_graph(graph, released, tangent_given),
            frozenset(name for name in released if name is not None))
