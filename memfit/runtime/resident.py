"""Device bytes that stay resident across a training iteration: what a plan must leave room for.

Parameters, buffers and gradients kept across micro-batches are there before a compiled region
runs; so is the optimizer's state, except on the very first iteration, where it appears only in
``optimizer.step()``, after the plan was made. So that the budget holds from the first iteration
on, a known optimizer's state is *reserved* before it exists: its size follows from the
parameters (``STATE_SLOTS``), the way the optimizer will allocate it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# State tensors per parameter, each the parameter's size, that torch's optimizers allocate on
# their first step (see each optimizer's _init_group); a scalar "step" tensor comes on top.
STATE_SLOTS: dict[type, int] = {
    torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.Adamax: 2, torch.optim.NAdam: 2,
    torch.optim.RAdam: 2, torch.optim.Adadelta: 2, torch.optim.Adagrad: 1,
    torch.optim.RMSprop: 1, torch.optim.SGD: 0,
}
_STEP_BYTES = 4  # the float32 "step" counter of the Adam family, a tensor on the param's device
_HAS_STEP = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
             torch.optim.RAdam, torch.optim.Adadelta, torch.optim.Adagrad, torch.optim.RMSprop)


def resident_bytes(model: torch.nn.Module | None,
                   optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> int:
    """Bytes on ``device`` held by the model and the optimizers, reserved state included."""
    optimizers = list(optimizers)
    storages: dict[StorageWeakRef, int] = {}
    for tensor in resident_tensors(model, optimizers):
        if tensor.device == device:
            storage = local_tensor(tensor).untyped_storage()
            storages.setdefault(StorageWeakRef(storage), storage.nbytes())
    reserved = sum(reserved_state_bytes(optimizer, device) for optimizer in optimizers)
    return sum(storages.values()) + reserved + bucket_bytes(model, device)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a ``DTensor``'s local shard (FSDP2's
    parameters, their gradients and optimizer state), whose own ``untyped_storage()`` has the
    whole tensor's size (measured: 32,768 B for a [128, 64] float32 parameter sharded over two
    ranks, whose shard is 16,384 B); any other tensor itself."""
    if _DTENSOR is not None and isinstance(tensor, _DTENSOR):
        return tensor._local_tensor  # its shard itself (to_local() dispatches ops)
    return tensor


def _dtensor_type() -> type | None:
    """``DTensor``, where this build of torch has ``torch.distributed``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def bucket_bytes(model: torch.nn.Module | None, device: torch.device) -> int:
    """Bytes of DDP's gradient buckets in ``model``: each ``DistributedDataParallel`` module
    keeps a flat copy of its trainable parameters' gradients, allocated when it is built and
    kept (gradients are copied into it for the all-reduce, and back). With
    ``gradient_as_bucket_view=True`` the gradients are views of the buckets: then only the
    buckets of parameters without a gradient count here (the others count as gradients)."""
    from torch.nn.parallel import DistributedDataParallel

    if model is None:
        return 0
    total = 0
    for module in model.modules():
        if not isinstance(module, DistributedDataParallel):
            continue
        for parameter in module.parameters():
            if not parameter.requires_grad or parameter.device != device:
                continue
            if module.gradient_as_bucket_view and parameter.grad is not None:
                continue
            total += parameter.numel() * parameter.element_size()
    return total


def resident_tensors(model: torch.nn.Module | None,
                     optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors that exist now and stay across iterations: parameters, their ``.grad``,
    buffers and optimizer state (on any device; a storage may appear more than once)."""
    found: list[torch.Tensor] = []

    def add(tensor: object) -> None:
        if isinstance(tensor, torch.Tensor):
            found.append(tensor)

    if model is not None:
        for parameter in model.parameters():
            add(parameter)
            add(parameter.grad)
        for buffer in model.buffers():
            add(buffer)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                add(parameter)
                add(parameter.grad)
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return found


def reserved_state_bytes(optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """The state ``optimizer`` will allocate on ``device`` at its first step, for the parameters
    that have none yet (0 for an optimizer whose state memfit cannot predict)."""
    if optimizer is None:
        return 0
    kind = type(optimizer)
    slots = STATE_SLOTS.get(kind)
    if slots is None:
        return 0
    total = 0
    for group in optimizer.param_groups:
        extra = _extra_slots(kind, group)
        for parameter in group["params"]:
            if optimizer.state.get(parameter) or parameter.device != device:
                continue
            if not parameter.requires_grad:
                continue
            total += (slots + extra) * local_tensor(parameter).untyped_storage().nbytes()
            if isinstance(optimizer, _HAS_STEP) and _step_on_device(group, device):
                total += _STEP_BYTES
    return total


def _extra_slots(kind: type, group: dict) -> int:
    if kind is torch.optim.SGD:
        return 1 if group.get("momentum", 0) else 0
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return 1 if group.get("amsgrad") else 0
    if kind is torch.optim.RMSprop:
        return int(bool(group.get("momentum", 0))) + int(bool(group.get("centered")))
    return 0


def _step_on_device(group: dict, device: torch.device) -> bool:
    """The Adam family keeps ``step`` on the CPU unless capturable or fused; on a CPU device it
    is device memory either way."""
    return device.type == "cpu" or bool(group.get("capturable") or group.get("fused"))
