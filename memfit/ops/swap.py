"""The swap ops a rewritten graph calls: ``memfit::swap_out``, ``memfit::swap_in``, ``memfit::wait``.

Each is an op of the ``memfit`` library (``define``) with a fake implementation, so a rewritten
graph still runs under ``FakeTensorMode`` (shape propagation, the static liveness check). They find the copy
streams, events and host pool through ``memfit.ops.engine_slot.current_engine()``.

In a rewritten graph::

    y_host = memfit.swap_out(y, key=7)                      # right after y's producer
    ...
    y_dev = memfit.swap_in(y_host, out_key=7, key=8, device=cuda)   # after the control op
    ...
    memfit.wait(y_dev, key=8)                               # right before y's first consumer
    z = consumer(y_dev, ...)

Note:
    Outputs of a custom op must not alias its inputs, so both copies return fresh tensors.
    ``wait`` returns nothing, so fx would drop it as dead code; it is registered as side-effectful
    (``torch.fx.node._side_effectful_functions``) so ``eliminate_dead_code`` keeps it. The
    effects-token system (``_register_effectful_op``) would thread tokens through the graph,
    which a plain interpreter does not need.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx.node

from memfit.ops.engine_slot import current_engine

_LIBRARY = torch.library.Library("memfit", "FRAGMENT")  # kept: its registrations live with it


def define(schema: str, kernel: Callable, fake: Callable) -> torch._ops.OpOverload:
    """``memfit::<schema>``, run by ``kernel`` on every device and by ``fake`` on fake tensors.

    A call is the dispatcher's and one Python call: a ``torch.library.custom_op``'s Python
    layers (its autograd wrapper, its checks of the outputs) cost several times that per call,
    which a step pays for every swap. Nothing differentiates through these ops: they run inside
    compiled forward and backward graphs."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"memfit::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.memfit, name).default


def whole_storage(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where it covers its storage densely from offset 0, else a flat view of the
    whole storage: what a swap copies, so the copy holds every byte that the CostGraph counts
    and that views of ``x`` may read (``x`` may have gaps or an offset: ``aten.copy`` into a
    slice, ``slice_scatter`` into a slice).
    """
    if x.storage_offset() == 0 and x.is_contiguous() and x.nbytes == x.untyped_storage().nbytes():
        return x
    return x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0)


def same_layout(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flat`` (a copy of ``whole_storage(like)``) viewed with ``like``'s shape, strides, offset."""
    layout = (like.shape, like.stride(), like.storage_offset())
    if (flat.shape, flat.stride(), flat.storage_offset()) == layout:
        return flat
    return flat.as_strided(*layout)


def swap_out(x: torch.Tensor, key: int, stride: list[int] | None = None) -> torch.Tensor:
    """A host copy of ``x``; on an accelerator the copy runs on the d2h stream.

    Args:
        x: the device tensor to offload.
        key: the event key the matching ``swap_in`` waits on (``out_key`` there).
        stride: the host copy's strides, where given: the strides the graph's value has
            (``rewrite``; a symbolic one read where it runs), or those inductor requires of it
            as a saved value
            (``memfit.lowering.inductor.host_copies_in_saved_layout``). Inductor lays out a value
            as it likes (an attention ``clone`` in its source's order), and a saved host copy
            whose strides differ from the required ones is copied again, on the device, so the
            swap frees nothing. The copy to the host converts the layout instead.

    Note:
        On an accelerator the d2h stream first waits for the compute stream (``x`` must be
        written), the copy is ``non_blocking`` into a pinned buffer, and ``x.record_stream``
        keeps the caching allocator from reusing ``x``'s memory before the copy ends, even though
        the graph drops ``x`` right after its last forward use.
    """
    engine = current_engine("memfit::swap_out")
    relaid = _relaid(x, stride)
    source = whole_storage(x) if relaid is None else x
    host = engine.host_pool.empty_like(source if relaid is None else relaid)
    if not engine.is_accelerator:
        host.copy_(source)
    else:
        copy_stream = engine.d2h_stream
        copy_stream.wait_stream(engine.compute_stream())
        with engine.stream(copy_stream):
            host.copy_(source, non_blocking=True)
        x.record_stream(copy_stream)
        engine.record(key, copy_stream)
    return same_layout(host, x) if relaid is None else host


def _relaid(x: torch.Tensor, stride: list[int] | None) -> torch.Tensor | None:
    """A storage-less tensor with ``x``'s shape and dtype and ``stride``, where ``stride`` is
    given and differs from ``x``'s (the host copy is then laid out so); else ``None``."""
    if stride is None or tuple(stride) == x.stride():
        return None
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device="meta")


def _swap_out_fake(x: torch.Tensor, key: int, stride: list[int] | None = None) -> torch.Tensor:
    if stride is None:
        return torch.empty_like(x, device="cpu")
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device="cpu")


def swap_in(host: torch.Tensor, out_key: int, key: int, device: torch.device) -> torch.Tensor:
    """A copy of ``host`` on ``device``; on an accelerator the copy runs on the h2d stream.

    Args:
        host: the host buffer a ``swap_out`` returned.
        out_key: the key of that swap-out's event (the copy to the host must be complete).
        key: the key of this copy's event, which ``wait`` makes the compute stream wait on.
        device: the compute device.

    Note:
        The device tensor is allocated while the h2d stream is current, so the caching allocator
        ties its block to that stream; ``record_stream(compute stream)`` then keeps the block
        alive until the compute ops that read it are done. On the CPU the result is a fresh
        tensor: device memory, counted by the tracker.
    """
    engine = current_engine("memfit::swap_in")
    source = whole_storage(host)
    if not engine.is_accelerator:
        result = torch.empty_like(source, device=device)
        result.copy_(source)
        return same_layout(result, host)
    copy_stream = engine.h2d_stream
    engine.wait(out_key, copy_stream)
    with engine.stream(copy_stream):
        result = torch.empty_like(source, device=device)
        result.copy_(source, non_blocking=True)
    engine.record(key, copy_stream)
    result.record_stream(engine.compute_stream())
    return same_layout(result, host)


def _swap_in_fake(host: torch.Tensor, out_key: int, key: int,
                  device: torch.device) -> torch.Tensor:
    return torch.empty_like(host, device=device)


def wait(x: torch.Tensor, key: int) -> None:
    """Make the compute stream wait for the copy event ``key`` (a no-op on the CPU).

    Args:
        x: the swapped-in tensor; passing it orders ``wait`` after its ``swap_in`` in the graph.
        key: the ``swap_in``'s event key.
    """
    engine = current_engine("memfit::wait")
    engine.wait(key, engine.compute_stream())


def _wait_fake(x: torch.Tensor, key: int) -> None:
    return None


SWAP_OUT = define("swap_out(Tensor x, SymInt key, SymInt[]? stride=None) -> Tensor", swap_out,
                  _swap_out_fake)
SWAP_IN = define("swap_in(Tensor host, SymInt out_key, SymInt key, Device device) -> Tensor",
                 swap_in, _swap_in_fake)
WAIT = define("wait(Tensor x, SymInt key) -> ()", wait, _wait_fake)
torch.fx.node._side_effectful_functions.add(WAIT)
