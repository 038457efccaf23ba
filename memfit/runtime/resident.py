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
_ADAM_SCALARS_BYTES = 4096  # Adam's 0-dim tensors made per parameter one at a time (its step
# size and bias corrections), a few alive at once, each rounded up by the allocator
_STEP_BYTES = 4  # the float32 "step" counter of the Adam family, a tensor on the param's device
_HAS_STEP = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
             torch.optim.RAdam, torch.optim.Adadelta, torch.optim.Adagrad, torch.optim.RMSprop)


def resident_bytes(model: torch.nn.Module | None,
                   optimizers: Iterable[torch.optim.Optimizer], device: torch.device,
                   partners: Iterable[tuple[torch.nn.Module | None, list]] = ()) -> int:
    """Bytes on ``device`` held by the model and the optimizers, reserved state included, and by
    ``partners`` (other models in the loop, with their optimizers: ``compiler.partners``), whose
    trainable parameters' gradients are reserved too: a partner's backward may run while this
    model's regions do. Each storage once."""
    optimizers = list(optimizers)
    partners = list(partners)
    storages: dict[StorageWeakRef, int] = {}
    owners = [(model, optimizers), *partners]
    for owner, owned in owners:
        for tensor in resident_tensors(owner, owned):
            if tensor.device == device:
                storage = local_tensor(tensor).untyped_storage()
                storages.setdefault(StorageWeakRef(storage), storage.nbytes())
    reserved = sum(reserved_state_bytes(optimizer, device)
                   for _, owned in owners for optimizer in owned)
    gradients = sum(missing_gradient_bytes(owner, device) for owner, _ in partners)
    return (sum(storages.values()) + reserved + gradients
            + sum(bucket_bytes(owner, device) for owner, _ in owners))


def missing_gradient_bytes(model: torch.nn.Module | None, device: torch.device) -> int:
    """Bytes of the gradients ``model``'s trainable parameters on ``device`` will get and have
    not yet (their ``.grad`` is ``None``), each storage once."""
    if model is None:
        return 0
    storages = {StorageWeakRef(local_tensor(p).untyped_storage()):
                local_tensor(p).untyped_storage().nbytes() for p in model.parameters()
                if p.requires_grad and p.grad is None and p.device == device}
    return sum(storages.values())


def has_gradients(model: torch.nn.Module | None) -> bool:
    """Whether any of ``model``'s parameters holds a ``.grad`` now."""
    return model is not None and any(p.grad is not None for p in model.parameters())


def holds_parameters_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    """Whether ``optimizer`` steps any of ``model``'s parameters (the same tensor objects)."""
    mine = {id(parameter) for parameter in model.parameters()}
    return any(id(parameter) in mine for group in optimizer.param_groups
               for parameter in group["params"])


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a ``DTensor``'s local shard (FSDP2's
    parameters, their gradients and optimizer state), whose own ``untyped_storage()`` has the
    whole tensor's size, not the shard's; any other tensor itself."""
    if _DTENSOR is not None and isinstance(tensor, _DTENSOR):
        return tensor._local_tensor  # its shard itself (to_local() dispatches ops)
    return tensor


def _distributed_type(module: str, name: str) -> type | None:
    """``module.name`` (``DTensor``, ``FSDPModule``), where this build of torch has
    ``torch.distributed``; ``None`` where it has not."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_DTENSOR = _distributed_type("torch.distributed.tensor", "DTensor")


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
        sharded = fsdp_sharded_parameters(model)
        for parameter in model.parameters():
            add(sharded.get(id(parameter), parameter))  # an FSDP2 block in flight: its shard
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


def step_temporary_bytes(optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """The most bytes ``optimizer.step()`` allocates at once on ``device`` beyond its state (0
    for an optimizer it cannot tell). Adam and AdamW, one tensor at a time (``foreach=False``,
    the CPU's default): a parameter's square root of its second moment and its quotient, and
    Adam's weight decay's copy of the gradient; SGD: the copies weight decay and Nesterov
    momentum make of the gradient. With ``foreach`` (CUDA's default): one copy of a whole group
    of parameters, the later ops in place on it; ``fused``: none."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if optimizer is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW,
                                                    torch.optim.SGD):
        return 0
    most = 0
    for group in optimizer.param_groups:
        sizes = [local_tensor(parameter).untyped_storage().nbytes()
                 for parameter in group["params"]
                 if parameter.requires_grad and parameter.device == device]
        if not sizes or group.get("fused"):
            continue
        foreach = group.get("foreach")
        if foreach is None:
            _, foreach = _default_to_fused_or_foreach(
                [p for p in group["params"] if p.device == device], False, use_fused=False)
        if isinstance(optimizer, torch.optim.SGD):
            copies = int(bool(group.get("weight_decay"))) + int(bool(group.get("nesterov")))
        else:
            decays = bool(group.get("weight_decay")) and not (
                isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay"))
            copies = 2 + int(decays)
        if foreach:  # one list of copies, the later ops in place on it
            copies = min(copies, 1)
        scalars = _ADAM_SCALARS_BYTES if copies and not foreach and not isinstance(
            optimizer, torch.optim.SGD) else 0
        most = max(most, copies * (sum(sizes) if foreach else max(sizes)) + scalars)
    return most


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


def fsdp_param_groups(model: torch.nn.Module | None) -> list:
    """The parameter group of each FSDP2 unit (``fully_shard``) in ``model``, in module order
    (empty without FSDP2): what it shards, all-gathers and frees."""
    if model is None or _FSDP_MODULE is None:
        return []
    groups = []
    for module in model.modules():
        if isinstance(module, _FSDP_MODULE):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.append(group)
    return groups


_FSDP_MODULE = _distributed_type("torch.distributed.fsdp", "FSDPModule")


def fsdp_unit_modules(model: torch.nn.Module | None) -> list[torch.nn.Module]:
    """The modules of ``model`` that FSDP2 shards one by one (``fully_shard``), in module order,
    ``model`` itself (the root) aside: under ``memfit.fit`` each is its own compiled region
    (FSDP2's hooks are skipped, a graph break at each unit)."""
    if model is None or _FSDP_MODULE is None:
        return []
    return [module for module in model.modules()
            if isinstance(module, _FSDP_MODULE) and module is not model]


def fsdp_sharded_parameters(model: torch.nn.Module | None) -> dict[int, torch.Tensor]:
    """id of each FSDP2 parameter the model holds unsharded now -> its sharded parameter.

    While an FSDP2 block runs, its module's attributes are the all-gathered, unsharded
    parameters (the shards stay alive beside them); what stays resident is the shard, whatever
    is registered at the moment of counting."""
    found: dict[int, torch.Tensor] = {}
    for group in fsdp_param_groups(model):
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                found[id(unsharded)] = fsdp_param.sharded_param
    return found


def fsdp_unsharded_tensors(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """The all-gathered (unsharded) parameter storages FSDP2 holds now: its all-gather outputs
    and the unsharded parameters, where their storage is allocated (FSDP2 frees a block's by
    resizing them to 0 when it reshards)."""
    found: list[torch.Tensor] = []
    for group in fsdp_param_groups(model):
        for fsdp_param in group.fsdp_params:
            tensors = [*getattr(fsdp_param, "all_gather_outputs", ()),
                       *getattr(fsdp_param, "_unsharded_inner_tensors", ())]
            found += [t for t in tensors if t.untyped_storage().nbytes()]
    return found


def fsdp_gather_buffers(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """The flat all-gather buffers FSDP2 holds for units whose parameters it gathered ahead
    (its forward and backward prefetch) but has not yet copied out into their unsharded
    parameters: counted by the plans as FSDP2's in-flight bytes (``fsdp_in_flight_bytes``'s
    prefetched unit), not as eager code's, so that no byte is counted twice (at a stage's
    backward start the stage before it may already sit in such a buffer)."""
    found = []
    for group in fsdp_param_groups(model):
        pending = getattr(group, "_all_gather_result", None)
        output = getattr(pending, "all_gather_output", None)
        if isinstance(output, torch.Tensor) and output.untyped_storage().nbytes():
            found.append(output)
    return found


def fsdp_in_flight_bytes(model: torch.nn.Module | None, device: torch.device) -> int:
    """Bytes of FSDP2's all-gathered parameters alive beside a region that starts now, over its
    forward and backward: those unsharded now (the block in flight, whose parameters the region
    reads, and the root, which FSDP2 keeps unsharded from its forward to the end of backward),
    plus the largest unit not unsharded now, which FSDP2 all-gathers ahead while the region's
    backward runs (its backward prefetch of the block before, in forward order): during a
    block's backward, that block, the one before it and the root are unsharded at once."""
    sizes: dict[StorageWeakRef, int] = {}
    for tensor in fsdp_unsharded_tensors(model):
        if tensor.device == device:
            storage = tensor.untyped_storage()
            sizes.setdefault(StorageWeakRef(storage), storage.nbytes())
    prefetched = [_unsharded_size_bytes(group, device) for group in fsdp_param_groups(model)
                  if not group.is_unsharded]
    return sum(sizes.values()) + max(prefetched, default=0)


def _unsharded_size_bytes(group, device: torch.device) -> int:
    """Bytes one FSDP2 unit's parameters take all-gathered on ``device`` (its padded shards
    times the world size)."""
    total = 0
    for fsdp_param in group.fsdp_params:
        shard = local_tensor(fsdp_param.sharded_param)
        if shard.device == device:
            world = fsdp_param.mesh_info.shard_mesh_size
            total += fsdp_param.padded_sharded_param_size.numel() * world * shard.element_size()
    return total


def device_of(values) -> torch.device:
    """The device of the first tensor among ``values`` (the CPU where there is none)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")
