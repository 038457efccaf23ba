"""Host-tier buffers for swapped-out activations, and a registry that tells them apart.

``HostPool.empty_like(tensor)`` hands out the host buffer a swap-out copies into: pinned memory
(from torch's own caching host allocator) when the compute device is an accelerator, a plain CPU
tensor otherwise. Every buffer it hands out is registered as *host tier* so that the CPU memory
tracker can leave it out of the device bytes.

It sits with the ops of a rewritten graph (``memfit.ops.swap``, ``memfit.ops.rng``), which
allocate such buffers, below the runtime (streams, tracker) that reads them: the ops import
nothing from ``memfit.runtime``.

Note:
    On a CPU-only machine "device" and "host" are the same memory, so the only way to tell a
    swapped-out copy from an activation is to remember which storages the pool made. The registry
    is keyed on the live ``UntypedStorage`` object (torch preserves one Python object per storage)
    and forgets it when the storage dies. Keying on ``data_ptr`` gave wrong answers: freed
    addresses are reused by later allocations.
"""

from __future__ import annotations

import weakref

import numpy
import torch
from torch.utils._python_dispatch import _disable_current_modes

# id(storage) -> weak reference to that storage; the entry is removed when the storage dies.
_HOST_STORAGES: dict[int, weakref.ref] = {}


def _forget(storage_id: int, reference: weakref.ref) -> None:
    if _HOST_STORAGES.get(storage_id) is reference:
        del _HOST_STORAGES[storage_id]


def register_host_storage(storage: torch.UntypedStorage) -> None:
    """Mark ``storage`` as host tier until it dies."""
    storage_id = id(storage)
    reference = weakref.ref(storage, lambda ref, key=storage_id: _forget(key, ref))
    _HOST_STORAGES[storage_id] = reference


def is_host_storage(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` was handed out by a ``HostPool`` (and is still alive)."""
    reference = _HOST_STORAGES.get(id(storage))
    return reference is not None and reference() is storage


def host_storage_count() -> int:
    """How many host-tier storages are alive (for tests and debugging)."""
    return len(_HOST_STORAGES)


class HostPool:
    """Hands out host buffers for swap-outs, pinned when the device is an accelerator.

    Args:
        device: the compute device the swapped tensors come from. Pinned memory is used only when
            it is not the CPU (``pin_memory`` raises on a CPU-only build).

    Note:
        No cache of its own: ``torch.empty(..., pin_memory=True)`` already goes through torch's
        caching host allocator, which also keeps a freed pinned block from being reused while a
        copy stream still reads it. The buffer is made with dispatch modes switched off: it is
        registered as host tier only once it exists, and a memory tracker active around the call
        would otherwise count it as device memory in between.

    Example:
        >>> pool = HostPool("cpu")
        >>> host = pool.empty_like(torch.ones(4))
        >>> is_host_storage(host.untyped_storage())
        True
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type != "cpu"
        self.handed_out_bytes = 0

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialised host buffer with ``tensor``'s shape, dtype and (dense) strides."""
        buffer = host_empty_like(tensor, pinned=self.pinned)
        self.handed_out_bytes += buffer.untyped_storage().nbytes()
        return buffer


def host_empty_like(tensor: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """An uninitialised host-tier buffer with ``tensor``'s shape, dtype and dense strides.

    Note:
        Without pinning (a CPU device) the memory comes from numpy, not from torch's CPU
        allocator: on a CPU the allocator's statistics (the profiler's memory events, by which
        compiled steps are measured) are the *device* bytes, and a host copy must stay out of
        them, as it stays out of ``torch.cuda.memory_allocated`` on a GPU.
    """
    with _disable_current_modes():  # a tracker must never count it as device memory
        if pinned:
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=True)
        else:
            strides = torch.empty_like(tensor, device="meta").stride()
            size_bytes = max(1, tensor.numel()) * tensor.element_size()
            flat = torch.from_numpy(numpy.empty(size_bytes, dtype=numpy.uint8))
            buffer = flat.view(tensor.dtype).as_strided(tensor.shape, strides)
    register_host_storage(buffer.untyped_storage())
    return buffer


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host-tier copy of a CPU tensor (generator states, kept out of the device bytes)."""
    buffer = host_empty_like(tensor)
    with _disable_current_modes():
        buffer.copy_(tensor)
    return buffer
