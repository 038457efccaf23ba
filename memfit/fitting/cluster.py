"""Plans for a cluster from one machine: which modules are FSDP units, and one rank's plan.

``memfit.plan(..., world_size=8, sharding="fsdp")`` traces the whole model once (meta tensors
do), and ``memfit.model.sharding.shard_graph`` turns the step into what one rank holds and waits
for. Here is the torch side of that: the units the user would ``fully_shard`` (found in the
model), and the optimizer state that FSDP shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from memfit.model.sharding import DEFAULT_BUCKET_BYTES, Sharding

FsdpBlock = type | Callable[[str, torch.nn.Module], bool] | Sequence[str] | None


def fsdp_units(model: torch.nn.Module, block: FsdpBlock = None) -> tuple[str, ...]:
    """Module paths of the modules ``fully_shard`` is applied to, the root aside.

    Args:
        model: the model, as ``memfit.plan`` traces it (paths are relative to it).
        block: a module class (every outermost module of that class: ``LlamaDecoderLayer``),
            a predicate ``block(path, module) -> bool`` (outermost matches), or the paths
            themselves. Default: the children of the ``nn.ModuleList`` holding the most
            parameters (a transformer's layers), as torchtitan shards them.

    Raises:
        ValueError: if no module matches (FSDP of the root alone is ``sharding="fsdp"`` with
            ``fsdp_block=[]``).
    """
    if block is not None and not isinstance(block, type) and not callable(block):
        return tuple(block)
    if block is None:
        return _largest_module_list(model)
    if isinstance(block, type):
        kind = block

        def matches(path: str, module: torch.nn.Module) -> bool:
            return isinstance(module, kind)
    else:
        matches = block  # type: ignore[assignment]
    found: list[str] = []
    for path, module in model.named_modules():
        if path and matches(path, module) and not any(path.startswith(f + ".") for f in found):
            found.append(path)
    if not found:
        raise ValueError(f"no module of the model matches fsdp_block={block!r}: name the block "
                         "class (LlamaDecoderLayer) or pass a predicate (path, module) -> bool")
    return tuple(found)


def _largest_module_list(model: torch.nn.Module) -> tuple[str, ...]:
    """Children of the ``ModuleList`` with the most parameter elements (ties: the first)."""
    best, best_count = None, -1
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = path, count
    if best is None:
        raise ValueError("the model has no nn.ModuleList to shard per block: name the units "
                         "with fsdp_block= (a class, a predicate or module paths)")
    prefix = f"{best}." if best else ""
    return tuple(prefix + name for name, _ in model.get_submodule(best).named_children())


def resolve_sharding(model: torch.nn.Module, sharding: str, world_size: int,
                     fsdp_block: FsdpBlock = None,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Sharding:
    """The ``Sharding`` of ``memfit.plan``'s keywords (units found only for FSDP).

    Raises:
        ValueError: for an unknown kind or a bad world size (``Sharding`` checks both), or no
            unit found.
    """
    units = fsdp_units(model, fsdp_block) if sharding == "fsdp" and world_size > 1 else ()
    return Sharding(sharding, world_size, units, bucket_bytes)  # type: ignore[arg-type]

